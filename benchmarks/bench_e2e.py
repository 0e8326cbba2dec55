"""End-to-end training step: stock `sdpa`, `sdpa` + liger-kernel and the `sparse_cp` variants, S doubling until
OOM.

One training step is forward, backward and AdamW on one sequence of S tokens (B = 1) of a Qwen2.5-0.5B- or
1.5B-shaped model (random init, bf16 weights, gradient checkpointing, loss from `model(input_ids,
labels=...)`). Every (model, variant, S) runs in a fresh subprocess (on the CPU forked from the sweep's process,
which imported torch once), so an out-of-memory error cannot leave fragments behind for the next; every variant
runs at a length before the next length (a sweep cut off by a time limit keeps the comparisons at the shorter
lengths), and a variant stops doubling at its first failure.
Reported: median step time of the timed steps after warm-up, tokens/s, peak memory
(`torch.cuda.max_memory_allocated` on GPU, the process's peak RSS on CPU), and for `sparse_cp` the mean kept
fraction of attention blocks it actually ran and its tokens/s over `sdpa` + liger-kernel and over `sdpa` at
the same S. At `--profile_seq_lens` (128K by default) one more step runs under torch.profiler: GPU time per
kernel, where a missed target's time went. With `--fit_max_seq`, each variant that ran at `--max_seq` then
goes on doubling S (one untimed-warm-up-free step per run) until a run fails or the cap is reached: the
longest length each variant fits (`longest_fit`). Prints a table and the issues' end-to-end targets (0.5B
trains at 512K and 1M; at 128K and 256K sparse_cp >= 3x and >= 5x the tokens/s of sdpa + liger (aim 4x at
128K), at no more memory) and writes JSON (device, versions, date, the command, settings, results, speed-ups,
longest fits, targets) to benchmarks/results/.

The sparse variants run as the plugin's Trainer path does, their `--sparse_fused_ops` setting aside: `sparse_cp` its
default ('auto': liger-kernel's RoPE, RMSNorm and SwiGLU kernels on CUDA where liger-kernel is installed, the
baseline's fused kernels outside attention and ours for attention), `sparse_cp+compile` the MLPs and RMSNorms
through torch.compile, `sparse_cp+unfused` stock PyTorch around attention, `sparse_cp+liger` liger-kernel's kernels
even in a compiled model (`--sparse_fused_ops liger`); each row records what ran (`fused_ops`) and the engines its
attention calls ran on, each with the reasons why (`attention_engines`: with 'auto' on CUDA the engine table,
`$HF_SPARSE_CP_ENGINE_TABLE`, decides between our kernels and Flex for a layer without columns, the dense first
layer's, where it has rows of that layer's head_dim). `--torch_compile` compiles the whole model of every run as a
stock script's --torch_compile does (the sparse attention calls inside its graphs as the plugin's custom ops, or
outside them with `--traced_attention outside`: one graph break per layer, as before the ops); the warm-up steps'
times (`warmup_times_s`) then include the compilation, and `sparse_cp`'s 'auto' leaves the work around attention to
inductor, as the plugin does under a Trainer's --torch_compile. The lean loss takes liger-kernel's fused linear
cross-entropy when it is installed (in a compiled model outside the graphs, one break). MLPs and RMSNorms run in
token tiles from `--token_tiling_min_length` (32K; the plugin's `--sparse_token_tiling_min_length`) on, saved layer
inputs in host memory with `--offload_layer_inputs`. Each sparse row also carries the memory model's prediction of
its peak (`predicted_peak_gib`, `hf_sparse_cp.simulator.memory_model`, what `hf-sparse-cp memory` computes) beside
the measured one. `python benchmarks/memory_model.py --start_length 0.5b` prints the longest S predicted to fit this
GPU.

The `sparse_cp` pattern budget: by default (`--kept_fraction 0.05`) vertical_topk and slash_topk are
derived per S so that about 5% of the causal blocks are kept when the picks land at random places,
as they do in a random-init model (`budget_for_kept_fraction`); the kept fraction actually run is
reported next to it. `--kept_fraction 0` keeps the budgets of the command line.

    python benchmarks/bench_e2e.py                                   # GPU: 0.5B and 1.5B, S = 8K .. 512K
    python benchmarks/bench_e2e.py --models 1.5b --variants sparse_cp --min_seq 65536 --sparse_slash_topk 1024
    python benchmarks/bench_e2e.py --tiny                            # CPU smoke run: tiny model, S = 1K .. 4K
    python benchmarks/bench_e2e.py --models 0.5b --min_seq 65536 --max_seq 131072 --fit_max_seq 1048576

`sparse_cp` runs the attention engine its config names (`--sparse_attention_engine`, default 'auto', which
reads the timing table `$HF_SPARSE_CP_ENGINE_TABLE` names; recorded in the JSON).

The pattern flags (`SparseAttentionFlags`: --sparse_vertical_topk, --sparse_slash_topk, --sparse_block_size,
...) set the pattern of the `sparse_cp` variant (the two budgets only with --kept_fraction 0).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

# The sparse variants by their `--sparse_fused_ops` setting (`hf_sparse_cp.integration.fused_ops`): `sparse_cp` as the
# plugin runs by default (liger-kernel's RoPE, RMSNorm and SwiGLU on CUDA where it is installed, inductor's fusion in
# a model compiled whole), compiled, unfused, and liger-kernel's asked for explicitly (also under --torch_compile).
SPARSE_FUSED_OPS = {"sparse_cp": "auto", "sparse_cp+compile": "compile", "sparse_cp+unfused": "off",
                    "sparse_cp+liger": "liger"}
VARIANTS = ("sdpa", "sdpa+liger", *SPARSE_FUSED_OPS)
# (sparse_cp+liger differs from sparse_cp only under --torch_compile: asked for by name)
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if SPARSE_FUSED_OPS.get(v) != "liger")
SPARSE_VARIANTS = tuple(SPARSE_FUSED_OPS)
# sdpa + liger-kernel: every kernel liger-kernel has for Qwen2 (its fused linear cross-entropy included), as a
# Trainer script's --use_liger_kernel applies them; the baseline as its users run it.
LIGER_VARIANTS = ("sdpa+liger",)
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Qwen2.5 shapes (Qwen2Config fields). Both sizes tie the input embedding and the LM head, as the
# released Qwen2.5-0.5B and 1.5B do.
MODEL_SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True),
}

# Pattern of the `sparse_cp` variant under --tiny (fields left at their defaults on the command line),
# scaled so that 1K-4K token sequences are sparse rather than below `min_seq_len`.
TINY_SPARSE = dict(block_size=64, min_seq_len=512, budget_mode="topk", vertical_topk=64, slash_topk=64,
                   sink_tokens=16, local_window=64, last_q=32)


@dataclass
class BenchArguments:
    models: list[str] | None = field(
        default=None,
        metadata={"help": f"Model shapes, from {sorted(MODEL_SHAPES)}; default 0.5b 1.5b (tiny with --tiny)."},
    )
    variants: list[str] = field(default_factory=lambda: list(DEFAULT_VARIANTS),
                                metadata={"help": f"From {VARIANTS}; default {DEFAULT_VARIANTS}."})
    min_seq: int | None = field(
        default=None, metadata={"help": "First sequence length; default 8192 (1024 with --tiny)."}
    )
    max_seq: int | None = field(
        default=None, metadata={"help": "Longest sequence length tried, S doubling; default 524288 (4096 with --tiny)."}
    )
    fit_max_seq: int | None = field(
        default=None,
        metadata={"help": "After the sweep, each variant that ran at max_seq goes on doubling S up to this length, one "
                  "step per run (no warm-up), until a run fails: the longest length it fits. Default: no search."},
    )
    warmup_steps: int = field(default=1, metadata={"help": "Untimed steps first (AdamW state, allocator warm-up)."})
    timed_steps: int = field(default=3, metadata={"help": "Timed steps; the median is reported."})
    tiny: bool = field(
        default=False,
        metadata={"help": "CPU-sized smoke run: the tiny model, short sequences and a tiny sparse pattern (each "
                  "unless given explicitly)."},
    )
    device: str = field(default="auto", metadata={"help": "'cuda', 'cpu' or 'auto' (cuda when available)."})
    timeout_s: int = field(default=3600, metadata={"help": "Wall-clock limit of one (model, variant, S) run."})
    kept_fraction: float | None = field(
        default=None,
        metadata={"help": "Pattern budget of sparse_cp as a target fraction of kept causal blocks: vertical_topk "
                  "and slash_topk are derived per S (random-placement estimate; the kept fraction actually run is "
                  "reported). 0 keeps the budgets given by --sparse_vertical_topk/--sparse_slash_topk. Default 0.05 "
                  "(0 with --tiny)."},
    )
    vertical_share: float = field(
        default=0.2, metadata={"help": "Share of the --kept_fraction budget spent on vertical key columns."}
    )
    profile_seq_lens: list[int] = field(
        default_factory=lambda: [131072],
        metadata={"help": "Sequence lengths at which one more training step is profiled by kernel (GPU time per "
                  "kernel, printed and in the JSON: where a step's time goes). Empty: none."},
    )
    token_tiling_min_length: int = field(
        default=32768,
        metadata={"help": "sparse_cp: MLPs and RMSNorms in token tiles from this S on, as the plugin's "
                  "--sparse_token_tiling_min_length does (0: never)."},
    )
    offload_layer_inputs: bool = field(
        default=False,
        metadata={"help": "sparse_cp: the saved layer inputs in pinned host memory (the plugin's "
                  "--sparse_offload_layer_inputs)."},
    )
    torch_compile: bool = field(
        default=False,
        metadata={"help": "Compile the whole model with torch.compile (inductor) after the plugin's set-up, as a stock "
                  "script's --torch_compile has the Trainer do; the warm-up steps include the compilation "
                  "(`warmup_times_s`)."},
    )
    traced_attention: str = field(
        default="auto",
        metadata={"help": "With --torch_compile, how the sparse attention calls are traced "
                  "($HF_SPARSE_CP_TRACED_ATTENTION of each run): 'auto' as the plugin's custom ops inside the graphs, "
                  "'outside' outside them (a graph break per call)."},
    )
    seed: int = field(default=0, metadata={"help": "Seed of the random init and the random tokens."})
    output: str | None = field(
        default=None, metadata={"help": "JSON path; default benchmarks/results/e2e_<device>_<date>.json."}
    )

    def __post_init__(self) -> None:
        if self.models is None:
            self.models = ["tiny"] if self.tiny else ["0.5b", "1.5b"]
        if self.min_seq is None:
            self.min_seq = 1024 if self.tiny else 8192
        if self.max_seq is None:
            self.max_seq = 4096 if self.tiny else 524288
        if self.kept_fraction is None:
            self.kept_fraction = 0.0 if self.tiny else 0.05
        if not 0.0 <= self.kept_fraction <= 1.0 or not 0.0 <= self.vertical_share <= 1.0:
            raise ValueError(f"kept_fraction ({self.kept_fraction}) and vertical_share ({self.vertical_share}) must "
                             "be in [0, 1]; e.g. --kept_fraction 0.05.")
        unknown = set(self.models) - set(MODEL_SHAPES)
        if unknown:
            raise ValueError(f"Unknown models {sorted(unknown)}; use {sorted(MODEL_SHAPES)}.")
        if self.traced_attention not in ("auto", "outside"):
            raise ValueError(f"traced_attention={self.traced_attention!r}: use 'auto' or 'outside'.")
        unknown = set(self.variants) - set(VARIANTS)
        if unknown:
            raise ValueError(f"Unknown variants {sorted(unknown)}; use {VARIANTS}.")
        if not 1 <= self.min_seq <= self.max_seq:
            raise ValueError(f"Need 1 <= min_seq <= max_seq; got {self.min_seq}, {self.max_seq}.")
        if self.fit_max_seq is not None and self.fit_max_seq <= self.max_seq:
            raise ValueError(f"fit_max_seq ({self.fit_max_seq}) must exceed max_seq ({self.max_seq}); e.g. "
                             f"{4 * self.max_seq}.")
        if self.warmup_steps < 0 or self.timed_steps < 1:
            raise ValueError("warmup_steps must be >= 0 and timed_steps >= 1.")

    def seq_lens(self) -> list[int]:
        return _doubling(self.min_seq, self.max_seq)

    def fit_seq_lens(self) -> list[int]:
        """The lengths of the fit search, after max_seq (none without fit_max_seq)."""
        return _doubling(2 * self.max_seq, self.fit_max_seq) if self.fit_max_seq else []


def _doubling(first: int, last: int) -> list[int]:
    lens, s = [], first
    while s <= last:
        lens.append(s)
        s *= 2
    return lens


# ----------------------------------------------------------------------------------- pattern budget


def budget_for_kept_fraction(seq_len: int, kept_fraction: float, vertical_share: float, block_size: int,
                             local_window: int, sink_tokens: int) -> dict:
    """vertical_topk and slash_topk expected to keep about `kept_fraction` of the causal blocks of one
    `seq_len`-token document when the picks land at random places (a random-init model).

    With NB = S / block_size query blocks (NB^2 / 2 causal blocks): a kept offset crosses two block
    diagonals (floor and ceil of offset / block_size) of NB / 2 blocks on average, i.e. 2 / NB of the
    causal blocks; the local window adds its ceil((local_window - 1) / block_size) + 1 diagonals of
    ~NB blocks each; a column costs 1 / block_size of a block in the query blocks after it, i.e.
    1 / S of the causal blocks (sinks included). `vertical_share` of the budget goes to columns.
    """
    nb = -(-seq_len // block_size)
    window_diagonals = -(-(local_window - 1) // block_size) + 1
    vertical_topk = max(0, round(vertical_share * kept_fraction * seq_len) - sink_tokens)
    slash_topk = max(0, round((1 - vertical_share) * kept_fraction * nb / 2 - window_diagonals))
    return {"target_kept_fraction": kept_fraction, "vertical_topk": vertical_topk, "slash_topk": slash_topk}


def sparse_settings(sparse, args: BenchArguments, seq_len: int) -> tuple[dict, dict | None]:
    """The `sparse_cp` config of one run (as a dict) and the budget derived for it (None: as given)."""
    if not args.kept_fraction:
        return sparse.to_dict(), None
    budget = budget_for_kept_fraction(seq_len, args.kept_fraction, args.vertical_share, sparse.block_size,
                                      sparse.local_window, sparse.sink_tokens)
    return sparse.replace(budget_mode="topk", vertical_topk=budget["vertical_topk"],
                          slash_topk=budget["slash_topk"]).to_dict(), budget


# ------------------------------------------------------------------------------ one run (subprocess)


def skip_reason(variant: str, device_type: str) -> str | None:
    """Why `variant` cannot run on this machine, or None."""
    if variant not in LIGER_VARIANTS and SPARSE_FUSED_OPS.get(variant) != "liger":
        return None
    if device_type != "cuda":
        return "liger-kernel's Triton kernels need a CUDA GPU"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed; pip install 'hf-sparse-cp[liger]'"
    return None


def step_settings(sparse: dict, tiled: bool, offload_layer_inputs: bool, loss_backend: str):
    """The memory model's settings (`hf_sparse_cp.simulator.memory_model.settings.StepSettings`) of a sparse run: a bf16
    model, AdamW, gradient checkpointing, the run's pattern, token tiles and loss backend."""
    from hf_sparse_cp import SparseAttentionConfig
    from hf_sparse_cp.memory import MemorySavers
    from hf_sparse_cp.simulator.memory_model.settings import StepSettings

    return StepSettings(loss_backend=loss_backend, pattern=SparseAttentionConfig.from_dict(sparse),
                        savers=MemorySavers(tiled=tiled, offload_layer_inputs=offload_layer_inputs))


