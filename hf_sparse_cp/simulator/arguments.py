"""The command-line arguments that `hf-sparse-cp simulate` and `hf-sparse-cp memory` share, read in one place: the
model (a preset, or any causal LM's `config.json`), the CP mode (`--cp_mode`, `--cp_ulysses_size`, as training takes
them, answered by the registered mode objects) and, for `simulate`, the cluster (a preset, or its GPU's FLOP/s,
GPUs per node and link bandwidths). A flag both commands take is added here once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from huggingface_hub.errors import StrictDataclassError

from ..config.files import adapter_base, did_you_mean
from ..distributed.cp_config import ContextParallelConfig
from ..distributed.modes import CPMode, cp_modes
from ..memory.savers import CHECKPOINTING_MIN_LENGTH, from_min_length
from .lora import ALL_LINEAR, MODULE_INPUTS
from .shapes import DECODER_FIELDS, ModelShape, check_decoder_sizes
from .simulate import Cluster, Link
from .step_model import CLUSTERS, HARDWARE, PEAK_TFLOPS, Hardware


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (its command lines), and every flag's default after its help, unless the help
    already says it (`default 0.9: 72 GB of 80`) or there is none to say (None: the help says what stands in)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or re.search(r"\(default[ :)]|default:", action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


class FlagParser(argparse.ArgumentParser):
    """An `ArgumentParser` that takes every long flag in both spellings, dashes or underscores between its words
    (`--cp-mode` for `--cp_mode`, `--seq_len` for `--seq-len`): the commands' own flags mix the two (the CP flags
    are training's), so no spelling is wrong. `--help` shows the documented one. `aliases`: other names taken for a
    flag (training's `--cp_size` for `--cp`), read as it, so that its errors name the documented flag alone."""

    def __init__(self, *args, aliases: dict[str, str] | None = None, **kwargs) -> None:
        kwargs.setdefault("epilog", "Every flag is also taken with underscores for its dashes, or dashes for its "
                          "underscores (--cp-mode for --cp_mode).")
        super().__init__(*args, **kwargs)
        self.aliases = aliases or {}

    def _known(self, flag: str) -> bool:
        """Whether `flag` is a flag of this parser, or the start of one (argparse takes an unambiguous prefix)."""
        return any(option.startswith(flag) for option in self._option_string_actions)

    def _documented(self, arg: str) -> str:
        """`arg` (a command-line word) with a flag in the other spelling replaced by the documented one."""
        flag, sep, value = arg.partition("=")
        if not flag.startswith("--") or self._known(flag):
            return arg
        for other in (flag, flag[:2] + flag[2:].replace("-", "_"), flag[:2] + flag[2:].replace("_", "-")):
            if other in self.aliases or self._known(other):
                return self.aliases.get(other, other) + sep + value
        return arg

    def _with_dashed_values(self, args: list[str]) -> list[str]:
        """`args` with a value that starts with a dash joined to its flag (`--gpu-memory -5GB` -> `--gpu-memory=-5GB`):
        argparse takes a word like -5GB for a flag and says only 'expected one argument', while the flag's own check
        names the valid form. Negative numbers argparse takes as values already; a flag's word stays a flag."""
        out = []
        for word in args:
            action = self._option_string_actions.get(out[-1]) if out else None
            if (action is not None and action.nargs != 0 and word.startswith("-") and word != "--"
                    and not self._negative_number_matcher.match(word) and not self._known(word.partition("=")[0])):
                out[-1] = f"{out[-1]}={word}"
            else:
                out.append(word)
        return out

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        end = args.index("--") if "--" in args else len(args)  # (words after `--` are values, never flags)
        parsed, rest = super().parse_known_args([*self._with_dashed_values([*map(self._documented, args[:end])]),
                                                 *args[end:]], namespace)
        for action in self._actions:  # ('' was read as no value: `--json ''` wrote the default file)
            value = getattr(parsed, action.dest, None)
            if action.option_strings and isinstance(value, str) and not value.strip():
                self.error(f"{action.option_strings[0]} {value!r} is empty (an unset shell variable?): give its value, "
                           "or drop the flag.")
        return parsed, rest

    def parse_args(self, args=None, namespace=None):
        parsed, rest = self.parse_known_args(args, namespace)
        if rest:  # (argparse's own message, with the flags close to a mistyped one named)
            self.error(f"unrecognized arguments: {' '.join(rest)}{did_you_mean(self, rest)}")
        return parsed


def positive(kind: type = float) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` above 0 (a whole number: `at_least(1)`)."""
    if kind is int:
        return at_least(1)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; give one above 0, without a unit (the "
                                             "flag's help names its unit)") from None
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"{value} must be > 0 and finite")
        return value

    return parse


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= `low`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give one >= {low} in digits alone "
                                             "(no unit or suffix: 131072, not 128k)") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value

    return parse


def fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a fraction in (0, 1], e.g. 0.063 for "
                                         "6.3%") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} must be in (0, 1], a fraction (e.g. 0.063 for 6.3%)")
    return value


def add_model_arguments(parser: argparse.ArgumentParser, presets: Iterable[str], default: str | None) -> None:
    """`--model PRESET` or `--config CONFIG_JSON` (one of them; `default` the preset when neither is given, None:
    one is required)."""
    names = sorted(presets)
    group = parser.add_mutually_exclusive_group(required=default is None)
    group.add_argument("--model", type=_preset(names), metavar="{" + ",".join(names) + "}", default=default,
                       help="A model preset (the shapes listed); or --config.")
    group.add_argument("--config", metavar="CONFIG_JSON",
                       help="Any causal LM's config.json (the file, or a saved model's folder holding it; nothing is "
                       "downloaded), or its GGUF file: its shape instead of a preset's, e.g. a Llama-3-8B's.")


def _preset(names: list[str]) -> Callable[[str], str]:
    """An argparse type: one of the preset `names`; a path (a model's folder or file) or a Hub id is refused naming
    --config, the flag that reads it, as argparse's "invalid choice" did not."""

    def parse(text: str) -> str:
        if text in names:
            return text
        if Path(text).exists():
            raise argparse.ArgumentTypeError(f"{text!r} is a path, not a preset: give a model's folder, config.json "
                                             f"or GGUF file as --config {text}")
        known = [name for name in names if name == text.rsplit("/", 1)[-1].lower()]
        hint = (f"--model {known[0]} is its preset" if known else
                "--config reads any other model's config.json (a local file: nothing is downloaded)")
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(names)}); {hint}")

    return parse


def read_config(path: str):
    """The transformers config of a `config.json` file, of a folder holding one, or of a GGUF file.

    Raises:
        ValueError: no such file, not JSON, no known `model_type`, or not a causal language model's; the message
            names the path and the fix.
    """
    from transformers import AutoConfig

    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    _refuse_adapter(path, file)
    if not file.is_file():
        where = "a folder without config.json" if Path(path).is_dir() else "no such file"
        raise ValueError(f"--config {path}: {where} (give a model's config.json, or the folder holding it; a Hub id "
                         "is not downloaded).")
    if is_gguf(file):
        data = _gguf_config(path, file)
    else:
        data = _json_config(path, file)
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"--config {path}: no model_type; a transformers config.json names its model_type "
                         "(e.g. \"llama\").")
    model_type = data.pop("model_type")
    _check_causal_lm(path, model_type, data)
    try:  # (the floats JSON has no literal for, as transformers writes them: {"__float__": "Infinity"})
        config = AutoConfig.for_model(model_type, **_special_floats(data))
    except ValueError as e:
        raise ValueError(f"--config {path}: {e}") from None
    except ZeroDivisionError:  # (a config class dividing by a head count of 0: the shape's check, which it preempts)
        check_decoder_sizes(f"--config {path}", {f: data[f] for f in DECODER_FIELDS if f in data})
        raise
    except StrictDataclassError as e:  # the config class's own checks (a shape it refuses), their error the cause
        raise ValueError(f"--config {path}: {e.__cause__ or e} Give the fields of the model's own config.json, or a "
                         "preset (--model).") from None
    _check_attention_only(path, config)
    return config


def is_gguf(file: Path) -> bool:
    """Whether `file` is a GGUF file (its magic bytes), as training's --model_name_or_path takes."""
    with open(file, "rb") as f:
        return f.read(4) == b"GGUF"


def _gguf_config(path: str, file: Path) -> dict[str, Any]:
    """The config transformers reads from a GGUF file's metadata (its tensors are not read), as a config.json's dict."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(file.parent, gguf_file=file.name).to_dict()
    except ValueError as e:  # (an architecture transformers' GGUF reader does not know)
        raise ValueError(f"--config {path}: {e} Give the model's config.json.") from None
    except ImportError:  # (transformers reads GGUF metadata with the `gguf` package)
        raise ValueError(f"--config {path}: reading a GGUF file's metadata needs the gguf package (pip install gguf), "
                         "or give the model's config.json.") from None


def _json_config(path: str, file: Path) -> Any:
    """A config.json's content."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {path}: not JSON ({e}); give a model's config.json.") from None
    except UnicodeDecodeError:  # (a weights file, an archive: the decoder's own message names neither)
        raise ValueError(f"--config {path}: not JSON text (a binary file); give a model's config.json, or the folder "
                         "holding it.") from None


def _refuse_adapter(path: str, file: Path) -> None:
    """Refuse a PEFT adapter's folder or adapter_config.json (what a LoRA run saves) as no model config, naming its base
    model's config.json (which predicts full fine-tuning, not the adapter's training)."""
    if file.is_file() and file.name != "adapter_config.json":
        return  # a model's config (a merged adapter's too)
    adapter = file if file.name == "adapter_config.json" else file.parent / "adapter_config.json"
    if not adapter.is_file():
        return
    base = adapter_base(adapter)
    named = f" (`{base}/config.json`)" if base else ""
    raise ValueError(f"--config {path}: a PEFT adapter (adapter_config.json), not a model: give its base model's "
                     f"config.json{named}; the prediction is then full fine-tuning's, which overstates the adapter's "
                     "training (its frozen weights need no gradients or optimizer state)"
                     f"{_lora_flags(adapter)}.")


def _lora_flags(adapter: Path) -> str:
    """`hf-sparse-cp memory`'s flags for the LoRA training of the adapter whose adapter_config.json is `adapter`
    (its r, target_modules and lora_dropout), as a clause of `_refuse_adapter`'s message; '' for another adapter, and
    for a LoRA one the flags do not describe (DoRA's magnitudes, targets beyond a decoder layer's matrices or a
    pattern: `--lora-targets` would refuse them)."""
    try:
        data = json.loads(adapter.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return ""
    if not isinstance(data, dict) or data.get("peft_type") != "LORA" or not isinstance(data.get("r"), int) \
            or data.get("use_dora"):
        return ""
    targets = data.get("target_modules")
    targets = [targets] if isinstance(targets, str) else sorted(targets) if isinstance(targets, list) else []
    if targets not in ([], [ALL_LINEAR]) and not set(targets) <= set(MODULE_INPUTS):
        return ""
    flags = f"--lora-rank {data['r']}" + (f" --lora-targets {' '.join(targets)}" if targets else "") + (
        f" --lora-dropout {data['lora_dropout']:g}" if isinstance(data.get("lora_dropout"), float | int)
        and data["lora_dropout"] else "")
    return f"; `hf-sparse-cp memory` predicts the adapter's training with {flags}"


def _special_floats(value: Any) -> Any:
    """`value` read from a config.json with transformers' encoding of the floats JSON lacks (`{"__float__":
    "Infinity"}`, also `-Infinity` and `NaN`) decoded, as `PretrainedConfig.from_pretrained` decodes them."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and isinstance(value["__float__"], str):
            return float(value["__float__"])
        return {k: _special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_special_floats(v) for v in value]
    return value


def _check_attention_only(path: str, config) -> None:
    """Refuse (ValueError naming the layers and the fix) a model whose layers mix tokens outside attention
    (state-space, recurrent, linear-attention or convolution layers: Mamba, Jamba, Zamba2, Falcon-H1,
    RecurrentGemma), found as training finds them (`integration.models.token_mixers`) on the architecture built on
    the meta device: the predictions count attention and one MLP in every layer. An architecture that does not
    build there is left to the shape's own checks."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..integration.models import token_mixers

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # (not buildable from the config alone: nothing to learn about its layers here)
        return
    mixers = token_mixers(model)
    if mixers:
        shown = ", ".join(mixers[:3]) + (f" and {len(mixers) - 3} more" if len(mixers) > 3 else "")
        raise ValueError(f"--config {path}: model_type {config.model_type!r} mixes tokens outside attention ({shown}), "
                         "which the predictions do not model (they count attention and one MLP in every layer); give "
                         "an attention-only decoder's config.json, or a preset (--model).")


def _check_causal_lm(path: str, model_type: str, data: dict[str, Any]) -> None:
    """Refuse a model type that is no causal language model (ValueError naming it and the fix): one outside
    transformers' causal-LM mapping (T5, an encoder), or an encoder that the mapping lists only to run as a decoder
    (BERT's family, also masked LMs: transformers runs them causally only with `is_decoder: true`)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    fix = "give a causal (decoder-only) language model's config.json, e.g. a Llama's, or a preset (--model)"
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"--config {path}: model_type {model_type!r} is not a causal language model (transformers "
                         f"has no causal-LM class for it); {fix}.")
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not data.get("is_decoder"):
        raise ValueError(f"--config {path}: model_type {model_type!r} is an encoder (a masked language model), "
                         f"causal only as a decoder: set \"is_decoder\": true in the config if it is one, or {fix}.")


def check_output_file(path: str, flag: str) -> None:
    """Refuse an output file that could not be written, before the command computes anything (ValueError naming
    the path and the fix): a folder, or a file whose folder lies under a file or is not writable. A missing folder
    is no reason: `write_output` creates it (as `plot --out_dir` does)."""
    target = Path(path).absolute()
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give the path of a file (in it, or anywhere else).")
    existing = next(folder for folder in target.parents if folder.exists())
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is a file, not a folder; give a path in a folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: the folder {existing} is not writable; give a path in a folder you can "
                         "write to.")


def write_output(path: Path, text: str) -> None:
    """Write an output file, creating its folder when missing (after `check_output_file`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def model_name(args: argparse.Namespace) -> str:
    """The model's name in the output: the preset's, or the config's folder (its file's stem for a loose file)."""
    if args.config is None:
        return args.model
    path = Path(args.config)
    if path.is_dir():
        return path.name
    return path.stem if path.is_file() and is_gguf(path) else (path.parent.name or path.stem)


def model_shape(args: argparse.Namespace, presets: dict[str, Any], kind: type = ModelShape) -> Any:
    """The shape `--model` or `--config` names: one of `presets`, or the config read as a `kind` (`ModelShape` for
    the step time, the memory model's `Architecture`; ValueError, naming the field, for a config it cannot read)."""
    if args.config is None:
        return presets[args.model]
    # (its refusals name the flag and file, not the model's name in the output: the config's folder)
    return kind.from_config(read_config(args.config), model_name(args), f"--config {args.config}")


def add_cluster_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    """`--cluster PRESET` and what can replace its parts: the GPU's FLOP/s, the GPUs per node, the links."""
    parser.add_argument("--cluster", default=default, choices=sorted(CLUSTERS),
                        help="A cluster preset (nodes of 8 GPUs with their links); the flags below replace its parts.")
    parser.add_argument("--gpu-tflops", type=positive(), default=None,
                        help="Dense BF16 tensor peak of your GPU in TFLOP/s (datasheet): the preset GPU's measured "
                        "costs scaled by the ratio (default: the preset's GPU, H100 989.4, A100 312).")
    parser.add_argument("--gpus-per-node", type=positive(int), default=None,
                        help="GPUs per node, joined by the intra-node link (default: the preset's).")
    parser.add_argument("--intra-node-gbps", type=positive(), default=None,
                        help="Intra-node link (NVLink) bandwidth in GB/s per direction, as nccl-tests' bus bandwidth "
                        "reports it (default: the preset's).")
    parser.add_argument("--inter-node-gbps", type=positive(), default=None,
                        help="Inter-node link (InfiniBand, RoCE) bandwidth in GB/s per GPU and direction (default: "
                        "the preset's).")


def custom_parts(args: argparse.Namespace) -> list[str]:
    """The cluster flags given (what makes the cluster not the preset)."""
    return [flag for flag, value in (("--gpu-tflops", args.gpu_tflops), ("--gpus-per-node", args.gpus_per_node),
                                     ("--intra-node-gbps", args.intra_node_gbps),
                                     ("--inter-node-gbps", args.inter_node_gbps)) if value is not None]


def cluster_of(args: argparse.Namespace) -> tuple[Cluster, Callable[..., Hardware]]:
    """The cluster the flags describe, and its hardware calibration (a function of `h100`'s keywords)."""
    preset = CLUSTERS[args.cluster]
    parts = custom_parts(args)
    if not parts:
        return preset, HARDWARE[args.cluster]
    given = " ".join(f"{flag} {getattr(args, flag[2:].replace('-', '_'))}" for flag in parts)

    def link(base: Link, gbps: float | None, flag: str) -> Link:
        return base if gbps is None else Link(gbps * 1e9, base.latency, f"{flag} {gbps:g} (given); {base.source}")

    cluster = replace(preset, name=f"{preset.name} with {given}",
                      gpus_per_node=args.gpus_per_node or preset.gpus_per_node,
                      intra=link(preset.intra, args.intra_node_gbps, "--intra-node-gbps"),
                      inter=link(preset.inter, args.inter_node_gbps, "--inter-node-gbps"))
    calibrated = HARDWARE[args.cluster]
    if args.gpu_tflops is None:
        return cluster, calibrated

    def hardware(**kwargs) -> Hardware:
        base = calibrated(**kwargs)
        before = f"{base.sources['scaling']}; then " if "scaling" in base.sources else ""
        return base.scaled(f"GPU of {args.gpu_tflops:g} TFLOP/s", args.gpu_tflops / PEAK_TFLOPS[base.name],
                           f"{before}{base.name} costs x {args.gpu_tflops:g}/{PEAK_TFLOPS[base.name]:g} (--gpu-tflops, "
                           "the dense BF16 peaks' ratio); not measured on that GPU")

    return cluster, hardware


# Training's name of --gradient-checkpointing-min-length, which the commands take too (`FlagParser` aliases).
CHECKPOINTING_ALIAS = {"--sparse_gradient_checkpointing_min_length": "--gradient-checkpointing-min-length"}


def add_checkpointing_argument(p: argparse.ArgumentParser) -> None:
    """--gradient-checkpointing-min-length: the length from which a step is predicted with gradient checkpointing, as
    training switches it on (training's flag name is taken too: `CHECKPOINTING_ALIAS`)."""
    p.add_argument("--gradient-checkpointing-min-length", type=at_least(0), default=CHECKPOINTING_MIN_LENGTH,
                   help="Gradient checkpointing from this length on, as the plugin's "
                   "--sparse_gradient_checkpointing_min_length (which is taken too): shorter sequences keep every "
                   "layer's activations to its backward and run its forward once; 1: every length (the Trainer's "
                   "--gradient_checkpointing), 0: none.")


def checkpointed(args: argparse.Namespace, seq_len: int) -> bool:
    """Whether training checkpoints sequences of `seq_len` tokens (--gradient-checkpointing-min-length; 0: never)."""
    return from_min_length(args.gradient_checkpointing_min_length, seq_len)


def add_cp_mode_arguments(parser: argparse.ArgumentParser) -> None:
    """`--cp_mode` and `--cp_ulysses_size`, the training flags of the same names."""
    parser.add_argument("--cp_mode", default="ring", choices=[mode.name for mode in cp_modes()],
                        help="How each CP group shares attention, as in training: "
                        + "; ".join(f"'{mode.name}' ({mode.help})" for mode in cp_modes()) + ".")
    parser.add_argument("--cp_ulysses_size", type=positive(int), default=None,
                        help="For --cp_mode hybrid: ranks per head group (within a node); the ring spans the CP size "
                        "over it.")


def refuse_group_settings_without_cp(args: argparse.Namespace, parser: argparse.ArgumentParser,
                                     cp_sizes: Iterable[int]) -> None:
    """Refuse, naming them and the fix, the settings of how a CP group shares its sequences (`--cp_mode ulysses`,
    `--cp_sharding document`, ...) where no CP size asked (`cp_sizes`) is above 1: no prediction reads them, as a
    training run with --cp_size 1 would not, which refuses them by the same rule (`ContextParallelConfig
    .group_settings`, the settings moved from their defaults)."""
    if max(cp_sizes) > 1:
        return
    names = [f.name for f in fields(ContextParallelConfig) if f.name != "cp_size" and hasattr(args, f.name)]
    given = ContextParallelConfig(cp_size=1, **{name: getattr(args, name) for name in names}).group_settings()
    if given:
        they = len(given) > 1
        parser.error(f"{', '.join(given)} {'say' if they else 'says'} how a CP group shares its sequences; with --cp 1 "
                     f"(no context parallelism) {'they' if they else 'it'} would be ignored: drop "
                     f"{'them' if they else 'it'}, or give --cp N (N > 1).")


def cp_layout(args: argparse.Namespace, cp_size: int) -> tuple[CPMode, int]:
    """The mode a CP group of `cp_size` GPUs runs under the `--cp_mode` flags and its head-group size (1: no head
    groups), as training would resolve them (`CPMode.resolve`); ValueError naming the fix where training would
    refuse them (a hybrid without --cp_ulysses_size, a head-group size that does not divide the CP size, a
    `--cp_sharding` where the command takes one that the mode does not: document under the hybrid)."""
    config = ContextParallelConfig(cp_size=cp_size, cp_mode=args.cp_mode, cp_ulysses_size=args.cp_ulysses_size,
                                   cp_sharding=getattr(args, "cp_sharding", ContextParallelConfig.cp_sharding))
    return config.mode.resolve(config, cp_size)
