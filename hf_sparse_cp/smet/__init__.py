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
* `optimizer.py`: `SMETAdam`, the compact optimizer state and the cold-start cure of regrown blocks: its update in
  `adam.py`, its state saved and loaded (with the checks loading makes) in `checkpoint.py`;
* `factory.py`: `create_smet_optimizer` from a stock optimizer class and a model;
* `dtensor.py`: local-shard views of FSDP2 DTensor parameters and states.

With a Trainer: `hf_sparse_cp.install_smet(trainer, config)` (flags:
`hf_sparse_cp.SMETArguments`).
"""

from ..lazy import lazy_attributes
from .config import SMETConfig
from .modes import SMETMode, register_smet_mode, smet_mode_named, smet_modes

# The optimizer's names import torch (its DTensor support too) on first use: the launcher reads `SMETConfig` (the
# --smet* flags) before it starts any process, where torch.distributed.tensor alone took half a second to import.
__getattr__ = lazy_attributes(__name__, {
    "SMETOptimizerFactory": "factory", "create_smet_optimizer": "factory", "smet_param_groups": "factory",
    "state_nbytes": "factory", "SMETAdam": "optimizer", "unwrap_smet": "optimizer"})

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
