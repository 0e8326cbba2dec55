"""The `compute_loss` methods of the Trainer and of TRL's trainers that context parallelism reproduces, by how: exactly
on the shards (`cp_exact_losses`), or from the outputs of whole rows gathered over the CP group
(`cp_whole_row_losses`; of rows generated in the step, `cp_generated_row_losses`; of a sequence-classification
head's scores, `cp_row_score_losses`). TRL's are read where a script imported TRL; `compat.PATCHES` lists each."""

from __future__ import annotations

import sys
from collections.abc import Callable

# TRL's trainers that generate their rows in the step (`trainer/generated_rows.py`), by name: trl.<name>Trainer,
# trl.<name>Config and their module trl.trainer.<name, lower case>_trainer
GENERATING = ("GRPO", "RLOO")
# TRL's experimental trainers whose loss CP reproduces on whole rows: (module, class), read where a script imported them
WHOLE_ROW_EXPERIMENTAL = (("trl.experimental.orpo", "ORPOTrainer"), ("trl.experimental.cpo", "CPOTrainer"))


def cp_exact_losses() -> tuple[Callable, ...]:
    """The `compute_loss` methods whose loss CP reproduces to rounding: the Trainer's (the model's mean over label
    tokens, which the plugin shards with the labels) and TRL SFTTrainer's (that loss, with its token metrics)."""
    from transformers import Trainer

    trl = sys.modules.get("trl")  # (imported wherever such a trainer exists)
    return (Trainer.compute_loss,) + ((trl.SFTTrainer.compute_loss,) if trl is not None else ())


def cp_whole_row_losses() -> tuple[Callable, ...]:
    """The `compute_loss` methods built from the outputs of whole rows that CP reproduces to rounding by gathering
    each forward's outputs over the CP group (`trainer/whole_rows.py`): TRL DPOTrainer's and KTOTrainer's (per-token
    log-probabilities), RewardTrainer's (a sequence-classification head's score of each row's last token) and, where
    imported, the experimental ORPOTrainer's and CPOTrainer's (a plain forward's logits)."""
    trl = sys.modules.get("trl")
    if trl is None:
        return ()
    experimental = tuple(getattr(sys.modules[module], name).compute_loss for module, name in WHOLE_ROW_EXPERIMENTAL
                         if module in sys.modules)
    return (trl.DPOTrainer.compute_loss, trl.KTOTrainer.compute_loss, *cp_row_score_losses(),
            *cp_generated_row_losses(), *experimental)


def cp_generated_row_losses() -> tuple[Callable, ...]:
    """Those of `cp_whole_row_losses` whose rows the trainer generates in the step (TRL GRPOTrainer's and
    RLOOTrainer's, `GENERATING`: `trainer/generated_rows.py`)."""
    trl = sys.modules.get("trl")
    return tuple(getattr(trl, f"{name}Trainer").compute_loss for name in GENERATING) if trl is not None else ()


def cp_row_score_losses() -> tuple[Callable, ...]:
    """Those of `cp_whole_row_losses` built from a sequence-classification head's score of each row (TRL
    RewardTrainer's); the others are a language model's."""
    trl = sys.modules.get("trl")
    return (trl.RewardTrainer.compute_loss,) if trl is not None else ()
