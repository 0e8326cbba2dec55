"""Deprecated location of the Trainer's context-parallel patch (before 0.2): import it from
`hf_sparse_cp.integration`. Kept so that scripts written for 0.1's README keep running."""

import warnings

from .integration.context_parallel import disable_trainer_context_parallel, enable_trainer_context_parallel

warnings.warn("hf_sparse_cp.trainer_cp moved to hf_sparse_cp.integration.context_parallel; import its functions "
              "from hf_sparse_cp.integration instead.", DeprecationWarning, stacklevel=2)

__all__ = ["disable_trainer_context_parallel", "enable_trainer_context_parallel"]
