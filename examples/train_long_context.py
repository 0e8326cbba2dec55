"""Long-context fine-tuning with the stock `Trainer` and the sparse_cp attention backend.

Run with no arguments for the embedded demo job: a tiny Qwen2-shaped model (random init), a byte
tokenizer built in code, and synthetic passkey-retrieval data at 4K tokens, trained for a few steps
with dynamic vertical-slash sparse attention and a toy pattern sized for it. Every flag of
`SparseTrainingArguments` (the Trainer's and the plugin's: `--sparse_*`, `--cp_*`, `--smet_*`) can be
given to override the defaults, and a recipe (`flag: value` pairs of `SparseTrainingArguments`; a
shipped one by name, see `hf-sparse-cp recipes`, or a file) can come first, e.g.

    python examples/train_long_context.py --sparse_max_length 8192 --max_steps 20 --sparse_slash_topk 512
    torchrun --nproc_per_node 8 examples/train_long_context.py --recipe qwen2.5-3b_32k --max_steps 10  # its CP 8
    python examples/train_long_context.py --model_name_or_path Qwen/Qwen2.5-0.5B --sparse_config trial

The demo job's settings (`DEMO_DEFAULTS`; its pattern, `DEMO_PATTERN` and `DEMO_BUDGET`, where a layer
reads them) are the defaults only without a recipe and without `--model_name_or_path`; a recipe or a
pretrained model gets the library defaults for every flag it does not set. `--help` shows the defaults
of the command line it is given. Flags given on the command line or in the recipe beat `--sparse_config`
/ `--smet_config` files, whatever their value.

The demo writes no checkpoints unless asked: `--save_steps N` (or any other `--save_*` flag of
`TrainingArguments`) checkpoints into `--output_dir` as in any Trainer script.

Context parallelism: launch N processes and give the CP degree (accelerate's ParallelismConfig sets
it on GPUs), e.g. on CPU `hf-sparse-cp train --nproc 2 --cp_size 2`, or

    accelerate launch --config_file "$(hf-sparse-cp recipes --path cpu_2proc_cp2)" \
        -m hf_sparse_cp.examples.train_long_context --cp_size 2

SMET sparse training: `--smet --smet_density 0.1` (see `hf_sparse_cp.SMETArguments`).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple

import torch
import transformers
from datasets import Dataset
from torch.distributed.fsdp import FSDPModule
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorWithFlattening,
    HfArgumentParser,
    PreTrainedTokenizerBase,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

from hf_sparse_cp import (
    SMETArguments,
    SparseAttentionFlags,
    SparseCPArguments,
    SparseTrainer,
    SparseTrainingArguments,
)
from hf_sparse_cp.config.files import check_field_types, did_you_mean, read_mapping
from hf_sparse_cp.config.sections import budget_field_names, modes_of
from hf_sparse_cp.distributed import ContextParallelConfig
from hf_sparse_cp.examples.passkey import check_buildable, passkey_dataset
from hf_sparse_cp.examples.tokenizer import byte_tokenizer
from hf_sparse_cp.launch.processes import LAUNCHER_OPTIONS, recipe_kind, wrong_kind
from hf_sparse_cp.launch.refusals import REFUSED, command_name, end_refused, exit_refused
from hf_sparse_cp.recipes import RECIPE_SUFFIXES, recipe_path
from hf_sparse_cp.simulator.arguments import check_output_file, write_output
from hf_sparse_cp.testing.tiny_models import tiny_config
from hf_sparse_cp.trainer.arguments import explicit_fields, help_groups
from hf_sparse_cp.trainer.packing import BlockAlignedFlattening
from hf_sparse_cp.trainer.plugin_arguments import COMMON_FLAGS, LENGTH_FIELD, RENAMED_FIELDS, parsing_typed_flags

logger = logging.getLogger(__name__)


@dataclass
class ScriptArguments:
    _argument_group_name: ClassVar[str] = "the example's flags"  # (its argument group in --help)

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Pretrained model to fine-tune (a Hub id, a folder, or a .gguf file, loaded "
                                         "dequantized through transformers' GGUF support); default: a tiny "
                                         "random-init model."}
    )
    model_dtype: Literal["float32", "bfloat16"] | None = field(
        default=None, metadata={"help": "dtype of the --model_name_or_path model's weights and so of its AdamW "
                                         "state; default: bfloat16 under --bf16 (what the recipes run and "
                                         "docs/memory.md sizes; an update below a weight's bf16 resolution is "
                                         "lost), float32 otherwise."}
    )
    tiny_model_type: str = field(default="qwen2", metadata={"help": "Family of the tiny default model."})
    tiny_num_layers: int = field(default=2, metadata={"help": "Decoder layers of the tiny default model."})
    num_samples: int = field(default=32, metadata={"help": "Synthetic passkey sequences to generate."})
    pack_documents: int = field(
        default=1,
        metadata={"help": "Documents per training sequence: above 1, that many passkey documents of max_length / N "
                  "tokens are packed into each sequence by DataCollatorWithFlattening (position_ids restart per "
                  "document, attention never crosses documents); a device batch is then one packed sequence."},
    )
    align_documents: bool = field(
        default=False,
        metadata={"help": "With --pack_documents: pad after every document to a multiple of --sparse_block_size "
                  "(hf_sparse_cp.trainer.packing.BlockAlignedFlattening; the padding is masked and never "
                  "trained on), so that each document's sparse result is bit-identical whatever it is packed with."},
    )
    save_final_model: bool = field(
        default=False,
        metadata={"help": "Save the trained model and tokenizer to output_dir at the end (the next stage of a "
                  "context-length curriculum starts from it)."},
    )
    summary_file: str | None = field(
        default=None, metadata={"help": "Write the run summary (loss per logged step, kept fraction) as JSON here."}
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("num_samples", "tiny_num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} {getattr(self, name)} must be >= 1.")
        for name in ("model_name_or_path", "summary_file"):  # ('' read as not given: the tiny model, no summary)
            if getattr(self, name) is not None and not getattr(self, name).strip():
                raise ValueError(f"--{name} {getattr(self, name)!r} is empty (an unset shell variable?): give its "
                                 "value, or drop the flag.")
        if self.summary_file is not None:  # (written after training: refused now, not once the run has trained)
            check_output_file(self.summary_file, "--summary_file")
        if self.align_documents and self.pack_documents == 1:
            raise ValueError("--align_documents pads between the documents of a packed sequence, but --pack_documents "
                             "is 1 (one document per sequence) so it would do nothing: add --pack_documents N (N > 1), "
                             "or drop --align_documents.")

    def check(self, training: SparseTrainingArguments) -> None:
        """Raise ValueError, naming the fix, unless the data can be built at `training`'s sequence length (at least 2,
        as `SparseTrainingArguments` checks) and the tiny default model (without --model_name_or_path) of its type
        trains under its settings (`check_tiny_model`)."""
        max_length = training.sparse_max_length
        if self.pack_documents < 1:
            raise ValueError(f"--pack_documents {self.pack_documents} must be >= 1 (1: one document per sequence).")
        if max_length // self.pack_documents < 2:
            raise ValueError(
                f"--pack_documents {self.pack_documents} leaves documents of {max_length // self.pack_documents} "
                f"tokens in a --sparse_max_length {max_length} sequence; a document needs at least 2 tokens: pack at "
                f"most {max_length // 2} documents, or raise --sparse_max_length."
            )
        if max_length % self.pack_documents:
            divisors = ", ".join(str(n) for n in (2, 4, 8, 16) if max_length % n == 0)
            raise ValueError(
                f"--pack_documents {self.pack_documents} does not divide --sparse_max_length {max_length}: every "
                f"sequence packs documents of max_length / pack_documents tokens, so the sequences would come out "
                f"shorter. Use a divisor of {max_length}{f' (e.g. {divisors})' if divisors else ''}, or a "
                f"--sparse_max_length that is a multiple of {self.pack_documents}."
            )
        check_buildable(max_length // self.pack_documents)
        if not self.model_name_or_path:  # (refused here, before any process starts and builds its data)
            check_tiny_model(self.tiny_model_type, self.tiny_num_layers, training, max_length // self.pack_documents)


def check_tiny_model(model_type: str, num_layers: int, training: SparseTrainingArguments, positions: int) -> None:
    """Raise ValueError, naming the types that train here, when the tiny model of `model_type` cannot train under
    `training`: it takes fewer than `positions` positions (a document's tokens: `tiny_config` lowers its
    max_position_embeddings where tensors are sized by it; the refusal names the fix), transformers does not build
    its config, it has no causal LM (T5, CLIP) or does not build it from the
    tiny config (Reformer), or sparse attention or CP refuses it (`registration.check_switchable`: an encoder such as
    BERT, soft-capped logits, an architecture whose attention does not run through the backend such as Mamba or
    BLOOM, under CP a token mixer outside attention). Each but the first was refused only by the processes, once they
    had built the passkey data; the model is built on the meta device here."""
    from hf_sparse_cp.integration.architectures import ARCHITECTURES

    config = tiny_config(model_type, num_hidden_layers=num_layers)  # (a type transformers does not build: its own
    held = getattr(config, "max_position_embeddings", None)  # message)
    if isinstance(held, int) and positions > held:  # (an IndexError in the position table at the first step)
        raise ValueError(f"--tiny_model_type {model_type}: its tiny model takes {held} positions (max_position_"
                         f"embeddings, lowered where tensors are sized by it: learned position tables, causal "
                         f"buffers), fewer than the {positions} tokens of a training document: train at most {held} "
                         f"(--sparse_max_length), or a type with rotary positions (e.g. qwen2, llama).")
    sparse, cp = training.sparse_attention, max(cp_size for _, cp_size in training.cp_degrees()) > 1
    why = _tiny_model_refusal(model_type, num_layers, sparse, cp)
    if why is None:
        return
    # (building ~45 tiny models to list them: transformers' warnings about their configs are not the user's concern)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        usable = [t for t in ARCHITECTURES
                  if t != model_type and _tiny_model_refusal(t, num_layers, sparse, cp) is None]
    finally:
        transformers.logging.set_verbosity(verbosity)
    raise ValueError(f"--tiny_model_type {model_type}: {why.rstrip('.')}. Or give a type the plugin is tested with "
                     f"that trains here at --tiny_num_layers {num_layers}: {', '.join(usable)}.")


def _tiny_model_refusal(model_type: str, num_layers: int, sparse: bool, cp: bool) -> str | None:
    """Why the tiny model of `model_type` (`num_layers` layers) cannot train as the example trains it, with sparse
    attention (`sparse`) and context parallelism (`cp`) or without; None when it can."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from hf_sparse_cp.integration.registration import check_switchable

    try:
        config = tiny_config(model_type, num_hidden_layers=num_layers)
        if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return ("transformers has no causal language model of this type (AutoModelForCausalLM), which the example "
                    "trains")
        with torch.device("meta"):  # (the modules and config alone: no memory, no initialization)
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # (transformers' own checks of the config: Reformer's assert on is_decoder)
        return (f"transformers does not build its causal language model from the tiny model's config "
                f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})")
    if sparse:
        try:
            check_switchable(model, context_parallel=cp)
        except ValueError as e:
            return str(e)
    return None


