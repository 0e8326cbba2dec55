"""The package's version: a leaf that imports nothing, read by setup.cfg, `hf-sparse-cp --version` and the
environment report without importing torch."""

__version__ = "0.1.0"
