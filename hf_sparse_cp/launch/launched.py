"""A stock script, unchanged, with the plugin: what `hf_sparse_cp.run` changes while the script runs.

`launched(plugin)` registers `attn_implementation="sparse_cp"` (a script may load its model with it before it
builds its Trainer: TRL's `--attn_implementation sparse_cp`) and makes two changes to transformers' classes, all
recorded and undone when the block ends (outside it, and in any process that never enters it, transformers is stock):

* `HfArgumentParser.__init__` (transformers', and the copy that TRL's `TrlParser` derives from): a parser built
  with `TrainingArguments` or a subclass of it (TRL's `SFTConfig`, the script's own) is built with
  `sparse_arguments_class(that class)` in its place, so the plugin's flags parse beside the script's own,
  through the script's parser; `parse_args_into_dataclasses` also records which plugin flags the command line
  gave (they beat `--sparse_config` whatever their value), and the script's `--dataset_name` for the model card.
* `Trainer.__init__`: a Trainer the script builds (the stock one, TRL's `SFTTrainer`, the script's own
  subclass) becomes `sparse_trainer_class(its class)` once its `__init__` reaches the Trainer's (a subclass's
  own `__init__` has run up to there as written), and the Trainer's `__init__` runs with the plugin around it,
  as in a script that names the plugin's classes itself. Arguments the script built in code (not through a
  parser) take the plugin's settings from `plugin`: the flags given before the script path.

Why the script's parser is extended rather than the plugin's flags taken out of `sys.argv` before the script
runs: the flags are then declared where argparse checks them against the script's own (a clash is argparse's
error at start-up, not a script flag silently taken by the plugin), every form argparse accepts works as for
the script's flags (`--flag=value`, `--no_flag`, a bare boolean, abbreviations), so do the files the script's
parser reads (TRL's `--config recipe.yaml`, `script.py args.json`) and `--help`, and the values land on the
arguments object the script hands its Trainer, which the Trainer saves with every checkpoint. Taking them out
of argv would mean re-implementing argparse's grammar without knowing the script's options.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import os
import sys
from collections.abc import Iterable, Iterator, Sequence

from torch.optim.optimizer import register_optimizer_step_pre_hook
from transformers import Trainer, TrainingArguments

from ..config import BACKEND_NAME
from ..config.files import close_keys, did_you_mean
from ..integration import compat_checks, upstream
from ..integration.interfaces import is_patched, patch, unpatch
from ..integration.patching import PatchSet, record_on
from ..trainer.arguments import explicit_fields, flag_errors, is_flag_error
from ..trainer.attach import LAUNCHED
from ..trainer.plugin_arguments import is_parsing_for_launch, parsing_typed_flags
from ..trainer.sparse_trainer import (
    PluginArguments,
    SparseArgumentsMixin,
    SparseTrainerMixin,
    sparse_arguments_class,
    sparse_trainer_class,
    with_plugin_arguments,
)
from .command import PROG, mistyped_flags_refusal
from .interrupts import record_output_dir
from .known_scripts import trainers_refusal
from .refusals import exit_refused

logger = logging.getLogger(__name__)



def plugin_flag_names() -> frozenset[str]:
    """The names of the plugin's flags (`--<name>`), whatever the script's argument class."""
    return frozenset(f.name for f in dataclasses.fields(PluginArguments) if f.init)


def plugin_flags_in(argv: Sequence[str]) -> list[str]:
    """The plugin flags among `argv`, as written (`--cp_size`, `--cp-size=2`, `--no_sparse_fused_loss`)."""
    names = plugin_flag_names()
    found = []
    for token in argv:
        name = token[2:].split("=", 1)[0].replace("-", "_") if token.startswith("--") else ""
        if name in names or (name.startswith("no_") and name[3:] in names):
            found.append(token.split("=", 1)[0])
    return found


def _with_plugin_classes(dataclass_types) -> list:
    """A parser's dataclass types (one, several or None, as `HfArgumentParser` takes them) with each
    `TrainingArguments` class as `sparse_arguments_class(it)`."""
    if dataclass_types is None:
        return []
    types = list(dataclass_types) if isinstance(dataclass_types, Iterable) else [dataclass_types]
    return [sparse_arguments_class(t) if isinstance(t, type) and issubclass(t, TrainingArguments)
            and not issubclass(t, SparseArgumentsMixin) else t for t in types]


@dataclasses.dataclass
class LaunchedRun:
    """What a launched script did with the plugin: the Trainers it built (each trains with the plugin), and the
    attention implementation its command line named, with the flag that named it (`attention_asked`), if any."""

    trainers_built: int = 0
    hf_parsers: int = 0  # HfArgumentParsers built (transformers' or TRL's): they take or name the plugin's flags
    attention_asked: tuple[str, str] | None = None
    told_no_trainer: bool = False  # the script was told at its first optimizer step that the plugin never reaches it
    # the TRL trainer classes the script builds, read from its source (`known_scripts.trl_trainers`): a CP degree that
    # each of them refuses is refused as the script's flags parse, before its data
    trainers: Sequence[type] | None = None
    # the output folders of the Trainers built: where a run stopped by Ctrl-C names its last checkpoint
    output_dirs: list[str] = dataclasses.field(default_factory=list)


def flags_given(plugin: PluginArguments, script_args: Sequence[str]) -> list[str]:
    """The plugin flags a launched script was given: before its path (`plugin`), then among its own arguments."""
    before = [f"--{name}" for name in sorted(plugin.explicit_flags or ())]
    return before + [flag for flag in plugin_flags_in(script_args) if flag not in before]


def no_trainer_warning(script: str, given: Sequence[str], *, ended: bool) -> str:
    """The warning that `script` trains without a Trainer, so without the plugin: at its first optimizer step (what
    it is about to run) or, `ended`, at its end (what it ran)."""
    if ended:
        when, reached, ran, used, attended = "ended", "reached", "ran", "were", "attended"
    else:
        when, reached, ran, used, attended = "takes its first optimizer step", "reaches", "runs", "are", "attends"
    return (f"warning: {script} {when} without building a transformers Trainer, so the plugin never {reached} it: "
            f"it {ran} as python runs it, without context parallelism"
            + (f" (the plugin's flags {', '.join(given)} {used} not used)" if given else "")
            + f'; a model it loaded with attn_implementation="sparse_cp" {attended} with the pattern of its own '
            "config (SparseAttentionConfig's defaults unless the script called hf_sparse_cp.configure), any other "
            "with its own attention. The plugin trains what a Trainer trains (transformers', TRL's, a subclass); a "
            "training loop of its own takes the functional API (hf_sparse_cp.configure, enable_sparse_attention: "
            "docs/usage.md).")


def attention_asked(outputs: Sequence, explicit: set[str]) -> tuple[str, str] | None:
    """The attention implementation that the flags `explicit` of a script's parsed `outputs` name, with the flag:
    `--attn_implementation eager` (TRL's `ModelConfig`, a script's own field) or, in TRL's `--model_init_kwargs`, an
    `attn_implementation` key (which TRL's scripts load the model with, before the former); None when none does."""
    for out in outputs:
        kwargs = getattr(out, "model_init_kwargs", None) if "model_init_kwargs" in explicit else None
        if isinstance(kwargs, dict) and isinstance(kwargs.get("attn_implementation"), str):
            return "--model_init_kwargs", kwargs["attn_implementation"]
    for out in outputs:
        value = getattr(out, "attn_implementation", None) if "attn_implementation" in explicit else None
        if isinstance(value, str):
            return "--attn_implementation", value
    return None


def attention_replaced(flag: str, asked: str, args: SparseArgumentsMixin) -> str:
    """The line saying that the attention implementation `asked` that the script's `flag` names trains as sparse_cp,
    and how to keep it: `--sparse_attention false`, and without context parallelism, which runs only through
    sparse_cp."""
    keep = f"pass --sparse_attention false to keep {asked}"
    if max(cp_size for _, cp_size in args.cp_degrees()) > 1:
        cp_flag = "--cp_schedule" if args.cp_schedule else "--cp_size"
        keep += f" and drop {cp_flag} (context parallelism runs only through {BACKEND_NAME})"
    return (f"The script's {flag} asks for attn_implementation {asked}, which {BACKEND_NAME} replaces: "
            f"hf_sparse_cp.run trains with sparse attention unless told otherwise; {keep}.")


@contextlib.contextmanager
def launched(plugin: PluginArguments) -> Iterator[LaunchedRun]:
    """While the block runs, scripts parse the plugin's flags and train with the plugin (see the module's doc).

    Args:
        plugin: the plugin's settings given outside the script's own arguments (`hf_sparse_cp.run`'s flags
            before the script path): the defaults of the flags the script's parser adds, and the settings of
            arguments the script builds in code. Its `explicit_flags` names the ones given.

    Yields:
        The run's `LaunchedRun`: a script that builds no Trainer ran without the plugin.
    """
    run = LaunchedRun()
    patches = PatchSet()
    trainer_init = Trainer.__init__
    given = set(plugin.explicit_flags or ())
    defaults = {name: getattr(plugin, name) for name in given}

    def extend(parser_class: type) -> None:
        """Make `parser_class` (an HfArgumentParser) take the plugin's flags (see the module's doc)."""
        parser_init, parse = parser_class.__init__, parser_class.parse_args_into_dataclasses
        parse_dict = parser_class.parse_dict
        parser_error = parser_class.error

        def init_parser(self, dataclass_types=None, **kwargs):
            types = _with_plugin_classes(dataclass_types)
            run.hf_parsers += 1
            try:
                parser_init(self, types, **kwargs)
            except argparse.ArgumentError as e:  # a field of the script named like a plugin flag
                raise ValueError(f"{e}: the script's arguments and the plugin's flags (sparse_*, cp_*, smet*) both "
                                 "have it; rename the script's field, or run the script without "
                                 "hf_sparse_cp.run.") from None
            set_defaults = getattr(self, "set_defaults_with_config", None)
            if set_defaults is not None:  # TRL's parser (a subclass): the keys of the --config file it reads, as typed
                def set_config_defaults(**config):
                    self._sparse_config_keys = getattr(self, "_sparse_config_keys", set()) | set(config)
                    remaining = set_defaults(**config)  # ['--key', 'value', ...]: the keys no flag takes
                    # (TRL's scripts take these as remaining strings and drop them: a mistyped plugin key, `cp_sizee`,
                    # would train without its setting, where the same flag on the command line is refused)
                    refusal = mistyped_flags_refusal(remaining[::2], sys.argv[0], False, "in the --config file")
                    if refusal is not None:
                        exit_refused(f"{self.prog}: error: {refusal}{'' if refusal.endswith('?') else '.'}\n")
                    return remaining

                self.set_defaults_with_config = set_config_defaults
            plugin_types = [t for t in types if isinstance(t, type) and issubclass(t, SparseArgumentsMixin)]
            if plugin_types and kwargs.get("usage") is None:
                # argparse's errors print the usage of every flag, the plugin's ~60 among them: its prog and --help
                self.usage_on_error = f"{self.prog} [FLAGS] ({self.prog} --help lists them)"
            if plugin_types:
                names = set().union(*(t._sparse_fields for t in plugin_types))
                self.set_defaults(**{name: value for name, value in defaults.items() if name in names})

        def parse_into_dataclasses(self, args=None, *rest, **kwargs):
            # the plugin flags given (here, or before the script path), whatever their value: the arguments check them
            # as they are built (`parsing_typed_flags`), and they beat --sparse_config whatever their value
            explicit = explicit_fields(self, sys.argv[1:] if args is None else list(args)) | given
            # (TRL's parser: the keys of the --config file it read, from the args the script passed or sys.argv, as
            # typed: it makes their values its flags' defaults, `set_config_defaults` in `init_parser`)
            explicit |= getattr(self, "_sparse_config_keys", set()) & plugin_flag_names()
            try:
                with parsing_typed_flags(explicit):
                    outputs = parse(self, args, *rest, **kwargs)
            except (ValueError, TypeError, OSError) as e:
                if is_flag_error(e):  # a plugin flag's value refused, naming the fix: the message, as argparse's
                    exit_refused(f"{self.prog}: error: {e}\n")
                if not isinstance(e, ValueError):
                    raise
                # (HfArgumentParser's error for unknown flags, TRL's copy's too, names them without a guess: it ends
                # as argparse ends a bad flag, with the nearest flag to each where one is close)
                unknown = self.parse_known_args(sys.argv[1:] if args is None else list(args))[1]
                if not unknown or not all(token in str(e) for token in unknown):  # (the script's own refusal)
                    raise
                exit_refused(f"{self.prog}: error: {e}{did_you_mean(self, unknown)}\n")
            ours = [out for out in outputs if isinstance(out, SparseArgumentsMixin)]
            if ours:
                # the script's --dataset_name (run_clm's, TRL's) names the card's dataset unless the flag does
                named = [name for out in outputs if not isinstance(out, SparseArgumentsMixin)
                         for name in [getattr(out, "dataset_name", None)] if isinstance(name, str) and name]
                run.attention_asked = attention_asked(outputs, explicit) or run.attention_asked
                for out in ours:
                    out.explicit_flags = explicit
                    if named and "sparse_card_datasets" not in explicit:
                        out.sparse_card_datasets = named
                    try:
                        out.check_launch()  # before the script builds its data
                    except ValueError as e:
                        exit_refused(f"{self.prog}: error: {e}\n")
                    refusal = trainers_refusal(run.trainers, max(cp_size for _, cp_size in out.cp_degrees()))
                    if refusal is not None:
                        exit_refused(f"{self.prog}: error: {refusal}\n")
            return outputs

        def parse_dict_refusing(self, args, allow_extra_keys=False):
            # (parse_json_file's and parse_yaml_file's too, `script.py args.json`: a key no field takes, `cp_sizee`,
            # was HfArgumentParser's ValueError, a traceback from every rank: it ends as a mistyped flag does)
            try:
                return parse_dict(self, args, allow_extra_keys)
            except ValueError as e:
                known = {action.dest for action in self._actions}
                unknown = sorted(set(args) - known)
                if allow_extra_keys or not unknown or not all(repr(key) in str(e) for key in unknown):
                    raise
                exit_refused(f"{self.prog}: error: {e}{close_keys(unknown, known)}\n")

        def error(self, message: str):
            short = getattr(self, "usage_on_error", None)
            if short is None:
                return parser_error(self, message)
            exit_refused(f"usage: {short}\n{self.prog}: error: {message}\n")

        patches.set_attr(parser_class, "__init__", init_parser)
        patches.set_attr(parser_class, "error", error)
        patches.set_attr(parser_class, "parse_dict", parse_dict_refusing)
        patches.set_attr(parser_class, "parse_args_into_dataclasses", parse_into_dataclasses)

    def init_trainer(self, model=None, args=None, *rest, **kwargs):
        if is_parsing_for_launch():  # (the launcher runs the script here for its --help alone: never to train here)
            sys.stderr.write(f"{os.path.basename(sys.argv[0])}: error: --help: the script built its Trainer without "
                             "a parser that reads --help, so it has none to print; nothing was launched.\n")
            sys.exit(2)
        run.trainers_built += 1
        output_dir = getattr(args, "output_dir", None)
        if output_dir is not None:
            run.output_dirs.append(output_dir)
            record_output_dir(output_dir)
        if isinstance(self, SparseTrainerMixin):  # the plugin's class: named by the script, or given below
            return trainer_init(self, model, args, *rest, **kwargs)
        if not isinstance(args, TrainingArguments):
            with flag_errors():
                raise ValueError(f"{type(self).__name__} got args={args!r}: under hf_sparse_cp.run the Trainer trains "
                                 "with the plugin, which reads its settings from the training arguments; pass them.")
        if not isinstance(args, SparseArgumentsMixin):
            stray = plugin_flags_in(sys.argv[1:])
            if stray:
                with flag_errors():
                    one = len(stray) == 1
                    raise ValueError(
                        f"{', '.join(stray)} {'reaches' if one else 'reach'} the script, which builds its "
                        f"{type(args).__name__} in code and so never reads {'it' if one else 'them'}: give the "
                        f"plugin's flags before the script path (python -m hf_sparse_cp.run {' '.join(stray)} ... "
                        "script.py ...), or pattern settings in a --sparse_config file there.")
            args = with_plugin_arguments(args, plugin)
        record_on(self, LAUNCHED).set_attr(self, "__class__", sparse_trainer_class(type(self)))
        self._init_with_plugin(functools.partial(trainer_init, self), model, args, *rest, **kwargs)
        flag, asked = run.attention_asked or (None, BACKEND_NAME)
        if (asked != BACKEND_NAME and "sparse_attention" not in (args.explicit_flags or ())
                and upstream.attn_implementation(self.model.config) == BACKEND_NAME and self.is_world_process_zero()):
            logger.warning(attention_replaced(flag, asked, args))

    def step_outside_a_trainer(optimizer, args, kwargs) -> None:
        """The first optimizer step of the script: one of its own training loop if it has built no Trainer, which the
        plugin never reaches. Its flags would go unused for the whole run: refused before this step changes a
        weight; without flags, the warning the end of the run gives comes now, not after the training."""
        first_step.remove()
        if run.trainers_built:
            return
        script = os.path.basename(sys.argv[0])
        given = flags_given(plugin, sys.argv[1:])
        if given:
            with flag_errors():
                raise ValueError(f"{script} takes an optimizer step without having built a transformers Trainer (a "
                                 f"training loop of its own), which the plugin's flags ({', '.join(given)}) never "
                                 "reach: it would train without them. Nothing was trained; drop them to run it as "
                                 "python runs it, or train through the functional API (hf_sparse_cp.configure, "
                                 "enable_sparse_attention: docs/usage.md).")
        run.told_no_trainer = True
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{PROG}: {no_trainer_warning(script, given, ended=False)}\n")

    try:
        # (a process-wide hook, public torch API, removed at its first call and at the block's end)
        first_step = register_optimizer_step_pre_hook(step_outside_a_trainer)
        patches.on_undo(first_step.remove)
        if not is_patched():  # a script loads its model before its Trainer (TRL's with --attn_implementation sparse_cp)
            patch()
            patches.on_undo(unpatch)
        for parser_class in compat_checks.argument_parser_classes():
            extend(parser_class)
        patches.set_attr(Trainer, "__init__", init_trainer)
        yield run
    finally:
        patches.undo()
