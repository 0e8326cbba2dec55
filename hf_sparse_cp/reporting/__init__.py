"""What a run reports: the model card (`model_card.py`, with its YAML front matter in `card_metadata.py` and its quick
start in `card_quick_start.py`), the logged kept fraction read back and drawn (`kept_fraction_figure.py`), and the
figures of `hf-sparse-cp plot` (`plots.py`)."""