def check_model_source(source: str) -> None:
    """Raise ValueError naming the path when `source` (--model_name_or_path) names a local model that is not
    there: a .gguf file that does not exist, a missing folder, or a folder without a saved model. Anything
    else that is not on disk is taken as a Hub id (transformers reports those)."""
    path = Path(source).expanduser()
    local = (source.endswith(".gguf") or source.startswith(("/", ".", "~")) or source.count("/") > 1 or path.exists()
             or (path.parent != Path(".") and path.parent.is_dir()))
    if not local:
        return
    if source.endswith(".gguf"):
        if not path.is_file():
            raise ValueError(f"--model_name_or_path {source}: no such GGUF file{_nearby(path, '*.gguf')}.")
    elif not path.is_dir():
        raise ValueError(f"--model_name_or_path {source}: no such folder (a saved model's folder, a .gguf file or a "
                         "Hub id such as Qwen/Qwen2.5-0.5B).")
    elif not (path / "config.json").is_file():
        raise ValueError(f"--model_name_or_path {source}: the folder holds no config.json, so it is not a saved model; "
                         "give the folder that save_pretrained / trainer.save_model() wrote (config.json, weights, "
                         f"tokenizer){_nearby(path, '*.gguf')}{_checkpoint_in(path)}.")


def _checkpoint_in(path: Path) -> str:
    """'; <path> holds ...' naming the last Trainer checkpoint in `path` that holds a saved model, if any: the run
    of an earlier stage saved without --save_final_model has its model there."""
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(path))
    if last is None or not (Path(last) / "config.json").is_file():
        return ""
    return (f"; {path} holds Trainer checkpoints, the last one's model loads as --model_name_or_path {last} (save a "
            "run's final model into its output_dir with --save_final_model)")


