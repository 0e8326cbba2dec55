"""Deprecated location of `SparseCPArguments` (before 0.2): import it from `hf_sparse_cp` or
`hf_sparse_cp.integration`. Kept so that scripts written for 0.1's README keep running."""

import warnings

from .integration.arguments import SparseCPArguments

warnings.warn("hf_sparse_cp.arguments moved to hf_sparse_cp.integration.arguments; import SparseCPArguments from "
              "hf_sparse_cp instead.", DeprecationWarning, stacklevel=2)

__all__ = ["SparseCPArguments"]
