"""What a run reports: the model card (`model_card.py`), the logged kept fraction read back and drawn
(`kept_fraction.py`), and the figures of `hf-sparse-cp plot` (`plots.py`)."""