def _nearby(path: Path, pattern: str) -> str:
    """', e.g. <file>' naming a file of `pattern` in `path`'s folder (or `path` itself when a folder), if any."""
    folder = path if path.is_dir() else path.parent
    found = sorted(folder.glob(pattern))[:1] if folder.is_dir() else []
    return f"; {folder} holds {found[0].name}" if found else ""


# The embedded demo job: a few steps of the tiny model at 4K tokens, with a sparse pattern sized for it. These are
# the parser's defaults only when neither a recipe nor --model_name_or_path is given (so `--help` shows them then):
# a recipe or a pretrained model gets the library defaults for every flag it does not set, not these toy values.
DEMO_DEFAULTS = {
    "output_dir": "outputs/train_long_context",
    "max_steps": 6,
    "per_device_train_batch_size": 1,
    "learning_rate": 2e-3,
    "lr_scheduler_type": "constant",
    "logging_steps": 1,
    "report_to": "none",
}
# The demo's pattern, for a run that trains with the sparse_cp backend (with --sparse_attention false the model keeps
# its own attention, which reads none of it).
DEMO_PATTERN = {
    "sparse_block_size": 64,
    "sparse_min_seq_len": 1024,
    "sparse_local_window": 64,
    "sparse_sink_tokens": 16,
    "sparse_dense_first_layers": 0,  # the toy model's two random-init layers: both sparse
}
# The demo's budget: a default for a run that chooses none, on a vertical-slash pattern (a dense one reads no budget).
# A budget mode given on the command line (or a --sparse_config file, which holds one) replaces it whole, and so does
# a field that its mode does not read: given without a mode, that field selects its own mode (as in any run); a field
# of its mode changes only that field.
DEMO_BUDGET = {"sparse_budget_mode": "topk", "sparse_vertical_topk": 64, "sparse_slash_topk": 128}
# The example's sequence length when neither the command line nor a recipe gives one (SparseTrainingArguments'
# own default, None, means "the first sample's length", which the example's data takes from this).
MAX_LENGTH = 4096


