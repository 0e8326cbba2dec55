"""Everything that touches transformers and accelerate: the registered attention function, patch /
unpatch, the lean-loss forward, Trainer glue, callbacks, command-line arguments, model checks, and
`compat.py`, the one module that names their private members.

* `backend.py`: `sparse_cp_attention_forward`, the function transformers calls per layer;
* `registration.py`: `patch`, `unpatch`, `configure`;
* `lean_loss.py`: `enable_lean_loss` / `disable_lean_loss` (causal-LM loss without full logits);
* `sparse_trainer.py`: `SparseTrainingArguments` and `SparseTrainer`, the one switch for a Trainer script;
* `trainer.py`: `enable_sparse_attention`, `attach_to_trainer` and their undo calls (the functional API);
* `context_parallel.py`: `enable_trainer_context_parallel` (the Trainer's CP input preparation);
* `curriculum.py`: `--cp_schedule`, a context-length curriculum switched online (`enable_curriculum`);
* `cpu_fsdp.py`: `enable_cpu_fsdp2` / `disable_cpu_fsdp2` (`--fsdp` as FSDP2 on CPU processes);
* `smet.py`: `install_smet` / `uninstall_smet`;
* `model_card.py`: the card that says how a model was trained; `kept_fraction.py`: the logged kept
  fraction read back and drawn;
* `arguments.py`, `callbacks.py`, `stats.py`, `models.py`, `checkpoints.py`, `patching.py`, `compat.py`.

The names below load their module on first access.
"""

from ..lazy import lazy_attributes

_WHERE = {
    "SMETArguments": "arguments",
    "SparseCPArguments": "arguments",
    "explicit_fields": "arguments",
    "sparse_cp_attention_forward": "backend",
    "SMETCallback": "callbacks",
    "SparsityLoggingCallback": "callbacks",
    "disable_cpu_fsdp2": "cpu_fsdp",
    "enable_cpu_fsdp2": "cpu_fsdp",
    "CurriculumArguments": "curriculum",
    "disable_curriculum": "curriculum",
    "enable_curriculum": "curriculum",
    "parse_schedule": "curriculum",
    "disable_trainer_context_parallel": "context_parallel",
    "enable_trainer_context_parallel": "context_parallel",
    "disable_lean_loss": "lean_loss",
    "enable_lean_loss": "lean_loss",
    "is_lean_loss_enabled": "lean_loss",
    "check_model_supports_context_parallel": "models",
    "configure": "registration",
    "is_patched": "registration",
    "patch": "registration",
    "unpatch": "registration",
    "SparseTrainer": "sparse_trainer",
    "SparseTrainingArguments": "sparse_trainer",
    "install_smet": "smet",
    "write_sparse_model_card": "model_card",
    "uninstall_smet": "smet",
    "attach_to_trainer": "trainer",
    "checkpointing_enabled": "trainer",
    "detach_from_trainer": "trainer",
    "disable_sparse_attention": "trainer",
    "enable_sparse_attention": "trainer",
}
__getattr__ = lazy_attributes(__name__, _WHERE)
__all__ = sorted(_WHERE)
