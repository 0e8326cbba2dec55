"""How a sequence splits over a CP group: block splits (`blocks.py`) and the document-aware split (`documents.py`),
whose planner estimates a placement's ring time with `ring_time.py`."""
