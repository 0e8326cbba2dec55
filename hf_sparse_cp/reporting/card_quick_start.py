"""The model card's "Quick start" (`model_card.py`): how to load the saved model, a whole model or a PEFT adapter onto
its base model, with the transformers class that loads its head, and how to train on with the sparse pattern
(`quick_start`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import Trainer

from ..checkpoint_marker import newest_complete_checkpoint
from ..config import SparseAttentionConfig

# Files of a saved tokenizer (`save_pretrained` writes the config; fast tokenizers also tokenizer.json).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def model_name(trainer: Trainer) -> str:
    """Where the saved model is loaded from: the Hub repo the Trainer pushes to (`trainer.hub_model_id`, the repo's
    whole id, set once it has created it: `<user>/<output folder's name>` without --hub_model_id), else the output
    folder (also with a --hub_model_id never pushed to)."""
    return getattr(trainer, "hub_model_id", None) or trainer.args.output_dir


# Files that mark a model saved in a folder: a whole model's config, a PEFT adapter's.
SAVED_MODEL_FILES = ("config.json", "adapter_config.json")


def _load_from(trainer: Trainer, output_dir: Path) -> tuple[str, list[str]]:
    """Where the quick start loads the model from (`model_name`), and a note where the output folder holds no saved
    model (#50: `hf-sparse-cp train` without --save_final_model wrote a card whose quick start loaded a folder holding
    none): its last complete checkpoint where there is one, else the folder, saying that nothing is saved there yet."""
    name = model_name(trainer)
    if name != trainer.args.output_dir or any((output_dir / file).is_file() for file in SAVED_MODEL_FILES):
        return name, []
    # (the newest complete one: a run stopped while saving leaves a newer folder that does not load)
    checkpoint = newest_complete_checkpoint([output_dir])[0]
    if checkpoint is not None:
        checkpoint = str(checkpoint)
        return checkpoint, [f"No final model is saved in `{output_dir}`: the code below loads its last checkpoint, "
                            f"`{Path(checkpoint).name}`.", ""]
    return name, [f"No model was saved in `{output_dir}` when this card was written: `Trainer.save_model()` writes it "
                  "there (`hf-sparse-cp train`: --save_final_model).", ""]

def peft_model_of(trainer: Trainer) -> Any:
    """The trained PEFT model (the Trainer then saves only its adapter: adapter_config.json and the adapter's
    weights, no config.json), or None. A model is a PEFT model only where `peft` was imported."""
    peft = sys.modules.get("peft")
    model = trainer.accelerator.unwrap_model(trainer.model)
    return model if peft is not None and isinstance(model, peft.PeftModel) else None


def _saves_tokenizer(trainer: Trainer, output_dir: Path) -> bool:
    """Whether a tokenizer is saved beside the model: its files are in `output_dir`, or the Trainer saves one with
    the model (its processing class, else its collator's tokenizer, as `Trainer._save` does)."""
    if any((output_dir / name).is_file() for name in TOKENIZER_FILES):
        return True
    return trainer.processing_class is not None or getattr(trainer.data_collator, "tokenizer", None) is not None


class _Loader(NamedTuple):
    """How the card's quick start loads the saved model: the transformers class to call `from_pretrained` on, and
    whether the model generates (a classification head runs a forward instead)."""

    name: str
    generates: bool


def _loader(model: torch.nn.Module) -> _Loader:
    """The class that loads `model`'s checkpoint as `model` (its head included): the Auto class whose mapping names
    its transformers class (a class FSDP2 made, FSDPLlamaForCausalLM, read as the class it subclasses), else that
    class itself. AutoModelForCausalLM loads a sequence-classification checkpoint into a causal LM, its `score`
    head dropped for a new random `lm_head` (a warning its only sign), and has no `generate` to call."""
    from transformers.models.auto import modeling_auto

    generates = bool(getattr(model, "can_generate", lambda: True)())
    classes = [c.__name__ for c in type(model).__mro__ if c.__module__.startswith("transformers.models.")]
    for name in classes:
        for auto, mapping in _AUTO_CLASSES:
            names = getattr(modeling_auto, mapping, {}).values()
            if any(name == value or (isinstance(value, tuple) and name in value) for value in names):
                return _Loader(auto, generates)
    return _Loader(classes[0] if classes else "AutoModelForCausalLM", generates)


# The Auto classes a trained model's card may load it with, in the order they are tried (a class in several
# mappings, e.g. a vision-language model's, loads with the first).
_AUTO_CLASSES = (("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
                 ("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),
                 ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
                 ("AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
                 ("AutoModelForQuestionAnswering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"),
                 ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"))


def _generate_lines(tokenizer: str | None, generates: bool = True) -> list[str]:
    if tokenizer is None:
        return ["# no tokenizer was saved with the model: tokenize with the one it was trained with"]
    return [f'tokenizer = AutoTokenizer.from_pretrained("{tokenizer}")',
            'inputs = tokenizer("Once upon a time", return_tensors="pt")',
            "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0]))" if generates else
            "print(model(**inputs))"]


def _imports(model: str | None, tokenizer: str | None) -> str:
    return ", ".join([model] * (model is not None) + ["AutoTokenizer"] * (tokenizer is not None))


def _load_base(base: str | None, loader: _Loader, extra: str = "") -> str:
    if not base:
        return "base = ...  # the base model the adapter was trained on (adapter_config.json names none)"
    return f'base = {loader.name}.from_pretrained("{base}"{extra})'


def _adapter_quick_start(peft_model: Any, sparse: SparseAttentionConfig | None, tokenizer: str | None,
                         name: str) -> list[str]:
    """How to load a PEFT adapter (saved in `name`) onto its base model (the one adapter_config.json names, or the
    user's when it names none: a base model built from a config) and generate, and how to train on with the sparse
    pattern."""
    base = peft_model.active_peft_config.base_model_name_or_path
    loader = _loader(peft_model.get_base_model())
    where = f"its base model, `{base}` (named in adapter_config.json)" if base else \
        "the base model it was trained on (adapter_config.json names none)"
    # (not "this folder holds": the card may be written before the adapter is saved, or load the last checkpoint's)
    lines = [f"The model is a PEFT adapter (adapter_config.json and its weights), not a whole model: load it onto "
             f"{where} with `peft`. It loads and {_runs(loader)} without `hf-sparse-cp`, with any attention "
             "implementation:", "", "```python", "from peft import PeftModel",
             *([f"from transformers import {_imports(loader.name if base else None, tokenizer)}"]
               if base or tokenizer else []), "",
             _load_base(base, loader), f'model = PeftModel.from_pretrained(base, "{name}")',
             *_generate_lines(tokenizer, loader.generates),
             "```", ""]
    if sparse is not None:
        lines += ["To train on with the sparse pattern, load the base model with `attn_implementation=\"sparse_cp\"`, "
                  "configure the pattern on it (the one above: an adapter saves no config.json to hold it) and add "
                  "the adapter:", "", "```python", "import hf_sparse_cp", "from peft import PeftModel",
                  *([f"from transformers import {loader.name}"] if base else []), "", "hf_sparse_cp.patch()",
                  _load_base(base, loader, ', attn_implementation="sparse_cp"'),
                  f"hf_sparse_cp.configure(base, hf_sparse_cp.SparseAttentionConfig.from_dict({sparse.given()!r}))",
                  f'model = PeftModel.from_pretrained(base, "{name}", is_trainable=True)', "```", ""]
    return lines


def quick_start(trainer: Trainer, sparse: SparseAttentionConfig | None, output_dir: Path) -> list[str]:
    """The card's "Quick start": how to load the saved model (a whole model, or a PEFT adapter onto its base
    model) and generate, and how to train on with the sparse pattern."""
    name, note = _load_from(trainer, output_dir)
    tokenizer = name if _saves_tokenizer(trainer, output_dir) else None
    peft_model = peft_model_of(trainer)
    if peft_model is not None:
        return note + _adapter_quick_start(peft_model, sparse, tokenizer, name)
    loader = _loader(trainer.accelerator.unwrap_model(trainer.model))
    lines = [*note, f"The weights are a standard transformers checkpoint: the model loads and {_runs(loader)} without "
             "`hf-sparse-cp`, with any attention implementation (e.g. `attn_implementation=\"sdpa\"`):", "",
             "```python", f"from transformers import {_imports(loader.name, tokenizer)}", "",
             f'model = {loader.name}.from_pretrained("{name}")', *_generate_lines(tokenizer, loader.generates),
             "```", ""]
    if sparse is not None:
        lines += ["To train on with the sparse pattern, call `hf_sparse_cp.patch()` and load it with "
                  "`attn_implementation=\"sparse_cp\"`.", ""]
    return lines


def _runs(loader: _Loader) -> str:
    return "generates" if loader.generates else "runs"
