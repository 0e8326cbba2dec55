"""The model card's YAML front matter, made one a Hub page accepts (`hub_metadata`): the plugin's tags, a license id,
`base_model` and `datasets` as Hub ids only (`is_hub_id`), and the stock card's sentences that name a local model or
no model corrected."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import Trainer

from .card_quick_start import model_name, peft_model_of

TAGS = ("hf-sparse-cp", "long-context", "sparse-attention")
# Arguments of `create_model_card` (the stock one's, TRL's, the plugin's) that name the training data.
_DATASET_KEYS = ("datasets", "dataset_tags", "dataset_name", "dataset")
# What `datasets` records as the builder of `from_generator`'s data (run_clm.py --streaming splits a text file into
# two of them): no dataset's name. The stock card names it a Hub dataset, as it leaves out csv, json, text, ...
GENERATOR = "generator"
# PEFT's tag naming an adapter's base model (written with an empty name for a base model built from a config).
_ADAPTER_TAG = "base_model:adapter:"
# Model sources that are files, never Hub ids.
_FILE_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt")
# TRL's card, for a run without a Hub base model or Hub id: its base-model link, title and quick start name None
# (the quick start, a `pipeline(model="None")`, is dropped: the plugin's section has one that names the model).
_TRL_NONE_LINK = "[None](https://huggingface.co/None)"
_TRL_NONE_TITLE = re.compile(r"^# Model Card for None$", re.MULTILINE)
_OWN_QUICK_START = re.compile(r"^## Quick start\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
# TRL writes `licence: license` (a misspelt key holding a placeholder) into every card's metadata.
_TRL_LICENCE = "licence"
# The stock card's sentence for a model built from a config, and for one loaded from a local folder (which
# `hub_metadata` names).
FROM_SCRATCH = "This model was trained from scratch on"


def is_hub_id(name: Any) -> bool:
    """Whether `name` can be a Hugging Face Hub repository id (`Qwen/Qwen2.5-0.5B`, `gpt2`) and is not a path on
    this machine: what the card's `base_model` and `datasets` metadata may hold."""
    if not isinstance(name, str) or not name or os.path.exists(name) or name.endswith(_FILE_SUFFIXES):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def split_front_matter(card: str) -> tuple[dict, str]:
    if card.startswith("---\n") and "\n---\n" in card[3:]:
        end = card.index("\n---\n", 3)
        return yaml.safe_load(card[4:end]) or {}, card[end + 5:]
    return {}, card


def _as_list(value: Any) -> list:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def hub_metadata(card: str, trainer: Trainer, given: dict[str, Any]) -> str:
    """`card` with YAML front matter that a Hub page accepts: `TAGS` added to its tags (PEFT's adapter tag only with
    a Hub id); `license` (given, or the
    card's) as a lowercase license id; `base_model` only a Hub id (given as `base_model` or `finetuned_from`, or
    the card's, or the model's origin), omitted for a local model; `datasets` only Hub ids (given as `datasets`,
    `dataset_tags`, `dataset_name` or `dataset`, or the card's). The stock card's sentence that links a local
    base model to the Hub names it as local instead, and the one that calls a model loaded from a local folder (the
    stock card links Hub ids only) trained from scratch names the model it was fine-tuned from."""
    metadata, body = split_front_matter(card)
    tags = _as_list(metadata.get("tags"))
    metadata["tags"] = list(dict.fromkeys([*tags, *_as_list(given.get("tags")), *TAGS]))
    metadata.pop(_TRL_LICENCE, None)
    license_ = given.get("license") or metadata.get("license")
    if license_:
        metadata["license"] = str(license_).lower()
    base = (given.get("base_model") or given.get("finetuned_from") or metadata.get("base_model")
            or recorded_base_model(getattr(getattr(trainer.model, "config", None), "_name_or_path", None)))
    metadata.pop("base_model", None)
    # PEFT's tag names the adapter's base model (empty for one built from a config): as `base_model`, a Hub id or none
    metadata["tags"] = [tag for tag in metadata["tags"] if not str(tag).startswith(_ADAPTER_TAG)]
    if isinstance(base, str) and base:
        link = f"[{base}](https://huggingface.co/{base})"
        if is_hub_id(base):
            metadata["base_model"] = base
            if peft_model_of(trainer) is not None:
                metadata["tags"].append(f"{_ADAPTER_TAG}{base}")
            base_named = link
        else:
            base_named = f"a local model (`{base}`)"
            body = body.replace(link, base_named)
        body = body.replace(_TRL_NONE_LINK, base_named)
        # (the stock card calls a model loaded from a local folder trained from scratch)
        body = body.replace(FROM_SCRATCH, f"This model is a fine-tuned version of {base_named} on")
    body = body.replace(f"This model is a fine-tuned version of {_TRL_NONE_LINK}", "This model was trained from "
                        "scratch")
    body = _TRL_NONE_TITLE.sub(f"# Model Card for {Path(model_name(trainer)).name}", body)
    body = _OWN_QUICK_START.sub("", body)
    named = [name for key in _DATASET_KEYS for name in _as_list(given.get(key))] or _as_list(metadata.get("datasets"))
    datasets = list(dict.fromkeys(name for name in named if is_hub_id(name) and name != GENERATOR))
    metadata.pop("datasets", None)
    if datasets:
        metadata["datasets"] = datasets
    return f"---\n{yaml.dump(metadata, sort_keys=False)}---\n{body}"


def recorded_base_model(source: Any) -> Any:
    """The model a run started from, as far as the run can know it: `source` (the model config's `_name_or_path`)
    when it is a Hub id; for a folder that an earlier run saved, the `base_model` its card records (that run's own
    origin); else `source` as it is."""
    if isinstance(source, str) and os.path.isdir(source) and (Path(source) / "README.md").is_file():
        recorded = split_front_matter((Path(source) / "README.md").read_text(encoding="utf-8"))[0].get("base_model")
        if is_hub_id(recorded):
            return recorded
    return source
