"""SMET: dynamic sparse training and sparse fine-tuning with a stable Adam and compact optimizer state.

    from hf_sparse_cp.smet import SMETConfig, create_smet_optimizer
    optimizer = create_smet_optimizer(model, torch.optim.AdamW, SMETConfig(density=0.1), lr=1e-3)

* `config.py`: `SMETConfig`;
* `modes/`: the modes (`SMETConfig.mode`), registered by name: `sparse_weights` and `sparse_update` behind one
  interface (`SMETMode`); one of your own joins them through `register_smet_mode`;
* `masks.py`: `BlockGrid` (how a weight, or an MoE's stack of experts' matrices, is cut into blocks), masks and the
  hashed random numbers;
* `rounding.py`: the density as whole blocks per row, and the warning when they move it far;
* `topology.py`: which blocks start active, are pruned and are regrown;
* `optimizer.py`: `SMETAdam`, the compact optimizer state and the cold-start cure of regrown blocks;
* `factory.py`: `create_smet_optimizer` from a stock optimizer class and a model;
* `dtensor.py`: local-shard views of FSDP2 DTensor parameters and states.

With a Trainer: `hf_sparse_cp.install_smet(trainer, config)` (flags:
`hf_sparse_cp.SMETArguments`).
"""

from .config import SMETConfig
from .factory import SMETOptimizerFactory, create_smet_optimizer, smet_param_groups, state_nbytes
from .modes import SMETMode, register_smet_mode, smet_mode_named, smet_modes
from .optimizer import SMETAdam, unwrap_smet

__all__ = [
    "SMETAdam",
    "SMETConfig",
    "SMETMode",
    "SMETOptimizerFactory",
    "create_smet_optimizer",
    "register_smet_mode",
    "smet_mode_named",
    "smet_modes",
    "smet_param_groups",
    "state_nbytes",
    "unwrap_smet",
]