# The demo writes no checkpoints unless asked to: any checkpointing flag of TrainingArguments (--save_steps,
# --save_strategy, --save_total_limit, ...) brings back the Trainer's own checkpointing, as in any Trainer script
# (`--save_steps 50` saves every 50 steps and at the end).
NO_CHECKPOINTS = {"save_strategy": "no"}

DESCRIPTION = (
    "Long-context fine-tuning with the stock Trainer and the sparse_cp attention backend. A recipe (--recipe NAME or "
    "PATH, or a YAML/JSON file of flag: value pairs as the first argument) gives flags; flags after it win, and "
    "flags given on the command line or in the recipe beat --sparse_config / --smet_config files. The defaults shown "
    "are those of the command line given: without a recipe or --model_name_or_path, the embedded demo job's (a tiny "
    "model at 4K tokens, a toy sparse pattern); with either, the library defaults (e.g. `... --recipe NAME --help`)."
)


# Flags of earlier releases, and their names now (every plugin flag starts with sparse_, cp_ or smet_): refused,
# naming the new one.
RENAMED = {"--seq_len": "--sparse_max_length", "--fused_loss": "--sparse_fused_loss",
           "--log_sparsity": "--sparse_log_sparsity",
           "--gradient_checkpointing_min_length": "--sparse_gradient_checkpointing_min_length",
           **{f"--{f.name.removeprefix('sparse_')}": f"--{f.name}" for f in fields(SparseAttentionFlags)}}
# Flags renamed since, still read under their new names (with a warning) so that recipes and command lines
# written for the releases that had them run as they did.
DEPRECATED = {f"--{old}": f"--{new}" for old, new in RENAMED_FIELDS.items()}


class _Parser(HfArgumentParser):
    """argparse's own errors (a value of the wrong type, a missing value) print the prog and a pointer to --help
    before the error, not the usage of every flag (~190 lines); every refusal is printed once by the processes
    `hf-sparse-cp launch` starts, each of which parses the same flags (`refusals.exit_refused`). A refusal of a flag
    that only the recipe gives names the recipe and its line (`recipe_source`)."""

    recipe: tuple[str, dict[str, Any]] | None = None  # (the recipe as given, its flag: value pairs)
    typed: frozenset[str] = frozenset()  # (the flags the command line gives after the recipe's, without dashes)

    def error(self, message: str):
        self.exit(2, f"usage: {self.prog} [FLAGS] ({self.prog} --help lists them)\n{self.prog}: error: {message}"
                     f"{self.recipe_source(message)}\n")

    def recipe_source(self, message: str) -> str:
        """' (from the recipe NAME: `flag: value`)' for the flags `message` names that the recipe gives, unless the
        command line gives them too and the message does not quote the recipe's value as argparse quotes a value it
        cannot convert (it converts both, the recipe's first); '' otherwise. (#50: a recipe's `cp_size: two` was
        refused as `argument --cp_size/--cp-size: invalid int value: 'two'`, naming no file.)"""
        if self.recipe is None:
            return ""
        given, mapping = self.recipe
        # a flag as `--name`, or a field as `name=value` (the CP checks' `cp_ulysses_size=8 does not divide ...`); not
        # a flag shown with a placeholder value, as a fix to type (`give the CP degree as --cp_size N`: #50, a GPU
        # accelerate config on CPU was blamed on the recipe's `cp_size: 8`)
        found = re.findall(r"(?<![\w-])--(\w[\w-]*)(?![\w-]| [A-Z]+\b)|(?<![\w-])([a-z]\w*)(?==)", message)
        named = dict.fromkeys((flag or field).replace("-", "_") for flag, field in found)
        shown = {name: json.dumps(value) if isinstance(value, dict) else str(value) for name, value in mapping.items()}
        lines = [f"`{name}: {shown[name]}`" for name in named if name in mapping and (
            name not in self.typed or f"'{shown[name]}'" in message or f"got {shown[name]} " in message)]
        return f" (from the recipe {given}: {', '.join(lines)})" if lines else ""

    def exit(self, status: int = 0, message: str | None = None):
        if status == REFUSED and message:
            exit_refused(message)
        super().exit(status, message)


