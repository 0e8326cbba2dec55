"""Triton block-sparse flash-attention kernels, installed as `hf_sparse_cp.kernels` (see README.md here).

A leaf: the modules take raw tensors and import nothing from the rest of hf_sparse_cp. This file
imports none of them either, so that importing the package costs nothing.

Run from the repository root, Python puts the root on `sys.path`, where this folder also looks like
a top-level package named `kernels`: the name of the Hugging Face Hub's kernels package, which
transformers probes for at import time. Imported under that name, this module steps aside: it
loads the Hub's package when it is installed, and otherwise leaves an empty stand-in without
`__file__` or `__version__`, which transformers (like Python for an empty namespace package)
takes as "not installed".
"""

if __name__ != "hf_sparse_cp.kernels":
    import importlib
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = sys.path[:]
    sys.path[:] = [p for p in _path if os.path.abspath(p or os.curdir) != _root]
    del sys.modules[__name__]
    try:
        sys.modules[__name__] = importlib.import_module(__name__)
    except ModuleNotFoundError:
        sys.modules[__name__] = sys.modules.get(__name__) or type(sys)(__name__)
        sys.modules[__name__].__file__ = None
        sys.modules[__name__].__path__ = []
    finally:
        sys.path[:] = _path
