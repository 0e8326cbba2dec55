"""`hf-sparse-cp memory`: how long a sequence fits on a GPU for a model (a preset, or any causal LM's config.json),
with and without context parallelism, and where the bytes of a step go (predictions of
`hf_sparse_cp.simulator.memory_model`, with the error band of their measured validation).

    hf-sparse-cp memory --model qwen2.5-0.5b --gpu-memory 80GB --cp 1
    hf-sparse-cp memory --model qwen2.5-3b --gpu-memory 80GB --cp 8 --fsdp 8 --seq-len 1048576
    hf-sparse-cp memory --config Meta-Llama-3-8B/config.json --gpu-memory 40GB --cp 4 --fsdp 4 --seq-len 131072
    hf-sparse-cp memory --model qwen2.5-0.5b --gpu-memory auto --quiet     # the length alone, for scripts
    hf-sparse-cp memory --model qwen2.5-0.5b --gpu-memory 80GB --lora-rank 16 --seq-len 262144   # a LoRA fine-tune
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from pathlib import Path

from ..config import SparseAttentionConfig
from ..config.model_fields import LEAN_LOSS_FAMILIES
from ..distributed.split.document_costs import PlannerCosts
from ..memory.savers import TILING_MIN_LENGTH, MemorySavers, from_min_length
from ..recipes import pattern_path
from .arguments import (
    CHECKPOINTING_ALIAS,
    FlagParser,
    HelpFormatter,
    add_checkpointing_argument,
    add_cp_mode_arguments,
    add_model_arguments,
    at_least,
    check_output_file,
    checkpointed,
    cp_layout,
    fraction,
    model_name,
    model_shape,
    refuse_group_settings_without_cp,
    write_output,
)
from .kept_curve import DEFAULT_CURVE, KeptCurve
from .lora import ALL_LINEAR, DEFAULT_TARGETS, LORA_FAMILIES, LORA_LAYERS, MODULE_INPUTS, LoraSettings, resolve_targets
from .memory_model.architecture import Architecture
from .memory_model.presets import PRESETS
from .memory_model.search import SEARCH_LIMIT, longest_fitting_length
from .memory_model.settings import StepSettings
from .memory_model.step import predict_step_memory
from .memory_model.tape import GIB, MemoryEstimate

# The answers are lengths of a multiple of this many tokens per rank (the shortest one tried).
GRANULARITY = 1024
# The plugin's default tile (`SparseCPArguments`): tiles of this many tokens.
DEFAULT_TILE_TOKENS = MemorySavers().tile_tokens
_UNITS = {"": 10**9, "gb": 10**9, "gib": 2**30, "mb": 10**6, "mib": 2**20, "tb": 10**12, "tib": 2**40}


def parse_memory(text: str) -> int | None:
    """'80GB' -> 80e9 bytes, '80GiB' -> 80 x 2^30, a bare number is GB; 'auto' -> None (read the GPU)."""
    if text.strip().lower() == "auto":
        return None
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"--gpu-memory {text!r}: give a positive size like 80GB, 80GiB or 141GB, or 'auto' for "
                         "this machine's first CUDA device.")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def device_memory() -> int:
    """Total bytes of CUDA device 0; ValueError when there is none."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError("the GPU's memory ('auto') is read from CUDA device 0, and this machine has none; give the "
                         "size, e.g. 80GB.")
    return torch.cuda.get_device_properties(0).total_memory