def _refuse(parser: _Parser, message: str) -> None:
    """Exit with `message` in one line, like argparse's own errors (without the usage of hundreds of flags)."""
    parser.exit(2, f"{parser.prog}: error: {message}{parser.recipe_source(message)}\n")


def take_recipe(argv: list[str]) -> tuple[list[str], str | None]:
    """(the other arguments, the recipe): `--recipe NAME_OR_PATH` anywhere, or a YAML/JSON file first.
    Raises ValueError when `--recipe` comes without a name."""
    for i, arg in enumerate(argv):
        if arg == "--recipe" or arg.startswith("--recipe="):
            given, taken = (arg.split("=", 1)[1], 1) if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "", 2)
            if not given or given.startswith("--"):
                raise ValueError("--recipe needs a NAME: a shipped training recipe (`hf-sparse-cp recipes` lists them) "
                                 "or a YAML/JSON file of flags, e.g. --recipe qwen2.5-3b_32k.")
            return argv[:i] + argv[i + taken:], given
    if argv and argv[0].endswith(RECIPE_SUFFIXES):
        return argv[1:], argv[0]
    return argv, None


class ParsedArgs(NamedTuple):
    script: ScriptArguments
    training: SparseTrainingArguments  # every Trainer and plugin flag; the fields below are views of it
    sparse: SparseCPArguments
    pattern: SparseAttentionFlags  # the pattern flags as given (`to_config()`; with --sparse_config: `sparse`)
    cp: ContextParallelConfig
    smet: SMETArguments
    explicit: set[str]  # the fields the command line or the recipe set (see `explicit_fields`)


def asks_for_checkpoints(explicit: set[str]) -> bool:
    """Whether the fields given explicitly hold a `save_*` flag of TrainingArguments."""
    return any(name.startswith("save_") and name != "save_final_model" for name in explicit)


def checkpoints_note(training: SparseTrainingArguments) -> str:
    """Where the run's checkpoints went, for its final line; without any, whose choice that was: the demo's
    default, or a `--save_strategy no` of the command line or the recipe."""
    if training.save_strategy != "no":
        return f"checkpoints in {training.output_dir}"
    if "save_strategy" in getattr(training, "explicit_flags", ()):
        return "no checkpoints (--save_strategy no)"
    return "no checkpoints (the demo's default; --save_steps N saves every N steps)"


def recipe_flags(path: str, given: str | None = None) -> list[str]:
    """Command-line flags from a YAML/JSON recipe of `flag: value` pairs (see recipes/train/). Raises ValueError
    for an accelerate launch config or a sparse pattern (`recipe_kind`), naming its use (`given`: the recipe's name
    or path as the user gave it)."""
    mapping = read_mapping(path, "flag names to values, e.g. `sparse_max_length: 32768`")
    kind = recipe_kind(mapping)
    if kind == "pattern":
        raise ValueError(wrong_kind(given or path, path, mapping, "train"))
    if kind == "accelerate":
        raise ValueError(
            f"{path} is a launch config for `accelerate launch --config_file`, not a training recipe of flags: run "
            f"`accelerate launch --config_file {path} -m hf_sparse_cp.examples.train_long_context [flags]`, or give "
            "--recipe a training recipe (`hf-sparse-cp recipes` lists both kinds).")
    flags: list[str] = []
    for name, value in mapping.items():
        items = value if isinstance(value, list) else [value]
        # (a mapping, e.g. layer_overrides, as the JSON text its flag takes, not Python's repr)
        flags += [f"--{name}", *(json.dumps(item) if isinstance(item, dict) else str(item) for item in items)]
    return flags


def with_current_names(argv: list[str]) -> list[str]:
    """`argv` with the `DEPRECATED` flag names replaced by their names now, each with a warning."""
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if name in DEPRECATED:
            warnings.warn(f"{name} is deprecated: it is now {DEPRECATED[name]} (every plugin flag starts with sparse_, "
                          "cp_ or smet_); rename it in your command line or recipe.", FutureWarning, stacklevel=2)
            arg = DEPRECATED[name] + eq + value
        out.append(arg)
    return out


def _prog() -> str:
    """What this job's help and refusals call it: `hf-sparse-cp train` where that command ran it."""
    return command_name(Path(__file__).name)


