"""How a sequence splits over a CP group: block splits (`blocks.py`) and the document-aware split, whose planner
(`documents.py`) weighs a row's work with `document_costs.py`, places its documents with `document_placement.py`
(estimating a placement's ring time with `ring_time.py`), reads the runs it places from a batch with
`document_runs.py` and returns a `document_plan.DocumentPlan`."""
