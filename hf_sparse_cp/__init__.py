"""hf-sparse-cp: dynamic sparse attention and sparse context parallelism for the Hugging Face Trainer.

Importing the package changes nothing; `hf_sparse_cp.patch()` registers the `sparse_cp` attention
backend (select it with `attn_implementation="sparse_cp"`) and `hf_sparse_cp.unpatch()` undoes it.

The package is laid out by idea, with one import direction:
`trainer -> reporting / resharding -> integration -> distributed -> attention -> config`
(`kernels` a leaf, `loss` and `smet` beside the model path, `simulator` beside the training path,
`testing` and `examples` on top). The names below are its public API, each imported on first use:
`import hf_sparse_cp` imports neither torch nor transformers, so that the command line answers `--help`,
`--version` and `recipes` at once.
"""

from .lazy import lazy_attributes
from .version import __version__

# Public names, each loaded from its module on first access.
_LAZY = {
    "SparseLayout": "attention",
    "TokenMeta": "attention",
    "block_sparse_attention": "attention",
    "estimate_layout": "attention",
    "BACKEND_NAME": "config",
    "SparseAttentionConfig": "config",
    "ContextParallelConfig": "distributed",
    "configure": "integration.registration",
    "is_patched": "integration.interfaces",
    "patch": "integration.interfaces",
    "unpatch": "integration.interfaces",
    "sparse_cp_attention_forward": "integration.backend",
    "disable_lean_loss": "integration.lean_loss",
    "enable_lean_loss": "integration.lean_loss",
    "is_lean_loss_enabled": "integration.lean_loss",
    "check_model_supports_context_parallel": "integration.models",
    "SMETArguments": "trainer.arguments",
    "SparseAttentionFlags": "trainer.arguments",
    "SparseCPArguments": "trainer.arguments",
    "explicit_fields": "trainer.arguments",
    "attach_to_trainer": "trainer.attach",
    "checkpointing_enabled": "trainer.attach",
    "detach_from_trainer": "trainer.attach",
    "disable_sparse_attention": "trainer.attach",
    "enable_sparse_attention": "trainer.attach",
    "SMETCallback": "trainer.callbacks",
    "SparsityLoggingCallback": "trainer.callbacks",
    "disable_trainer_context_parallel": "trainer.context_parallel",
    "enable_trainer_context_parallel": "trainer.context_parallel",
    "disable_cpu_fsdp2": "trainer.cpu_fsdp",
    "enable_cpu_fsdp2": "trainer.cpu_fsdp",
    "CurriculumArguments": "trainer.schedule",
    "disable_curriculum": "trainer.curriculum",
    "enable_curriculum": "trainer.curriculum",
    "parse_schedule": "trainer.schedule",
    "schedule_cp_config": "trainer.schedule",
    "install_smet": "trainer.smet",
    "uninstall_smet": "trainer.smet",
    "SparseTrainer": "trainer.sparse_trainer",
    "SparseTrainerMixin": "trainer.sparse_trainer",
    "SparseTrainingArguments": "trainer.sparse_trainer",
    "sparse_arguments_class": "trainer.sparse_trainer",
    "sparse_trainer_class": "trainer.sparse_trainer",
    "write_sparse_model_card": "reporting.model_card",
}
# TRL's SFT, DPO, KTO and Reward with the plugin (needs `pip install trl`; not in `__all__`, so `import *` does not
# import TRL).
_TRL = {f"Sparse{kind}{part}": "trainer.trl" for kind in ("SFT", "DPO", "KTO", "Reward")
        for part in ("Config", "Trainer")}
__getattr__ = lazy_attributes(__name__, _LAZY | _TRL)


__all__ = ["__version__", *sorted(_LAZY)]