def parse_args(argv: list[str]) -> ParsedArgs:
    """(script, training, sparse, pattern, cp, smet, explicit): a recipe file if the first argument is
    one, then the remaining flags (later ones win), over the defaults (the demo job's without a recipe
    and a pretrained model, the library's otherwise); `explicit`: the fields the two set. Its help and errors name
    the command that ran it (`hf-sparse-cp train`), else this file."""
    common, other = help_groups(SparseTrainingArguments, COMMON_FLAGS)  # --help: the common flags first
    parser = _Parser((common, ScriptArguments, other), prog=_prog(), description=DESCRIPTION)
    try:
        argv, recipe = take_recipe(list(argv))
        from_recipe = 0  # (the first arguments: the recipe's flags)
        if recipe is not None:
            try:
                path = recipe_path(recipe)
            except FileNotFoundError:  # (named among the shipped training recipes alone, the kind it takes)
                path = recipe_path(recipe, ("train",))
            flags = recipe_flags(str(path), recipe)
            parser.recipe = recipe, read_mapping(str(path), "")
            _refuse_abbreviated_keys(parser, parser.recipe[1])
            parser.typed = frozenset(arg.split("=", 1)[0][2:].replace("-", "_") for arg in argv if arg.startswith("--"))
            argv, from_recipe = flags + argv, len(flags)
    except (OSError, ValueError) as e:  # a recipe that is not there or not a mapping: the error names it
        _refuse(parser, str(e))
    renamed = [f"{arg} is now {RENAMED[arg]}" for arg in argv if arg in RENAMED]
    if renamed:
        _refuse(parser, "; ".join(renamed) + ".")
    argv = with_current_names(argv)
    explicit = explicit_fields(parser, argv)
    # Every run of the example uses the backend it shows (`--sparse_attention false` turns it off). Its models use
    # every parameter at every step, so DDP need not search the graph for unused ones after each backward (the
    # Trainer's default without gradient checkpointing; `--ddp_find_unused_parameters true` brings it back).
    defaults = {"sparse_attention": True, "ddp_find_unused_parameters": False, LENGTH_FIELD: MAX_LENGTH}
    if recipe is None and "model_name_or_path" not in explicit:
        defaults |= DEMO_DEFAULTS | ({} if asks_for_checkpoints(explicit) else NO_CHECKPOINTS)
        chosen = chosen_values(parser, argv, explicit & {"sparse_attention", "sparse_pattern"})
        if chosen.get("sparse_attention", True):  # (flags no layer reads are refused, or warned of: not the demo's)
            defaults |= DEMO_PATTERN
            defaults |= DEMO_BUDGET if chosen.get("sparse_pattern") != "dense" and keeps_demo_budget(explicit) else {}
    if from_recipe and {"-h", "--help"} & set(argv):  # --help shows the recipe's values as the command's defaults (#50:
        recipe_argv = argv[:from_recipe]  # `--recipe smet_finetune --help` said `--smet (default: False)`)
        defaults |= chosen_values(parser, recipe_argv, explicit_fields(parser, recipe_argv))
    parser.set_defaults(**defaults)
    try:
        first, script, rest, unused = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
        with parsing_typed_flags(explicit):  # (a flag typed at its default that no layer reads is refused too)
            training = SparseTrainingArguments(**vars(first), **vars(rest))
        script.check(training)
    except (OSError, ValueError) as e:  # a value the dataclasses refuse, a file a flag names that is not there: one
        _refuse(parser, str(e))  # line, like argparse's own errors (no usage)
    if unused:  # (named with the launcher's options too, which `hf-sparse-cp train` takes among the example's)
        late = [arg for arg in unused if arg.endswith(RECIPE_SUFFIXES)]
        _refuse(parser, f"the recipe {late[0]} must come first, before any flag (or anywhere as --recipe "
                        f"{late[0]})" if late else
                        f"unrecognized arguments: {' '.join(unused)}{did_you_mean(parser, unused, LAUNCHER_OPTIONS)}")
    training.explicit_flags = explicit
    return ParsedArgs(script, training, training.plugin_arguments(), training.pattern_flags(),
                      training.context_parallel_config(), training.smet_arguments(), explicit)


def _refuse_abbreviated_keys(parser: HfArgumentParser, mapping: dict[str, Any]) -> None:
    """Refuse a recipe key that is no flag's whole name: argparse reads `--max_step` as --max_steps, so `max_step: 2`
    trained 2 steps, where `HfArgumentParser.parse_yaml_file` (a script reading the recipe) refuses it."""
    for name, value in mapping.items():
        flag = f"--{name}"
        if flag not in parser._option_string_actions and flag not in DEPRECATED and flag not in RENAMED:
            _refuse(parser, f"unrecognized arguments: {flag} {value}{did_you_mean(parser, [flag])}")


def chosen_values(parser: HfArgumentParser, argv: list[str], names: set[str]) -> dict[str, Any]:
    """The values `argv` gives the fields `names` (none given: {}, without parsing), before the demo's defaults."""
    if not names:
        return {}
    values = vars(parser.parse_known_args([arg for arg in argv if arg not in ("-h", "--help")])[0])
    return {name: values[name] for name in names}