def _parameters(n: float) -> str:
    """A parameter count in its unit: 7.62B, 494.0M, 41.2K (a tiny model read 0.00B in billions)."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}B" if unit == "B" else f"{n / scale:.1f}{unit}"
    return f"{n:,.0f}"


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def build_parser(prog: str = "hf-sparse-cp memory") -> argparse.ArgumentParser:
    # (training's names: --cp_size; TRL's --use_peft flags for LoRA)
    aliases = {"--cp_size": "--cp", "--lora_r": "--lora-rank", "--lora_target_modules": "--lora-targets",
               **CHECKPOINTING_ALIAS}
    p = FlagParser(prog=prog, description=__doc__, formatter_class=HelpFormatter, aliases=aliases)
    add_model_arguments(p, PRESETS, default=None)
    p.add_argument("--gpu-memory", default="80GB",
                   help="Memory of one GPU (any GPU): 80GB, 80GiB, 40GB, 141GB, or 'auto' (CUDA device 0).")
    p.add_argument("--usable-fraction", type=fraction, default=0.9,
                   help="Share of the GPU's memory a step may fill; the rest covers the CUDA context and the "
                   "allocator's fragmentation (default 0.9: 72 GB of 80).")
    p.add_argument("--cp", type=at_least(1), default=1,
                   help="Context-parallel ranks sharing one sequence (training's --cp_size, which is taken too).")
    add_cp_mode_arguments(p)
    p.add_argument("--cp_sharding", default="striped", choices=("striped", "zigzag", "contiguous", "document"),
                   help="How the sequence is split, as in training: the block shardings give every rank an equal "
                   "share; 'document' (packed rows) up to --cp_planner_max_token_ratio times it on one rank.")
    p.add_argument("--cp_planner_max_token_ratio", type=float, default=PlannerCosts.max_token_ratio,
                   help="With --cp_sharding document: the planner's token cap, as training's flag (the busiest rank "
                   "holds up to this multiple of the mean of the blocks, plus one block).")
    p.add_argument("--fsdp", type=at_least(1), default=1,
                   help="Ranks the weights, gradients and optimizer state are sharded over (FSDP2), e.g. 8 with --cp 8 "
                   "on 8 GPUs: 1 or a multiple of --cp (FSDP2 shards over every rank of a CP group).")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="The compute dtype (the Trainer's --bf16: bfloat16, --fp16: float16, neither: float32).")
    p.add_argument("--master-weights", action=argparse.BooleanOptionalAction, default=True,
                   help="fp32 weights, gradients and optimizer state with autocast compute in --dtype: what the "
                   "Trainer's --bf16 / --fp16 train with for a model loaded in fp32 (from_pretrained's dtype=float32); "
                   "--no-master-weights: a model loaded in --dtype and trained in it (dtype=torch.bfloat16).")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "smet", "none"),
                   help="The optimizer's state: torch AdamW (two moments per weight), SMET (the plugin's --smet: "
                   "compact state) or none.")
    p.add_argument("--smet-density", type=fraction, default=0.25,
                   help="With --optimizer smet: SMET's active fraction of the layer matrices (--smet_density).")
    p.add_argument("--loss-backend", default="torch", choices=("torch", "liger"),
                   help="The lean loss: chunked PyTorch (default) or liger-kernel's (when installed).")
    p.add_argument("--lora-rank", type=at_least(1), default=None,
                   help="A LoRA fine-tune (PEFT's get_peft_model; TRL's --use_peft --lora_r, which is taken too): "
                   "adapters of this rank on --lora-targets in every decoder layer, the base model frozen (its "
                   "weights without gradients or optimizer state; the adapters' in fp32), on the layers of "
                   f"{', '.join(LORA_FAMILIES.values())}. Default: full fine-tuning.")
    p.add_argument("--lora-targets", nargs="+", default=None, metavar="MODULE",
                   help=f"With --lora-rank: the layer matrices adapted ({', '.join(MODULE_INPUTS)}, or '{ALL_LINEAR}'; "
                   f"TRL's --lora_target_modules is taken too). Default: {' '.join(DEFAULT_TARGETS)} (PEFT's for "
                   "Llama, Mistral, Qwen2/3, Gemma and Gemma 3).")
    p.add_argument("--lora-dropout", type=float, default=0.0,
                   help="With --lora-rank: LoRA's dropout, in [0, 1) (PEFT's lora_dropout; TRL's lora_dropout "
                   "defaults to 0.05): above 0 every adapted input keeps a dropout mask and its own dropped copy.")
    add_checkpointing_argument(p)
    p.add_argument("--token-tiling-min-length", type=at_least(0), default=TILING_MIN_LENGTH,
                   help="MLPs and RMSNorms in token tiles from this length on, as the plugin's "
                   "--sparse_token_tiling_min_length (0: never).")
    p.add_argument("--token-tile-size", type=at_least(1), default=DEFAULT_TILE_TOKENS,
                   help="Tokens per tile of --token-tiling-min-length (the plugin's --sparse_token_tile_size).")
    p.add_argument("--offload-layer-inputs", action="store_true",
                   help="Saved layer inputs in host memory (the plugin's --sparse_offload_layer_inputs).")
    p.add_argument("--sparse-config", help="YAML/JSON SparseAttentionConfig, or a shipped pattern's name (`trial`): "
                   "its budgets size the layouts (default: the plugin's default pattern).")
    p.add_argument("--layout-width", default="curve", choices=("curve", "bound"),
                   help="Width of a layout whose budget bounds no diagonals (the default 'mass'): 'curve' reads the "
                   f"measured kept-fraction curve at the length (the shipped one, {DEFAULT_CURVE.source}, extrapolated "
                   f"past {DEFAULT_CURVE.usable[-1].seq_len} tokens; or --kept-curve), 'bound' sizes it at every block "
                   "of its rows (no run can exceed it).")
    p.add_argument("--kept-curve", help="A `benchmarks/pattern_quality.py --curve` report ('defaults' setting) for "
                   f"--layout-width curve (default: the shipped measurement, {DEFAULT_CURVE.source}).")
    p.add_argument("--seq-len", type=at_least(1), nargs="+", default=[],
                   help="Also report the predicted peak and its terms at these lengths.")
    p.add_argument("--quiet", action="store_true", help="Print only the longest length that fits.")
    p.add_argument("--json", help="Write the answer and the per-length terms to this JSON file (default: none; a "
                   "missing folder is created).")
    return p


def _pattern(args) -> SparseAttentionConfig:
    """The pattern --sparse-config names (the plugin's default pattern without it)."""
    return SparseAttentionConfig.from_file(pattern_path(args.sparse_config)) if args.sparse_config else \
        SparseAttentionConfig()


def lora_settings(args) -> LoraSettings | None:
    """The LoRA fine-tune --lora-rank, --lora-targets and --lora-dropout describe (None: full fine-tuning);
    ValueError naming the flag and the fix for values that describe none."""
    if args.lora_rank is None:
        return None
    if args.lora_targets and ALL_LINEAR in args.lora_targets and len(args.lora_targets) > 1:
        raise ValueError(f"--lora-targets {' '.join(args.lora_targets)}: '{ALL_LINEAR}' adapts every layer matrix; "
                         "give it alone, or the module names alone.")
    try:
        return LoraSettings(args.lora_rank, resolve_targets(args.lora_targets), args.lora_dropout)
    except ValueError as e:
        flag = "--lora-dropout" if "dropout" in str(e).split(":")[0] else "--lora-targets"
        raise ValueError(f"{flag}: {e}") from None


def settings_for_length(args, arch: Architecture) -> callable:
    """The step settings for each sequence length, as the plugin picks them (token tiles from a length on, for a model
    whose modules training tiles: `Architecture.token_tiles`)."""
    pattern = _pattern(args)
    curve = None if args.layout_width == "bound" else \
        KeptCurve.from_report(args.kept_curve) if args.kept_curve else DEFAULT_CURVE
    _, head_size = cp_layout(args, args.cp)
    document = args.cp_sharding == "document"  # (the planner's cap sizes its busiest rank: no block sharding's grid)
    base = StepSettings(dtype=args.dtype, master_weights=args.master_weights, optimizer=args.optimizer,
                        smet_density=args.smet_density, cp=args.cp, head_size=head_size, fsdp=args.fsdp,
                        sharding="striped" if document else args.cp_sharding,
                        max_token_ratio=args.cp_planner_max_token_ratio if document else None,
                        pattern=pattern, loss_backend=args.loss_backend, kept_curve=curve, lora=lora_settings(args))

    def settings(seq_len: int) -> StepSettings:
        tiled = arch.token_tiles and from_min_length(args.token_tiling_min_length, seq_len)
        savers = MemorySavers(tiled=tiled, tile_tokens=args.token_tile_size,
                              offload_layer_inputs=args.offload_layer_inputs)
        checkpointing = checkpointed(args, seq_len)
        return dataclasses.replace(base, savers=savers, gradient_checkpointing=checkpointing)

    return settings


def longest_length(args, arch: Architecture, budget: float) -> int:
    """`longest_fitting_length` under the settings training picks at each length. Gradient checkpointing, on from
    --gradient-checkpointing-min-length, lowers the peak at that length (#50: the search stopped at the first length
    below it whose activations did not fit): the longest checkpointed length when that length fits checkpointed,
    else the longest of the shorter ones, each range's peak growing with the length."""
    settings = settings_for_length(args, arch)
    always = lambda n: dataclasses.replace(settings(n), gradient_checkpointing=True)  # noqa: E731
    longest = longest_fitting_length(arch, budget, always, granularity=GRANULARITY, limit=SEARCH_LIMIT)
    if checkpointed(args, longest):
        return longest
    return longest_fitting_length(arch, budget, settings, granularity=GRANULARITY, limit=SEARCH_LIMIT)


def given_flags(argv: list[str] | None, prog: str) -> set[str]:
    """The destinations of the flags the command line gave, whatever their value (a default's too)."""
    parser = build_parser(prog)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def _check_read(args, parser: argparse.ArgumentParser, given: set[str], pattern: SparseAttentionConfig) -> None:
    """Refuse a flag that the other settings given would not read (silently ignored otherwise), naming both and the
    fix."""
    refuse_group_settings_without_cp(args, parser, [args.cp])  # (as training refuses them at CP 1, and simulate)
    unread_lora = sorted({"lora_targets", "lora_dropout"} & given)
    if unread_lora and args.lora_rank is None:
        parser.error(f"--{unread_lora[0].replace('_', '-')} describes a LoRA fine-tune's adapters; without --lora-rank "
                     "(full fine-tuning) it would be ignored: drop it, or give --lora-rank R (e.g. 16).")
    if args.lora_rank is not None and args.optimizer == "smet":
        parser.error("--optimizer smet with --lora-rank: SMET's compact state is for full fine-tuning's layer "
                     "matrices, which LoRA freezes; use --optimizer adamw for the adapters, or drop --lora-rank.")
    if "smet_density" in given and args.optimizer != "smet":
        parser.error(f"--smet-density {args.smet_density} is SMET's active fraction (--optimizer smet); with "
                     f"--optimizer {args.optimizer} it would be ignored: drop it, or use --optimizer smet.")
    if "cp_planner_max_token_ratio" in given and args.cp_sharding != "document":
        parser.error(f"--cp_planner_max_token_ratio {args.cp_planner_max_token_ratio} is the document planner's token "
                     f"cap; with --cp_sharding {args.cp_sharding} it would be ignored: drop it, or add --cp_sharding "
                     "document.")
    if not 1 <= args.cp_planner_max_token_ratio < math.inf:
        parser.error(f"--cp_planner_max_token_ratio {args.cp_planner_max_token_ratio} must be finite and >= 1 (a "
                     "multiple of the mean tokens per rank).")
    if "token_tile_size" in given and not args.token_tiling_min_length:
        parser.error(f"--token-tile-size {args.token_tile_size} sizes the tiles of --token-tiling-min-length; with "
                     "--token-tiling-min-length 0 (never tiled) it would be ignored: drop it, or give the length to "
                     "tile from.")
    if args.offload_layer_inputs and not args.gradient_checkpointing_min_length:
        parser.error("--offload-layer-inputs moves the inputs that gradient checkpointing saves, and training refuses "
                     "it without checkpointing (--gradient-checkpointing-min-length 0): drop it, or give the length to "
                     "checkpoint from (1: every length).")
    unread = [f"--kept-curve {args.kept_curve}"] if args.kept_curve else []
    unread += [f"--layout-width {args.layout_width}"] if "layout_width" in given else []
    if unread and pattern.pattern != "dense" and pattern.budget.most_diagonal_blocks(pattern.block_size) is not None:
        parser.error(f"{unread[0]} would not be read: the budget of --sparse-config {args.sparse_config} "
                     f"({pattern.budget.mode}) bounds the layouts' width; drop {unread[0].split()[0]}, or give a "
                     "pattern whose budget bounds no diagonals (budget mode mass).")


def _check(args, parser: argparse.ArgumentParser) -> None:
    if args.kept_curve and args.layout_width == "bound":  # a file named and never read would be silently ignored
        parser.error(f"--kept-curve {args.kept_curve} would not be read: --layout-width bound sizes every layout at "
                     "all the blocks of its rows; drop --layout-width bound to size them from the curve, or drop "
                     "--kept-curve.")
    if args.fsdp > 1 and args.fsdp % args.cp:  # (#50: --cp 8 --fsdp 3 was answered, a run no launch can make)
        parser.error(f"--fsdp {args.fsdp} with --cp {args.cp}: FSDP2 shards the model over every rank of a CP group "
                     "(accelerate's dp_shard x cp mesh; without a ParallelismConfig, over all processes), so its "
                     f"degree is a multiple of --cp: e.g. --fsdp {args.cp} (or {2 * args.cp} with two data-parallel "
                     "groups), or --fsdp 1 without FSDP.")


# How far measured peaks were from the predictions (docs/memory.md, "Validation"): within 2% below on CPU processes
# (4K-64K tokens, benchmarks/memory_model.py), 6-26% above on one H100 (Qwen2.5-0.5B, 64K-256K, before the held
# layouts were counted), and 1-6% below on one H200 after (6% at 512K). The band (measured / predicted) every answer
# is printed with spans them all: its top keeps the H100's runs, which are the only ones over.
MEASURED_BAND = (0.94, 1.26)


def architecture(args: argparse.Namespace) -> Architecture:
    """The model `--model` or `--config` names (ValueError, naming the field, for a config it cannot read)."""
    return model_shape(args, PRESETS, Architecture)


def predict(args: argparse.Namespace, capacity: float, arch: Architecture | None = None) -> dict:
    """The command's answer for its parsed `args` on a GPU of `capacity` bytes: the longest length that fits (and
    the longest whose peak fits even at the top of `MEASURED_BAND`) and the predicted step at it and at
    `args.seq_len` (what `main` prints and `memory_table` tabulates); `arch`: `architecture(args)` where the caller
    built it already (a config's is measured on its model)."""
    arch = architecture(args) if arch is None else arch
    settings = settings_for_length(args, arch)
    budget = args.usable_fraction * capacity
    memory_allows = longest_length(args, arch, budget)
    # (a learned position table bounds what the model's forward takes, whatever the memory: GPT-2's 1,024 tokens)
    margin = longest_length(args, arch, budget / MEASURED_BAND[1])
    longest, margin = (min(n, arch.max_positions or n) for n in (memory_allows, margin))
    lora = settings(1).lora
    report = {"model": model_name(args), "parameters": arch.params,
              "lora": None if lora is None else {"rank": lora.rank, "targets": list(lora.targets),
                                                 "dropout": lora.dropout,
                                                 "trainable_parameters": lora.params(arch.shape)},
              "gpu_memory_bytes": capacity,
              "usable_bytes": budget,
              "settings": {k: v for k, v in vars(args).items() if k not in ("json", "quiet", "seq_len")},
              "longest_fitting_tokens": longest, "longest_fitting_tokens_at_band_top": margin,
              "max_positions": arch.max_positions, "memory_allows_tokens": memory_allows,
              "measured_band": MEASURED_BAND, "prediction": True, "lengths": {}}
    for n in sorted({*args.seq_len, *([longest] if longest else [])}):
        est = predict_step_memory(arch, n, settings(n))
        report["lengths"][n] = {**est.to_dict(), "fits": est.peak_bytes <= budget and n <= (arch.max_positions or n),
                                "terms_bytes": est.terms(), "token_tiles": settings(n).savers.tiled,
                                "gradient_checkpointing": settings(n).gradient_checkpointing}
    return report


# The terms of the model's state, which sharding (--fsdp) and bf16 weights (--no-master-weights) shrink.
MODEL_STATE_TERMS = ("weights", "gradients", "optimizer state", "optimizer step temporaries", "autocast weight copies")


# The largest FSDP degree `_shortest_fix` tries for a model's state that outgrows a GPU.
FSDP_SEARCH_LIMIT = 4096


def _fsdp_that_fits(args: argparse.Namespace, arch: Architecture, budget: float) -> int | None:
    """The smallest FSDP degree above --fsdp, doubling from one that shards over whole CP groups, at which a length
    fits `budget` (`longest_length`: a checkpointed length may fit where the shortest, run without, does not; None:
    none up to `FSDP_SEARCH_LIMIT`)."""
    degree = max(2 * args.fsdp, args.cp)
    while degree <= FSDP_SEARCH_LIMIT:
        if longest_length(argparse.Namespace(**{**vars(args), "fsdp": degree}), arch, budget):
            return degree
        degree *= 2
    return None


def _shortest_fix(args: argparse.Namespace, arch: Architecture, budget: float) -> tuple[int, MemoryEstimate, str]:
    """The shortest length tried (`GRANULARITY` tokens per rank), its prediction and what would fit it within `budget`
    on a GPU that it outgrows: the model's state (FSDP shards it: the degree at which it fits, #50: the next degree
    up was named, where Qwen3-235B-A22B at --fsdp 8 needs 64), or the terms of the sequence (at a high CP degree the
    shortest length is long: attention layouts span every key block of it)."""
    shortest = GRANULARITY * args.cp
    settings = settings_for_length(args, arch)(shortest)
    est = predict_step_memory(arch, shortest, settings)
    state = sum(b for t, b in est.terms().items() if t in MODEL_STATE_TERMS)
    if state >= est.peak_bytes / 2:  # (the model's state is most of the peak)
        degree = _fsdp_that_fits(args, arch, budget)
        if degree is None:  # (#50: this named --fsdp as the fix, adding that no degree makes a length fit)
            return shortest, est, (f"sharding the model's state fits no length either (--fsdp up to "
                                   f"{FSDP_SEARCH_LIMIT}: what the sequence itself holds outgrows the GPU there): use "
                                   "a larger GPU")
        fixes = [f"shard the model's state over more ranks (--fsdp {degree}, where a length fits)"] + (
            [f"train a model loaded in {args.dtype} (--no-master-weights)"] if settings.autocast else [])
        return shortest, est, f"{', '.join(fixes)} or use a larger GPU"
    fewer = f"fewer CP ranks (--cp {args.cp // 2}) try shorter sequences, or " if args.cp > 1 else ""
    return shortest, est, f"mostly for the sequence: {fewer}use a larger GPU"


def _nothing_fits(args: argparse.Namespace, arch: Architecture, budget: float) -> str:
    """Why not even the shortest length tried fits, from its prediction (`_shortest_fix`)."""
    shortest, est, fix = _shortest_fix(args, arch, budget)
    largest = ", ".join(f"{t} {_gb(b)}" for t, b in list(est.terms().items())[:3])
    return (f"Not even {shortest:,} tokens ({shortest // args.cp:,} per rank, the shortest length tried) fit: the "
            f"peak there is {_gb(est.peak_bytes)} of the {_gb(budget)} usable (largest terms: {largest}); {fix}.")


def _none_at_band_top(args: argparse.Namespace, arch: Architecture, budget: float) -> str:
    """What the margin of the measured band leaves where no length fits with it (#50: this read "with that margin,
    0 tokens"): the shortest length tried, its peak at the band's top, and the fix."""
    shortest, est, fix = _shortest_fix(args, arch, budget / MEASURED_BAND[1])
    return (f"not even {shortest:,} tokens, the shortest length tried (its peak, {_gb(est.peak_bytes)}, is "
            f"{_gb(est.peak_bytes * MEASURED_BAND[1])} at the band's top, over the {_gb(budget)} usable; {fix})")


def _unchecked(fits: bool, offload: bool) -> str:
    """A length's note where training runs it without gradient checkpointing (below
    --gradient-checkpointing-min-length), with the fix where it does not fit or where --offload-layer-inputs, which
    training refuses without checkpointing, is given."""
    fix = ": the Trainer's --gradient_checkpointing (or --sparse_gradient_checkpointing_min_length at most this " \
        "length) turns it on"
    if offload:
        return f", no gradient checkpointing, under which training refuses --sparse_offload_layer_inputs{fix}"
    return ", no gradient checkpointing" + ("" if fits else fix)


def main(argv: list[str] | None = None, prog: str = "hf-sparse-cp memory") -> dict:
    """Run the command; returns what it printed as a dict (also written with --json)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    _check(args, parser)
    try:
        if args.json:
            check_output_file(args.json, "--json")
        given = given_flags(argv, prog)
        _check_read(args, parser, given, _pattern(args))
        capacity = parse_memory(args.gpu_memory)
        capacity = device_memory() if capacity is None else capacity
        arch = architecture(args)
        tiles = sorted({"token_tiling_min_length", "token_tile_size"} & given)
        if not arch.token_tiles and tiles and args.token_tiling_min_length:
            parser.error(f"--{tiles[0].replace('_', '-')}: training runs token tiles on the Llama-like families' MLPs "
                         f"and RMSNorms only ({', '.join(LEAN_LOSS_FAMILIES)}) and refuses them for "
                         f"{model_name(args)}; drop it (its answer is without tiles, as it trains with "
                         "--sparse_token_tiling_min_length 0).")
        if args.lora_rank is not None and not arch.lora_layers:
            parser.error(f"--lora-rank: {LORA_LAYERS}, not {model_name(args)}'s; drop --lora-rank for full "
                         "fine-tuning's answer (an upper bound), or give one of those models.")
        lora_settings(args)  # (its refusals name the flag)
        settings = settings_for_length(args, arch)
        settings(1)  # validates the settings
        predict_step_memory(arch, 1024, settings(1024))  # and them on this model (a head split its heads allow)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    report = predict(args, capacity, arch)
    budget, longest = report["usable_bytes"], report["longest_fitting_tokens"]
    if args.json:
        write_output(Path(args.json), json.dumps(report, indent=2) + "\n")
    if args.quiet:
        print(longest)
        return report
    mode, head_size = cp_layout(args, args.cp)
    heads = f", heads over {head_size} ranks" if head_size > 1 else ""
    where = f"CP {args.cp}" + (f" ({mode.name}{heads})" if args.cp > 1 else "") + \
        (f", FSDP {args.fsdp}" if args.fsdp > 1 else "")
    precision = (f"fp32 weights + {args.dtype} autocast (the Trainer's mixed precision; --no-master-weights: all "
                 f"{args.dtype})" if settings(1).autocast else f"all {args.dtype} (a model loaded in {args.dtype})")
    lora = settings(1).lora
    tuned = "full fine-tuning" if lora is None else \
        f"{lora.describe()}: {_parameters(lora.params(arch.shape))} trained parameters"
    print(f"{report['model']} ({_parameters(arch.params)} parameters), {tuned}, {precision}, {args.optimizer}, "
          f"{where}, one GPU of {_gb(capacity)} ({_gb(budget)} usable). Predictions of "
          "hf_sparse_cp.simulator.memory_model, not measurements.")
    if not arch.token_tiles and args.token_tiling_min_length:
        print(f"Without token tiles: training runs them on the Llama-like families' modules only and refuses them for "
              f"{report['model']}, which trains with --sparse_token_tiling_min_length 0.")
    low, high = MEASURED_BAND
    if arch.max_positions and report["memory_allows_tokens"] > arch.max_positions:
        print(f"{report['model']} takes at most {arch.max_positions:,} tokens (its learned position embeddings hold "
              f"{arch.max_positions:,} positions; a longer sequence fails in its forward): the memory alone would "
              f"allow {report['memory_allows_tokens']:,}.")
    if longest:
        margin = report["longest_fitting_tokens_at_band_top"]
        # An answer within one step of the search's limit is bounded by the limit, not by the memory: say so.
        bounded = longest + GRANULARITY * args.cp > SEARCH_LIMIT
        head = (f"At least {longest:,} tokens fit (the search stops at {SEARCH_LIMIT:,})" if bounded else
                f"Longest sequence that fits: {longest:,} tokens")
        at_top = f"{margin:,} tokens" if margin else _none_at_band_top(args, arch, budget)
        print(f"{head} ({longest // args.cp:,} per rank). Measured peaks were "
              f"{1 - low:.0%} below to {high - 1:.0%} above these predictions (docs/memory.md): with that margin, "
              f"{at_top}." + (" (That band was measured with the ring: the head groups' all-to-all terms "
                              "are counted on the code, not yet measured.)" if head_size > 1 else ""))
    else:
        print(_nothing_fits(args, arch, budget))
    for n, r in report["lengths"].items():
        beyond = f": beyond its {arch.max_positions:,} positions" if n > (arch.max_positions or n) else ""
        terms = ", ".join(f"{t} {_gb(b)}" for t, b in list(r["terms_bytes"].items())[:5])
        print(f"  {n:,} tokens: peak {_gb(r['peak_gib'] * GIB)} in {r['peak_phase']} "
              f"({'fits' if r['fits'] else 'does not fit'}{', token tiles' if r['token_tiles'] else ''}"
              f"{'' if r['gradient_checkpointing'] or beyond else _unchecked(r['fits'], args.offload_layer_inputs)}"
              f"{beyond}); "
              f"largest terms: {terms}; layout rows {r['layout_width']}")
    return report
