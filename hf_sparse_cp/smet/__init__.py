"""SMET: dynamic sparse training and sparse fine-tuning with a stable Adam and compact optimizer state.

    from hf_sparse_cp.smet import SMETConfig, create_smet_optimizer
    optimizer = create_smet_optimizer(model, torch.optim.AdamW, SMETConfig(density=0.1), lr=1e-3)

With a Trainer: `install_smet(trainer, config)` (flags: `SMETArguments`).
"""

from .config import SMETConfig
from .factory import SMETOptimizerFactory, create_smet_optimizer, smet_param_groups, state_nbytes
from .optimizer import SMETAdam
from .trainer import SMETArguments, SMETCallback, install_smet, smet_optimizer_cls_and_kwargs

__all__ = [
    "SMETAdam",
    "SMETArguments",
    "SMETCallback",
    "SMETConfig",
    "SMETOptimizerFactory",
    "create_smet_optimizer",
    "install_smet",
    "smet_optimizer_cls_and_kwargs",
    "smet_param_groups",
    "state_nbytes",
]