def keeps_demo_budget(explicit: set[str]) -> bool:
    """Whether the demo's budget applies to a command line giving flags `explicit`: not when it gives a budget
    mode, a --sparse_config file, or a budget field the demo's mode does not read."""
    if explicit & {"sparse_budget_mode", "sparse_config"}:
        return False
    given = {name.removeprefix("sparse_") for name in explicit} & set(budget_field_names())
    return all(DEMO_BUDGET["sparse_budget_mode"] in modes_of(name) for name in given)


def passkey_train_data(
    script: ScriptArguments, training: TrainingArguments, tokenizer: PreTrainedTokenizerBase
) -> Dataset:
    """The run's passkey documents (`pack_documents` per sequence). One process per node builds them (a
    progress bar, a cache file); the others wait, then load that file instead of building them again."""
    with training.main_process_first(desc="passkey data"):
        return passkey_dataset(tokenizer, script.num_samples * script.pack_documents,
                               training.sparse_max_length // script.pack_documents, seed=training.seed)


def build_trainer(
    script: ScriptArguments, training: SparseTrainingArguments, callbacks: list[TrainerCallback] | None = None
) -> SparseTrainer:
    """The run's `SparseTrainer`, as `main` trains it: the model (pretrained, or the tiny default), its
    tokenizer, the passkey data and the collator that `script` asks for; `callbacks` go to the Trainer."""
    training.check_launch()  # (a recipe for 8 processes says so before building its data)
    set_seed(training.seed)

    if script.model_name_or_path:
        check_model_source(script.model_name_or_path)  # (when loading: a recipe may name an earlier run's output)
        source, gguf = script.model_name_or_path, {}
        if source.endswith(".gguf"):  # transformers reads a GGUF file by its folder and name
            source, gguf = str(Path(source).parent), {"gguf_file": Path(source).name}
        tokenizer = AutoTokenizer.from_pretrained(source, **gguf)
        # bf16 weights only when asked for: most updates of a small learning rate round away in them.
        dtype = script.model_dtype or ("bfloat16" if training.bf16 else "float32")
        model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype), **gguf)
        if gguf:  # GGUF weights load dequantized, yet marked quantized, which the Trainer refuses to train
            model.hf_quantizer.remove_quantization_config(model)
    else:
        tokenizer = byte_tokenizer()
        config = tiny_config(
            script.tiny_model_type, vocab_size=len(tokenizer), num_hidden_layers=script.tiny_num_layers
        )
        model = AutoModelForCausalLM.from_config(config)

    train_data = passkey_train_data(script, training, tokenizer)
    if script.pack_documents > 1:
        if script.align_documents:
            pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            collator = BlockAlignedFlattening(training.sparse_block_size, return_flash_attn_kwargs=True,
                                              pad_token_id=pad_id)
        else:
            collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        if training.per_device_train_batch_size != script.pack_documents and training.should_log:  # (once a node)
            logger.warning("--pack_documents %d: each device batch is %d documents flattened into one sequence "
                           "(per_device_train_batch_size set to %d).", script.pack_documents,
                           script.pack_documents, script.pack_documents)
        training.per_device_train_batch_size = script.pack_documents
    else:
        collator = default_data_collator
    # The one switch: SparseTrainer sets up sparse attention, CP and SMET from the flags in `training`.
    trainer = SparseTrainer(
        model=model,
        args=training,
        train_dataset=train_data,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    note_short_documents(script, trainer)
    return trainer


def note_short_documents(script: ScriptArguments, trainer: SparseTrainer) -> None:
    """Warn, on the main process, when --pack_documents packs documents shorter than the pattern's min_seq_len into
    sequences that reach it: every layer then runs dense on them, while the start-up line (which knows the sequence
    length, not the documents') says the layers are sparse (#50: `--sparse_max_length 2048 --pack_documents 4` logged
    a kept fraction of 1.0 without a word of why)."""
    from hf_sparse_cp.integration.layer_settings import model_config_for
    from hf_sparse_cp.trainer.attach import describe_layers

    training = trainer.args
    document = training.sparse_max_length // script.pack_documents
    if (script.pack_documents == 1 or not training.sparse_attention or training.cp_schedule
            or not trainer.is_world_process_zero()
            or describe_layers(trainer.model, training.sparse_max_length)[1]  # (the start-up line said it)
            or not describe_layers(trainer.model, document)[1]):
        return
    pattern = model_config_for(trainer.model)
    logger.warning("--pack_documents %d packs documents of %d tokens, under min_seq_len=%d: every layer runs dense on "
                   "them (kept fraction 1.0). Pack fewer documents (at most %d), raise --sparse_max_length, or give "
                   "--sparse_config trial (a shipped pattern sparse at every length).", script.pack_documents,
                   document, pattern.min_seq_len, max(1, training.sparse_max_length // pattern.min_seq_len))


def aligned_width(script, training) -> str:
    """The width of a row that --align_documents pads (each document to a whole number of blocks), where it exceeds
    --sparse_max_length, as a note for the run's last line ('' otherwise)."""
    if not script.align_documents:
        return ""
    block, document = training.sparse_block_size, training.sparse_max_length // script.pack_documents
    width = script.pack_documents * -(-document // block) * block
    return (f" ({width} with the padding aligning each of its {script.pack_documents} documents to blocks of {block})"
            if width != training.sparse_max_length else "")


class LogFirstAndLastStep(TrainerCallback):
    """Logs the loss of this run's first and last optimizer step too (besides every --logging_steps), so that the
    run's summary states its real first and last training loss whatever the logging interval. `start_step`: the
    step the run started from (a resumed checkpoint's, else 0)."""

    def __init__(self) -> None:
        self.start_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_step = state.global_step  # (the Trainer has restored a resumed checkpoint's state by now)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.start_step + 1 or state.global_step >= state.max_steps:
            control.should_log = True


def main(argv: list[str] | None = None) -> dict[str, float]:
    script, training, *_ = parse_args(sys.argv[1:] if argv is None else argv)
    first_and_last = LogFirstAndLastStep()
    try:
        trainer = build_trainer(script, training, callbacks=[first_and_last])
    except ValueError as e:  # a setting this model or data cannot run with; the message names the fix: as a bad
        end_refused(_prog(), e)  # flag ends, once (not from every rank), exit status 2, no traceback
    parallel = trainer.parallel
    result = trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
    if script.save_final_model:
        trainer.save_model()

    # this run's logs: a resumed checkpoint's state holds those of the steps before it
    start = first_and_last.start_step
    this_run = [log for log in trainer.state.log_history if log.get("step", 0) > start]
    logged = [log for log in this_run if "loss" in log]
    losses = [log["loss"] for log in logged]
    kept = [log["sparse/kept_fraction"] for log in this_run if "sparse/kept_fraction" in log]
    summary = {
        "steps": trainer.state.global_step - start,  # (this run's)
        "resumed_from_step": start,
        "first_loss": losses[0] if logged else None,  # (None: no step trained, e.g. a resume at max_steps)
        "final_loss": losses[-1] if logged else None,
        "first_loss_step": logged[0]["step"] if logged else None,
        "final_loss_step": logged[-1]["step"] if logged else None,
        "train_loss": result.training_loss,
        "mean_kept_fraction": sum(kept) / len(kept) if kept else 1.0,
        # every logged loss of the run, a resumed checkpoint's earlier ones included (what equal runs compare)
        "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
        "world_size": parallel.world_size,
        "cp_size": parallel.cp_size,  # (under a curriculum, the first stage's)
        "cp_schedule": training.cp_schedule,
        # modules FSDP2 sharded (`fully_shard`): 0 unless the run shards with FSDP2
        "fsdp2_modules": sum(isinstance(m, FSDPModule) for m in trainer.model.modules()),
    }
    trainer.save_state()  # trainer_state.json in output_dir: what `hf-sparse-cp plot` reads
    trainer.create_model_card()  # README.md (+ the kept-fraction plot) in output_dir, on the main process
    if trainer.is_world_process_zero():
        if script.summary_file:
            write_output(Path(script.summary_file), json.dumps(summary, indent=2))
        # (#50: after --save_final_model the line said only "no checkpoints (the demo's default; ...)")
        saved = checkpoints_note(training) + (f" | final model in {training.output_dir}" if script.save_final_model
                                              else "")
        if not logged:
            loss = "no step trained"
        elif summary["first_loss_step"] == summary["final_loss_step"]:  # (one logged loss: nothing to compare)
            loss = f"loss {summary['final_loss']:.4f} (step {summary['final_loss_step']})"
        else:
            loss = (f"loss {summary['first_loss']:.4f} (step {summary['first_loss_step']}) -> "
                    f"{summary['final_loss']:.4f} (step {summary['final_loss_step']})")
        # a curriculum's length and CP degree change by stage: its schedule says them
        shape = (f"on {parallel.world_size} process(es), cp_schedule {training.cp_schedule}" if training.cp_schedule
                 else f"at {training.sparse_max_length} tokens{aligned_width(script, training)} on "
                 f"{parallel.world_size} process(es), CP={parallel.cp_size}")
        steps = summary["steps"]
        ran = (f"step {start + 1}, " if steps == 1 else
               f"steps {start + 1}-{trainer.state.global_step}, " if steps else "")
        resumed = f" ({ran}resumed from step {start})" if start else ""  # (#50: one step read 'steps 3-3')
        print(
            f"done: {steps} step{'s' if steps != 1 else ''}{resumed} {shape} | {loss} | mean kept fraction "
            f"{summary['mean_kept_fraction']:.3f} | {saved}"
        )
    return summary


if __name__ == "__main__":
    main()