def predicted_peak_gib(model_name: str, seq_len: int, settings) -> float:
    """The memory model's peak of one training step of a `MODEL_SHAPES` model at `seq_len` tokens, in GiB."""
    from transformers import Qwen2Config

    from hf_sparse_cp.simulator.memory_model.architecture import Architecture
    from hf_sparse_cp.simulator.memory_model.step import predict_step_memory

    arch = Architecture.from_config(Qwen2Config(**MODEL_SHAPES[model_name]), model_name)
    return predict_step_memory(arch, seq_len, settings).peak_bytes / 2**30


def build_model(model_name: str, seq_len: int, attn_implementation: str, device, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        **MODEL_SHAPES[model_name],
        max_position_embeddings=max(32768, seq_len),
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        attention_dropout=0.0,
        use_cache=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _peak_gib(device) -> dict:
    import torch

    if device.type == "cuda":
        return {"peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
                "memory_metric": "torch.cuda.max_memory_allocated"}
    return {"peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "memory_metric": "process peak RSS"}


class _EngineChoices(logging.Handler):
    """The attention engines a run's calls resolved to, each with every reason it was chosen for (the vertical-slash
    layers' and a dense layer's differ): `engines.resolve_engine` logs every choice once per process
    ("Block-sparse attention engine: %s (%s).", engine and reason), and each run is a process."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.chosen: dict[str, list[str]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        engine, why = record.args
        self.chosen.setdefault(engine, []).append(why)

    @classmethod
    def attach(cls) -> _EngineChoices:
        from hf_sparse_cp.attention import engines

        handler = cls()
        engines.logger.addHandler(handler)
        engines.logger.setLevel(logging.INFO)
        return handler


def run_one(spec: dict) -> dict:
    """Build the model of `spec`, run warm-up and timed training steps, return the measurements."""
    import torch

    from hf_sparse_cp.env import environment
    from hf_sparse_cp.testing.benchmarking import kernel_profile

    device = torch.device(spec["device"])
    variant, seq_len = spec["variant"], spec["seq_len"]
    result = {"model": spec["model"], "variant": variant, "seq_len": seq_len, "env": environment(device)}

    reason = skip_reason(variant, device.type)
    if reason is not None:
        return {**result, "status": "skipped", "reason": reason}
    if variant in LIGER_VARIANTS:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2

        apply_liger_kernel_to_qwen2()
    sparse = variant in SPARSE_VARIANTS
    if sparse:
        import hf_sparse_cp
        from hf_sparse_cp.loss import resolve_backend

        hf_sparse_cp.patch()
        hf_sparse_cp.enable_lean_loss()
        result["loss_backend"] = resolve_backend(device)
        tiled = bool(spec["token_tiling_min_length"]) and seq_len >= spec["token_tiling_min_length"]
        engine_choices = _EngineChoices.attach()
        result["predicted_peak_gib"] = predicted_peak_gib(
            spec["model"], seq_len, step_settings(spec["sparse"], tiled, spec["offload_layer_inputs"],
                                                  result["loss_backend"]))

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        model = build_model(spec["model"], seq_len, "sparse_cp" if sparse else "sdpa", device, spec["seed"])
        if sparse:
            from hf_sparse_cp import SparseAttentionConfig, configure
            from hf_sparse_cp.integration.stats import pop_kept_fractions

            configure(model, SparseAttentionConfig.from_dict(spec["sparse"]))
            from hf_sparse_cp.integration.fused_ops import (
                describe_fused_ops,
                enable_fused_ops,
                liger_settings,
                resolve_fused_ops,
            )
            from hf_sparse_cp.integration.memory_savers import enable_memory_savers
            from hf_sparse_cp.memory import MemorySavers

            # as the plugin's Trainer glue does: the fused ops first, the token tiles wrapping them
            choice = resolve_fused_ops(SPARSE_FUSED_OPS[variant], device.type == "cuda", spec["torch_compile"])
            enable_fused_ops(model, choice, liger_settings(None, lean_loss=True))
            result["fused_ops"] = {"setting": SPARSE_FUSED_OPS[variant], "choice": choice,
                                   "description": describe_fused_ops(model, spec["torch_compile"])}
            savers = MemorySavers(tiled=tiled, offload_layer_inputs=spec["offload_layer_inputs"])
            if savers.active:
                enable_memory_savers(model, savers)
            result["memory_savers"] = {"tiled": savers.tiled, "offload_layer_inputs": savers.offload_layer_inputs}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        generator = torch.Generator().manual_seed(spec["seed"])
        input_ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=generator).to(device)
        if spec["torch_compile"]:
            from hf_sparse_cp.integration.kernel_routing import unroute_kernel_funcs

            # (the plugin's set-up skips the Hub kernels package's routing, a graph break per checkpointed layer; the
            # baselines skip it too, so that the runs differ by their attention and fused ops only)
            unroute_kernel_funcs(model)
        # accelerate's prepare does this for a Trainer with --torch_compile (its TorchDynamoPlugin: inductor, no mode)
        step_model = torch.compile(model, backend="inductor") if spec["torch_compile"] else model
        result["torch_compile"] = spec["torch_compile"]
        if spec["torch_compile"]:
            from hf_sparse_cp.integration.compiled import TRACED_ENV

            os.environ[TRACED_ENV] = result["traced_attention"] = spec["traced_attention"]  # (this run's process)

        def train_step() -> float:
            loss = step_model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()

        times, losses = [], []
        for step in range(spec["warmup_steps"] + spec["timed_steps"]):
            if step == spec["warmup_steps"] and sparse:
                pop_kept_fractions(model)  # keep only the timed steps' statistics
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            losses.append(train_step())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        kept = pop_kept_fractions(model) if sparse else None
        if spec["torch_compile"]:  # what dynamo made of the model: graphs, graph breaks and their reasons, recompiles
            from torch._dynamo.utils import counters

            names = {"stats": "stats", "frames": "frames", "recompiles": "recompiles", "graph_breaks": "graph_break"}
            result["dynamo"] = {name: dict(counters[key]) for name, key in names.items()}
        if seq_len in spec["profile_seq_lens"]:
            result["kernels"] = kernel_profile(train_step, device.type, top=12, warmup=0)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):  # CPU allocator
            raise
        return {**result, "status": "oom", "reason": str(e).splitlines()[0], **_peak_gib(device)}

    timed = times[spec["warmup_steps"]:]
    step_s = statistics.median(timed)
    result.update(status="ok", step_s=step_s, tokens_per_s=seq_len / step_s, step_times_s=timed,
                  warmup_times_s=times[:spec["warmup_steps"]], losses=losses, **_peak_gib(device))
    if sparse:
        result["kept_fraction"] = sum(kept.values()) / len(kept) if kept else None
        result["kept_fraction_per_layer"] = kept
        result["attention_engines"] = engine_choices.chosen
    return result


# The worker's environment (device, versions), written before its run: a run that raises, is killed or times out
# still reports the device and versions it ran on, so a GPU JSON of failures alone names its GPU.
ENV_FILE = "env.json"


def worker_main(spec_json: str, result_path: str) -> None:
    spec = json.loads(spec_json)
    try:
        from hf_sparse_cp.env import environment

        Path(result_path).with_name(ENV_FILE).write_text(json.dumps(environment(spec["device"])))
        result = run_one(spec)
    except Exception as e:  # reported as data: one failed configuration must not end the sweep
        result = {"model": spec["model"], "variant": spec["variant"], "seq_len": spec["seq_len"], "status": "error",
                  "reason": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=-12)}
    Path(result_path).write_text(json.dumps(result))


# --------------------------------------------------------------------------------- sweep (parent)


# What a CPU run's worker imports, imported once in the parent it forks from (a fresh interpreter importing
# them again took most of a tiny run's time on a CPU).
CPU_PRELOAD = ("torch", "transformers.models.qwen2.modeling_qwen2", "hf_sparse_cp.env", "hf_sparse_cp.loss",
               "hf_sparse_cp.testing.benchmarking", "hf_sparse_cp.integration.fused_ops",
               "hf_sparse_cp.integration.memory_savers", "hf_sparse_cp.integration.stats",
               "hf_sparse_cp.simulator.memory_model.step")


def _forked_worker(spec_json: str, result_path: str, log_path: str) -> None:
    with open(log_path, "w") as log:  # its output read as a subprocess's would be
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    worker_main(spec_json, result_path)


def _forked(spec: dict, result_path: Path, timeout_s: int) -> tuple[int, str] | None:
    """The worker forked from this process (on the CPU: a process of its own as a fresh one, its address space and
    an out-of-memory kill its own, without importing torch and transformers again); (exit status, stderr), None
    past the timeout."""
    import importlib
    import multiprocessing

    for name in CPU_PRELOAD:
        importlib.import_module(name)
    log_path = result_path.with_name("log")
    sys.stdout.flush()
    sys.stderr.flush()
    proc = multiprocessing.get_context("fork").Process(
        target=_forked_worker, args=(json.dumps(spec), str(result_path), str(log_path)))
    proc.start()
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return None
    return proc.exitcode, log_path.read_text() if log_path.exists() else ""


def _fresh(spec: dict, result_path: Path, timeout_s: int) -> tuple[int, str] | None:
    """The worker in a fresh interpreter; (exit status, stderr), None past the timeout."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec), str(result_path)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return None
    return proc.returncode, proc.stderr


def run_in_subprocess(spec: dict, timeout_s: int) -> dict:
    base = {"model": spec["model"], "variant": spec["variant"], "seq_len": spec["seq_len"]}
    run = _forked if spec["device"] == "cpu" and os.name == "posix" else _fresh
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        ended = run(spec, result_path, timeout_s)
        env_path = result_path.with_name(ENV_FILE)
        env = {"env": json.loads(env_path.read_text())} if env_path.exists() else {}
        if ended is None:
            return {**base, **env, "status": "timeout", "reason": f"exceeded {timeout_s} s"}
        if result_path.exists():
            return {**env, **json.loads(result_path.read_text())}
        # No result file: the process died (a SIGKILL is usually the kernel's out-of-memory killer).
        returncode, stderr = ended
        status = "oom" if returncode == -9 else "error"
        return {**base, **env, "status": status, "reason": f"worker exited with {returncode}: {stderr[-2000:]}"}


def memory_check(results: list[dict]) -> list[dict]:
    """On a GPU, each sparse variant's peak memory vs the sdpa + liger-kernel run at the same (model, S); an OOM
    fails."""
    liger = {(r["model"], r["seq_len"]): r for r in results
             if r["variant"] == "sdpa+liger" and r["status"] == "ok"
             and r.get("memory_metric") == "torch.cuda.max_memory_allocated"}
    checks = []
    for r in results:
        ref = liger.get((r["model"], r["seq_len"]))
        if r["variant"] not in SPARSE_VARIANTS or ref is None or r["status"] not in ("ok", "oom"):
            continue
        ok = r["status"] == "ok"
        checks.append({"model": r["model"], "variant": r["variant"], "seq_len": r["seq_len"],
                       "sparse_cp_status": r["status"],
                       "sparse_cp_gib": r.get("peak_gib") if ok else None, "liger_gib": ref["peak_gib"],
                       "pass": ok and r["peak_gib"] <= ref["peak_gib"]})
    return checks


def speedups(results: list[dict]) -> list[dict]:
    """Each sparse variant's tokens/s over sdpa + liger-kernel and over sdpa at the same (model, S), where both
    ran."""
    ok = {(r["model"], r["variant"], r["seq_len"]): r for r in results if r["status"] == "ok"}
    out = []
    for (model, variant, seq_len), r in ok.items():
        if variant not in SPARSE_VARIANTS:
            continue
        entry = {"model": model, "variant": variant, "seq_len": seq_len, "kept_fraction": r.get("kept_fraction"),
                 "tokens_per_s": r["tokens_per_s"]}
        for name, ref in (("vs_liger", "sdpa+liger"), ("vs_sdpa", "sdpa")):
            base = ok.get((model, ref, seq_len))
            entry[name] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        out.append(entry)
    return out


def issue_targets(results: list[dict], model: str = "0.5b") -> list[dict]:
    """The issue's end-to-end targets for `model`, each with the measured value (None: not measured): for
    sparse_cp, and for sparse_cp + liger where it ran."""
    measured = {r["variant"] for r in results if r["model"] == model}
    targets = []
    for variant in [v for v in SPARSE_VARIANTS if v == "sparse_cp" or v in measured]:
        ratio = {e["seq_len"]: e["vs_liger"] for e in speedups(results)
                 if e["model"] == model and e["variant"] == variant}
        memory = {c["seq_len"]: c for c in memory_check(results) if c["model"] == model and c["variant"] == variant}
        for seq_len in (524288, 1048576):  # one GPU: 512K (#21), 1M on one H200 (#50)
            trains = [r for r in results if r["model"] == model and r["variant"] == variant and r["seq_len"] == seq_len]
            targets.append({"target": f"{model} {variant} trains at {seq_len // 1024}K", "required": "status ok",
                            "measured": trains[0]["status"] if trains else None,
                            "pass": trains[0]["status"] == "ok" if trains else None})
        for seq_len, bound, aim in ((131072, 3.0, 4.0), (262144, 5.0, None)):
            value = ratio.get(seq_len)
            targets.append({"target": f"{model} {seq_len // 1024}K: {variant} tokens/s over sdpa + liger",
                            "required": f">= {bound:g}" + (f" (aim {aim:g})" if aim else ""), "measured": value,
                            "pass": None if value is None else value >= bound})
            check = memory.get(seq_len)
            targets.append({"target": f"{model} {seq_len // 1024}K: {variant} peak memory <= sdpa + liger",
                            "required": "<= liger GiB", "measured": check["sparse_cp_gib"] if check else None,
                            "pass": check["pass"] if check else None})
    return targets


def memory_predictions(results: list[dict]) -> list[dict]:
    """Each sparse run's measured peak memory (GPU runs: `torch.cuda.max_memory_allocated`) against the memory
    model's prediction for its settings, where both exist."""
    return [{k: r.get(k) for k in ("model", "variant", "seq_len", "status", "step_s", "peak_gib", "predicted_peak_gib")}
            | {"measured_over_predicted": r["peak_gib"] / r["predicted_peak_gib"]}
            for r in results if r.get("predicted_peak_gib") and r.get("peak_gib") is not None
            and r.get("memory_metric") == "torch.cuda.max_memory_allocated"]


def longest_fits(results: list[dict], args: BenchArguments) -> list[dict]:
    """Per (model, variant): the longest S that ran ('ok'), and what ended the doubling: the status of the
    first run that did not succeed, or 'cap' (the sweep's last length, --fit_max_seq or --max_seq)."""
    fits = {}
    for r in results:
        entry = fits.setdefault((r["model"], r["variant"]), {"model": r["model"], "variant": r["variant"],
                                                            "seq_len": None, "ended_by": "cap"})
        if r["status"] == "ok":
            entry["seq_len"] = max(entry["seq_len"] or 0, r["seq_len"])
        elif entry["ended_by"] == "cap":
            entry["ended_by"] = r["status"]
    cap = args.fit_max_seq or args.max_seq
    for entry in fits.values():
        if entry["ended_by"] == "cap" and entry["seq_len"] != cap:
            entry["ended_by"] = "not run to the cap"
    return list(fits.values())


def format_table(results: list[dict]) -> str:
    ratio = {(e["model"], e["variant"], e["seq_len"]): e for e in speedups(results)}
    header = (f"{'model':<6} {'variant':<17} {'S':>7} {'status':<8} {'step s':>8} {'tokens/s':>9} {'peak GiB':>9} "
              f"{'kept':>6} {'x liger':>7} {'x sdpa':>7} {'pred GiB':>8}")
    lines = [header, "-" * len(header)]
    for r in results:
        kept = r.get("kept_fraction")
        if r["status"] == "ok":
            e = ratio.get((r["model"], r["variant"], r["seq_len"]))
            x = [f"{e[k]:7.2f}" if e and e[k] is not None else f"{'':7}" for k in ("vs_liger", "vs_sdpa")]
            cells = (f"{r['step_s']:8.3f}", f"{r['tokens_per_s']:9.0f}", f"{r['peak_gib']:9.2f}",
                     f"{kept:6.3f}" if kept is not None else f"{'':6}", *x)
        else:
            cells = (f"{'':8}", f"{'':9}", f"{r['peak_gib']:9.2f}" if "peak_gib" in r else f"{'':9}", f"{'':6}",
                     f"{'':7}", f"{'':7}")
        if r.get("predicted_peak_gib") is not None:
            cells += (f"{r['predicted_peak_gib']:8.2f}",)
        row = f"{r['model']:<6} {r['variant']:<17} {r['seq_len'] // 1024:>6}K {r['status']:<8} "
        lines.append((row + " ".join(cells)).rstrip())
    return "\n".join(lines)


def parse_args(argv):
    from transformers import HfArgumentParser

    from hf_sparse_cp import SparseAttentionFlags
    from hf_sparse_cp.trainer.arguments import PATTERN_PREFIX, explicit_fields, unprefixed

    parser = HfArgumentParser((BenchArguments, SparseAttentionFlags))
    args, flags = parser.parse_args_into_dataclasses(argv)
    sparse = flags.to_config()
    if args.tiny:
        given = unprefixed(explicit_fields(parser, argv), PATTERN_PREFIX)
        sparse = sparse.replace(**{k: v for k, v in TINY_SPARSE.items() if k not in given})
    return args, sparse


def main(argv: list[str]) -> dict:
    from hf_sparse_cp.testing.benchmarking import ReportFile, format_profiles, format_targets

    args, sparse = parse_args(argv)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"  # does not create a CUDA context here
    results = []
    out = ReportFile(RESULTS_DIR, "e2e", args.output)
    command = [sys.executable, *sys.argv] if argv == sys.argv[1:] else ["bench_e2e.py", *argv]

    def sweep(model: str, variants: list[str], seq_lens: list[int], warmup_steps: int, timed_steps: int) -> list[str]:
        """Run every variant at each of `seq_lens` before the next length (a run cut off later keeps the comparisons
        at the shorter lengths), a variant stopping at its first failure; the variants that ran at the last one."""
        running = list(variants)
        for seq_len in seq_lens:
            running = [v for v in running if run(model, v, seq_len, warmup_steps, timed_steps)]
        return running

    def run(model: str, variant: str, seq_len: int, warmup_steps: int, timed_steps: int) -> bool:
        """One (model, variant, S) run, recorded and written; whether it ran."""
        settings, budget = sparse_settings(sparse, args, seq_len)
        spec = {"model": model, "variant": variant, "seq_len": seq_len, "device": device,
                "warmup_steps": warmup_steps, "timed_steps": timed_steps, "seed": args.seed,
                "sparse": settings, "profile_seq_lens": args.profile_seq_lens,
                "token_tiling_min_length": args.token_tiling_min_length,
                "offload_layer_inputs": args.offload_layer_inputs, "torch_compile": args.torch_compile,
                "traced_attention": args.traced_attention}
        reason = skip_reason(variant, device)
        if reason is not None:  # known without starting a process
            r = {"model": model, "variant": variant, "seq_len": seq_len, "status": "skipped", "reason": reason}
        else:
            r = run_in_subprocess(spec, args.timeout_s)
        if variant in SPARSE_VARIANTS:
            given = settings["budget"]
            r["sparse_budget"] = budget or {key: given.get(key) for key in ("vertical_topk", "slash_topk")}
        results.append(r)
        if r["status"] == "ok":
            summary = f"{r['step_s']:.3f} s/step, {r['peak_gib']:.2f} GiB"
            if r.get("kept_fraction") is not None:
                summary += f", kept {r['kept_fraction']:.3f} of the causal blocks"
        else:
            summary = r.get("reason", "")
        print(f"[{model} {variant} S={seq_len}] {r['status']}: {summary}", flush=True)
        out.write(build_report(args, sparse, results, device, complete=False, command=command))
        return r["status"] == "ok"  # a longer sequence cannot succeed where this one did not

    ran_to_max = {model: sweep(model, args.variants, args.seq_lens(), args.warmup_steps, args.timed_steps)
                  for model in args.models}
    for model, variants in ran_to_max.items():  # the longest length each fits, after every headline figure
        for variant in variants:
            sweep(model, [variant], args.fit_seq_lens(), 0, 1)

    report = build_report(args, sparse, results, device, complete=True, command=command)
    print()
    print(f"{report['device']}, torch {report.get('torch')}, transformers {report.get('transformers')}")
    print(format_table(results))
    print(format_profiles(results, lambda r: f"{r['model']} {r['variant']} S={r['seq_len']}: one training step by "
                          f"kernel (timed median {r['step_s']:.3f} s)"), end="")
    for fit in report["longest_fit"]:
        longest = f"{fit['seq_len'] // 1024}K" if fit["seq_len"] else "nothing"
        print(f"{fit['model']} {fit['variant']}: longest length that ran {longest} (then: {fit['ended_by']})")
    print()
    print(format_targets(report["targets"]))
    for check in report["memory_check"]:
        if not check["pass"]:
            used = "ran out of memory" if check["sparse_cp_gib"] is None else f"{check['sparse_cp_gib']:.2f} GiB"
            print(f"WARNING: sparse_cp used more memory than liger-kernel for {check['model']} at "
                  f"S={check['seq_len']}: {used} vs {check['liger_gib']:.2f} GiB")
    out.write(report)
    return report


def build_report(args: BenchArguments, sparse, results: list[dict], device: str, complete: bool,
                 command: list[str] | None = None) -> dict:
    """The JSON of a run so far: environment (from the first worker that reported it), the command,
    settings, results and what follows from them; `complete` is false while runs remain."""
    from hf_sparse_cp.attention.engines import ENGINE_ENV, TABLE_ENV

    env = next((r["env"] for r in results if "env" in r), {"device": device})
    return {
        "benchmark": "bench_e2e",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "complete": complete,
        **env,
        "command": command,
        "settings": {**{k: v for k, v in dataclasses.asdict(args).items() if k != "output"},
                     "batch_size": 1, "dtype": "bfloat16", "optimizer": "AdamW", "gradient_checkpointing": True,
                     "model_shapes": {m: MODEL_SHAPES[m] for m in args.models},
                     ENGINE_ENV: os.environ.get(ENGINE_ENV), TABLE_ENV: os.environ.get(TABLE_ENV)},
        "sparse_attention": sparse.to_dict(),
        "results": [{k: v for k, v in r.items() if k != "env"} for r in results],
        "memory_check": memory_check(results),
        "speedups": speedups(results),
        "longest_fit": longest_fits(results, args),
        "memory_predictions": memory_predictions(results),
        "targets": issue_targets(results),
    }


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1:])
