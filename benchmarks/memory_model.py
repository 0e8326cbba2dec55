"""Peak memory of one training step, measured on this CPU, against `hf_sparse_cp.simulator.memory_model`'s
prediction.

Measurement: every (model, variant, S) runs in a fresh subprocess, so nothing a previous run freed
but kept (allocator arenas, fragments) raises its peak. The process's resident set is read from
/proc/self/status: `VmRSS` after the imports (the runtime's baseline), and `VmHWM`, the high-water
mark, reset at each phase of the step (`/proc/self/clear_refs` <- 5) so that forward (which
includes the lean loss), backward and the optimizer step each get their own peak. glibc's malloc
runs with a fixed mmap threshold of 64 KiB (`GLIBC_TUNABLES`): every tensor buffer above it is
mapped on allocation and returned to the kernel on free, so the resident set follows the live
tensors (the dynamic threshold glibc uses by default would put buffers below 32 MiB on its heap,
where freed memory stays resident).

The step is the one the plugin trains with: a Qwen2-architecture model (`--grid architectures`: one
small shape in each of `ARCHITECTURES`, `--model_type` picking some) in bf16 (AdamW state in
bf16 too), gradient checkpointing (non-reentrant), the `sparse_cp` backend with a sparse pattern
from the first layer on (CPU: the PyTorch reference), the lean loss (chunked PyTorch), one
sequence of S tokens. A warm-up step of 256 tokens (a run's `warmup_len`) creates the optimizer state first.

Prediction: `hf_sparse_cp.simulator.memory_model.step.predict_step_memory` for the same shape, length, settings and
implementation ('reference'); the measured peak minus the baseline is compared with the predicted
tensor bytes, per phase. Each run's terms are in the JSON.

    python benchmarks/memory_model.py                    # the validation grid (2-3 hours on 2 shared cores)
    python benchmarks/memory_model.py --grid quick       # tiny model only (minutes)
    python benchmarks/memory_model.py --grid architectures --model_type gpt_neox   # (all seven: 25 minutes)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Every buffer of 64 KiB or more is mapped on allocation and unmapped on free: the resident set follows the
# live tensors.
FOLLOWING_MALLOC = "glibc.malloc.mmap_threshold=65536"

# Measured shapes (Qwen2Config fields). "0.5b-<n>l": Qwen2.5-0.5B's layer and vocabulary with n layers.
_QWEN05 = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
               vocab_size=151936, tie_word_embeddings=True)
SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True),
    "0.5b-2l": dict(_QWEN05, num_hidden_layers=2),
    "0.5b-4l": dict(_QWEN05, num_hidden_layers=4),
    "0.5b-2l-v8k": dict(_QWEN05, num_hidden_layers=2, vocab_size=8192),
    "0.5b-4l-v8k": dict(_QWEN05, num_hidden_layers=4, vocab_size=8192),
}
# Other architectures (`--model_type`), one small shape for all ("small-<model_type>", built by
# `hf_sparse_cp.testing.tiny_models.tiny_config`), Qwen2's among them as the control: GPT-NeoX and GPT-2 have no
# key/value heads of their own; GPT-2's dropout (on by default) is off, as the model counts none; Gemma 3 alternates
# a layer of a 512-token window with a global one; Mistral's window is every layer's.
_SMALL = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, vocab_size=8192)
ARCHITECTURES = {
    "qwen2": {}, "gpt_neox": dict(num_key_value_heads=4), "phi": {}, "starcoder2": {},
    "gpt2": dict(num_key_value_heads=4, resid_pdrop=0.0, embd_pdrop=0.0),
    "gemma3_text": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=512),
    "mistral": dict(sliding_window=1024),
}
SHAPES.update({f"small-{t}": dict(_SMALL, model_type=t, **extra) for t, extra in ARCHITECTURES.items()})
# The pattern of every measured run: sparse from the first layer on and from 1K tokens, budgets small enough
# that the reference attention stays cheap on a CPU at 64K.
PATTERN = dict(block_size=128, min_seq_len=1024, dense_first_layers=0, vertical_topk=64, slash_topk=4,
               sink_tokens=64, local_window=128, last_q=64)


def model_type(model: str) -> str:
    """The transformers model type of shape `model` (the validation's: qwen2)."""
    return SHAPES[model].get("model_type", "qwen2")


def model_config(model: str, seq_len: int):
    """The transformers config of shape `model` for a run of `seq_len` tokens: Qwen2's (the validation's), or
    another architecture's from `tiny_config` (positions as many as Qwen2's, a learned table included)."""
    from transformers import Qwen2Config

    from hf_sparse_cp.testing.tiny_models import tiny_config

    fields = dict(SHAPES[model])
    positions = max(32768, seq_len)
    if "model_type" not in fields:
        return Qwen2Config(**fields, max_position_embeddings=positions, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                           attention_dropout=0.0, use_cache=False)
    config = tiny_config(fields.pop("model_type"), max_position_embeddings=positions, **fields)
    config.use_cache = False
    return config


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE).group(1))


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _phase(mark: float) -> dict:
    """A measured phase that started at `mark` (`time.perf_counter`): the process's peak resident bytes since the
    peak was last reset, its resident bytes now, and the phase's seconds."""
    return {"peak": _status_kib("VmHWM") * 1024, "after": _status_kib("VmRSS") * 1024, "s": time.perf_counter() - mark}


def run_one(spec: dict) -> dict:
    """Build the model of `spec`, run the warm-up and the measured step, return the measurements."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig, configure

    baseline = _status_kib("VmRSS") * 1024
    seq_len = spec["seq_len"]
    hf_sparse_cp.patch()
    hf_sparse_cp.enable_lean_loss()
    config = model_config(spec["model"], seq_len)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sparse_cp", dtype=torch.bfloat16)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    configure(model, SparseAttentionConfig(**PATTERN))
    savers = spec.get("savers", {})
    if savers:
        from hf_sparse_cp.integration.memory_savers import enable_memory_savers
        from hf_sparse_cp.memory import MemorySavers

        enable_memory_savers(model, MemorySavers(**savers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    generator = torch.Generator().manual_seed(0)

    def step(n: int, phases: dict | None) -> float:
        ids = torch.randint(0, config.vocab_size, (1, n), generator=generator)
        mark = time.perf_counter()
        if phases is not None:
            _reset_peak()
        loss = model(input_ids=ids, labels=ids).loss
        if phases is not None:
            phases["forward"] = _phase(mark)
            mark = time.perf_counter()
            _reset_peak()
        loss.backward()
        if phases is not None:
            phases["backward"] = _phase(mark)
            mark = time.perf_counter()
            _reset_peak()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if phases is not None:
            phases["optimizer"] = _phase(mark)
        return float(loss)

    after_build = _status_kib("VmRSS") * 1024
    step(spec["warmup_len"], None)
    after_warmup = _status_kib("VmRSS") * 1024
    phases: dict = {}
    loss = step(seq_len, phases)
    return {"status": "ok", "loss": loss, "baseline_bytes": baseline, "after_build_bytes": after_build,
            "after_warmup_bytes": after_warmup, "phases": phases,
            "process_peak_bytes": _status_kib("VmHWM") * 1024,
            "parameters": sum(p.numel() for p in model.parameters())}


def worker_main(spec_json: str, result_path: str) -> None:
    spec = json.loads(spec_json)
    try:
        result = run_one(spec)
    except Exception as e:  # reported as data: one failed configuration must not end the sweep
        result = {"status": "error", "reason": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=8)}
    Path(result_path).write_text(json.dumps({**spec, **result}))


def run_in_subprocess(spec: dict, timeout_s: int) -> dict:
    env = {**os.environ, "GLIBC_TUNABLES": FOLLOWING_MALLOC}
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec), str(result_path)]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False, env=env)
        except subprocess.TimeoutExpired:
            return {**spec, "status": "timeout", "reason": f"exceeded {timeout_s} s"}
        if result_path.exists():
            return json.loads(result_path.read_text())
        return {**spec, "status": "error", "reason": f"worker exited with {proc.returncode}: {proc.stderr[-2000:]}"}


GRIDS = {
    # (model, S, savers): the stock step, then with token tiles.
    "validation": [("tiny", 4096, {}), ("tiny", 16384, {}), ("tiny", 65536, {}),
                   ("0.5b-2l", 4096, {}), ("0.5b-2l", 8192, {}), ("0.5b-2l-v8k", 16384, {}),
                   ("0.5b-2l-v8k", 32768, {}), ("0.5b-2l-v8k", 32768, {"tiled": True}),
                   ("tiny", 65536, {"tiled": True}), ("0.5b-2l-v8k", 65536, {"tiled": True})],
    "quick": [("tiny", 4096, {}), ("tiny", 8192, {"tiled": True, "tile_tokens": 2048})],
    # every architecture's small shape at two lengths (`--model_type` picks some)
    "architectures": [(f"small-{t}", n, {}) for n in (4096, 16384) for t in ARCHITECTURES],
}
# The step's peak must be predicted within this share of the measured one.
TOLERANCE = 0.10
# Predictions reported for GPUs: models, lengths, the usable share of an 80 GB GPU.
PREDICTED_MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b")
PREDICTED_LENGTHS = (131072, 524288, 1048576)
GPU_BYTES, USABLE = 80e9, 0.9


def _key(model: str, seq_len: int, savers: dict) -> tuple:
    return model, seq_len, json.dumps(savers, sort_keys=True)


def measure(grid: str, runs_path: Path, timeout_s: int, model_types: list[str] | None = None) -> list[dict]:
    """Run every configuration of `grid` (of `model_types` only, if given) not yet measured in `runs_path`, each in
    its own process, rewriting `runs_path` after each."""
    runs = json.loads(runs_path.read_text())["runs"] if runs_path.exists() else []
    done = {_key(r["model"], r["seq_len"], r.get("savers", {})) for r in runs if r["status"] == "ok"}
    for model, seq_len, savers in GRIDS[grid]:
        if _key(model, seq_len, savers) in done or (model_types and model_type(model) not in model_types):
            continue
        spec = {"model": model, "seq_len": seq_len, "warmup_len": 256, "savers": savers, "pattern": PATTERN}
        start = time.time()
        r = run_in_subprocess(spec, timeout_s)
        r["wall_s"] = time.time() - start
        runs = [x for x in runs if _key(x["model"], x["seq_len"], x.get("savers", {})) != _key(model, seq_len, savers)]
        runs.append(r)
        runs_path.parent.mkdir(parents=True, exist_ok=True)
        record = {"malloc": FOLLOWING_MALLOC, "pattern": PATTERN, "runs": runs}
        runs_path.write_text(json.dumps(record, indent=1) + "\n")
        peak = max(p["peak"] for p in r["phases"].values()) if r["status"] == "ok" else None
        print(f"[{model} S={seq_len} {savers or 'stock'}] {r['status']}"
              + (f": peak {peak / 2**30:.2f} GiB, {r['wall_s']:.0f} s" if peak else f": {r.get('reason')}"), flush=True)
    return runs


# ------------------------------------------------------------------------------------------ validation


def cpu_settings(run: dict):
    """The `StepSettings` of a measured run (CPU: the reference attention, AdamW per tensor)."""
    from hf_sparse_cp import SparseAttentionConfig
    from hf_sparse_cp.memory import MemorySavers
    from hf_sparse_cp.simulator.memory_model.settings import StepSettings

    return StepSettings(device="cpu", pattern=SparseAttentionConfig(**run.get("pattern", PATTERN)),
                        savers=MemorySavers(**run.get("savers", {})))


def architecture(model: str, seq_len: int):
    from hf_sparse_cp.simulator.memory_model.architecture import Architecture

    return Architecture.from_config(model_config(model, seq_len), model)


def validate(run: dict) -> dict:
    """Measured and predicted peaks of one run, per phase (MiB).

    Measured: the phase's high-water mark minus the resident set after the imports. Predicted: the
    model's tensor bytes plus the runtime's own memory, read from the same process: its resident set
    after the warm-up step minus the predicted weights and optimizer state (the allocator's and the
    autograd engine's own structures, ~35-50 MiB here, which a GPU's allocated bytes do not count)."""
    from hf_sparse_cp.simulator.memory_model.step import predict_step_memory

    est = predict_step_memory(architecture(run["model"], run["seq_len"]), run["seq_len"], cpu_settings(run))
    base = run["baseline_bytes"]
    state = sum(est.terms("optimizer").get(t, 0.0) for t in ("weights", "optimizer state"))
    runtime = run["after_warmup_bytes"] - base - state
    predicted = {"forward": max(est.phases["forward"]["bytes"], est.phases["loss"]["bytes"]),
                 "backward": est.phases["backward"]["bytes"], "optimizer": est.phases["optimizer"]["bytes"]}
    rows = {}
    for phase, value in predicted.items():
        measured = run["phases"][phase]["peak"] - base
        rows[phase] = {"measured_mib": measured / 2**20, "predicted_mib": (value + runtime) / 2**20,
                       "error": (value + runtime) / measured - 1}
    measured_peak = max(r["measured_mib"] for r in rows.values())
    predicted_peak = max(r["predicted_mib"] for r in rows.values())
    return {"model": run["model"], "seq_len": run["seq_len"], "savers": run.get("savers", {}),
            "runtime_mib": runtime / 2**20, "phases": rows, "measured_peak_mib": measured_peak,
            "predicted_peak_mib": predicted_peak, "error": predicted_peak / measured_peak - 1,
            "pass": abs(predicted_peak / measured_peak - 1) <= TOLERANCE,
            "predicted_terms_mib": {p: {t: b / 2**20 for t, b in est.terms(p).items()} for p in est.phases}}


def cuts(rows: list[dict]) -> list[dict]:
    """For each (model, S) measured with and without token tiles: the measured and the predicted fall."""
    stock = {(r["model"], r["seq_len"]): r for r in rows if not r["savers"]}
    out = []
    for r in rows:
        ref = stock.get((r["model"], r["seq_len"]))
        if r["savers"] and ref is not None:
            out.append({"model": r["model"], "seq_len": r["seq_len"], "savers": r["savers"],
                        "measured_fall_mib": ref["measured_peak_mib"] - r["measured_peak_mib"],
                        "predicted_fall_mib": ref["predicted_peak_mib"] - r["predicted_peak_mib"]})
    return out


# ------------------------------------------------------------------------------------------ predictions


def gpu_predictions() -> dict:
    """Predictions for one GPU (labelled as such): the Qwen2.5 presets at 128K, 512K and 1M tokens with the
    plugin's defaults (token tiles from 32K on), without token tiles, and with offload; the dominant
    term; the longest length that fits 72 of 80 GB; 3B at 1M on 8 GPUs with CP 8 and FSDP 8."""
    from hf_sparse_cp.simulator.memory_model.presets import PRESETS
    from hf_sparse_cp.simulator.memory_model.search import longest_fitting_length
    from hf_sparse_cp.simulator.memory_model.settings import StepSettings, with_savers
    from hf_sparse_cp.simulator.memory_model.step import predict_step_memory

    budget = USABLE * GPU_BYTES
    variants = {"defaults (token tiles)": dict(tiled=True), "no token tiles": dict(tiled=False),
                "token tiles + offload": dict(tiled=True, offload_layer_inputs=True)}
    table = []
    for name in PREDICTED_MODELS:
        arch = PRESETS[name]
        for variant, savers in variants.items():
            settings = with_savers(StepSettings(), **savers)
            for seq_len in PREDICTED_LENGTHS:
                est = predict_step_memory(arch, seq_len, settings)
                table.append({"model": name, "variant": variant, "seq_len": seq_len, "peak_gb": est.peak_bytes / 1e9,
                              "fits_72gb": est.peak_bytes <= budget, "dominant_term": est.dominant_term,
                              "terms_gb": {t: b / 1e9 for t, b in est.terms().items()}})
    fits = {name: {variant: longest_fitting_length(PRESETS[name], budget,
                                                   with_savers(StepSettings(), **savers), granularity=8192)
                   for variant, savers in variants.items()} for name in PREDICTED_MODELS}
    arch = PRESETS["qwen2.5-0.5b"]
    est = predict_step_memory(arch, 131072, with_savers(StepSettings(), tiled=True))
    floor = arch.shape.layers * arch.shape.hidden * 2
    cp8 = predict_step_memory(PRESETS["qwen2.5-3b"], 1 << 20,
                              with_savers(StepSettings(cp=8, fsdp=8), tiled=True))
    one_m = predict_step_memory(arch, 1 << 20, with_savers(StepSettings(), tiled=True))
    return {
        "label": "predictions of hf_sparse_cp.memory for one GPU (Triton kernels, bf16 weights and AdamW state, "
                 "gradient checkpointing, chunked PyTorch loss); not measured on a GPU",
        "usable_bytes": budget, "table": table, "longest_fitting_tokens": fits,
        "targets": [
            {"target": "0.5B, bf16, 1M tokens, CP 1: predicted peak <= 72 GB", "required": "<= 72 GB",
             "measured": one_m.peak_bytes / 1e9, "pass": one_m.peak_bytes <= budget,
             "note": "prediction, with the default token tiles"},
            {"target": "3B at 1M on 8 GPUs (CP 8, FSDP 8): predicted peak per GPU <= 72 GB", "required": "<= 72 GB",
             "measured": cp8.peak_bytes / 1e9, "pass": cp8.peak_bytes <= budget, "note": "prediction"},
            {"target": "0.5B at 128K: token-scaled bytes per token / (layers x hidden x 2)", "required": "<= 1.5",
             "measured": est.token_scaled_bytes() / est.tokens_per_rank / floor,
             "pass": est.token_scaled_bytes() / est.tokens_per_rank / floor <= 1.5, "note": "prediction"},
        ],
        "cp8_3b_1m_terms_gb": {t: b / 1e9 for t, b in cp8.terms().items()},
    }


def _bench_e2e():
    """benchmarks/bench_e2e.py as a module (benchmarks are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_e2e", Path(__file__).with_name("bench_e2e.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their module while it executes
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


def bench_e2e_start_length(model: str = "0.5b", gpu_bytes: float | None = None, usable: float = USABLE,
                           granularity: int = 8192) -> int:
    """The first length of the GPU session's longest-length stage: the longest sequence that
    `benchmarks/bench_e2e.py`'s `sparse_cp` variant is predicted to train on this GPU (its model
    shape, bf16 weights and AdamW state, its per-length pattern budget at --kept_fraction 0.05, token
    tiles from 32K on, the loss backend it resolves), rounded down to `granularity` tokens.

    Args:
        model: a bench_e2e model name ('0.5b', '1.5b').
        gpu_bytes: the GPU's memory; default: CUDA device 0's.
        usable: the share of it a step may fill (the rest: CUDA context, fragmentation).

    Returns:
        Tokens (a prediction: run at it, and above it to find the measured limit)."""

    from transformers import Qwen2Config

    from hf_sparse_cp import SparseAttentionConfig
    from hf_sparse_cp.loss import is_liger_kernel_available
    from hf_sparse_cp.memory import TILING_MIN_LENGTH, MemorySavers, from_min_length
    from hf_sparse_cp.simulator.memory_cli import device_memory
    from hf_sparse_cp.simulator.memory_model.architecture import Architecture
    from hf_sparse_cp.simulator.memory_model.search import longest_fitting_length
    from hf_sparse_cp.simulator.memory_model.settings import StepSettings

    bench = _bench_e2e()
    if model not in bench.MODEL_SHAPES:
        raise ValueError(f"unknown bench_e2e model {model!r}; use one of {sorted(bench.MODEL_SHAPES)}.")
    arch = Architecture.from_config(Qwen2Config(**bench.MODEL_SHAPES[model]), model)
    gpu_bytes = device_memory() if gpu_bytes is None else gpu_bytes
    pattern = SparseAttentionConfig()
    loss = "liger" if is_liger_kernel_available() else "torch"  # what bench_e2e resolves on a GPU

    def settings(seq_len: int) -> StepSettings:
        b = bench.budget_for_kept_fraction(seq_len, 0.05, 0.2, pattern.block_size, pattern.local_window,
                                           pattern.sink_tokens)
        return StepSettings(loss_backend=loss, savers=MemorySavers(tiled=from_min_length(TILING_MIN_LENGTH, seq_len)),
                            pattern=pattern.replace(budget_mode="topk", vertical_topk=b["vertical_topk"],
                                                    slash_topk=b["slash_topk"]))

    return longest_fitting_length(arch, usable * gpu_bytes, settings, granularity=granularity)


# ------------------------------------------------------------------------------------------ report


def format_validation(rows: list[dict]) -> str:
    header = (f"{'model':<12} {'S':>6} {'savers':<8} {'phase':<9} {'measured MiB':>12} {'predicted MiB':>13} "
              f"{'error':>7}")
    lines = [header, "-" * len(header)]
    for r in rows:
        savers = "tiles" if r["savers"].get("tiled") else "stock"
        for phase, v in r["phases"].items():
            lines.append(f"{r['model']:<12} {r['seq_len'] // 1024:>5}K {savers:<8} {phase:<9} "
                         f"{v['measured_mib']:>12.0f} {v['predicted_mib']:>13.0f} {v['error']:>+7.1%}")
        lines.append(f"{'':<12} {'':>6} {'':<8} {'step':<9} {r['measured_peak_mib']:>12.0f} "
                     f"{r['predicted_peak_mib']:>13.0f} {r['error']:>+7.1%} {'ok' if r['pass'] else 'MISS'}")
    return "\n".join(lines)


def format_predictions(pred: dict) -> str:
    lines = [f"PREDICTIONS ({pred['label']}):",
             f"{'model':<13} {'variant':<23} {'S':>6} {'peak GB':>8} {'fits 72':>7}  dominant term"]
    for r in pred["table"]:
        lines.append(f"{r['model']:<13} {r['variant']:<23} {r['seq_len'] // 1024:>5}K {r['peak_gb']:>8.1f} "
                     f"{'yes' if r['fits_72gb'] else 'no':>7}  {r['dominant_term']}")
    fitting = pred["longest_fitting_tokens"].items()
    lines.append("longest sequence within 72 of 80 GB (tokens): " + "; ".join(
        f"{m}: " + ", ".join(f"{v} {n:,}" for v, n in fits.items()) for m, fits in fitting))
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hf_sparse_cp.simulator.memory_model.presets import PRESETS
    from hf_sparse_cp.simulator.memory_model.settings import StepSettings, with_savers
    from hf_sparse_cp.simulator.memory_model.step import predict_step_memory

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    rows = report["validation"]
    labels = [f"{r['model']} {r['seq_len'] // 1024}K{' tiles' if r['savers'].get('tiled') else ''}" for r in rows]
    x = range(len(rows))
    left.bar([i - 0.2 for i in x], [r["measured_peak_mib"] / 1024 for r in rows], 0.4, label="measured (CPU peak RSS)")
    left.bar([i + 0.2 for i in x], [r["predicted_peak_mib"] / 1024 for r in rows], 0.4, label="predicted")
    left.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=8)
    left.set_ylabel("peak of a training step, GiB (above the imports)")
    left.set_title("CPU: measured vs predicted step peak")
    left.legend()
    arch = PRESETS["qwen2.5-0.5b"]
    lengths = [2**k for k in range(15, 22)]
    for label, savers in (("no token tiles", {}), ("token tiles (default)", {"tiled": True}),
                          ("token tiles + offload", {"tiled": True, "offload_layer_inputs": True})):
        peaks = [predict_step_memory(arch, n, with_savers(StepSettings(), **savers)).peak_bytes / 1e9 for n in lengths]
        right.plot(lengths, peaks, marker="o", label=label)
    right.axhline(USABLE * GPU_BYTES / 1e9, color="gray", ls="--", label="72 GB (90% of 80 GB)")
    right.set_xscale("log", base=2)
    right.set_xticks(lengths, [f"{n // 1024}K" for n in lengths])
    right.set_xlabel("tokens (one sequence, CP 1)")
    right.set_ylabel("predicted peak, GB")
    right.set_title("Qwen2.5-0.5B on one GPU, bf16 (prediction)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def report(runs_path: Path, output: Path) -> dict:
    from hf_sparse_cp.env import environment

    runs = json.loads(runs_path.read_text())
    ok = [r for r in runs["runs"] if r["status"] == "ok"]
    rows = [validate(r) for r in sorted(ok, key=lambda r: (r["model"], r["seq_len"], bool(r.get("savers"))))]
    pred = gpu_predictions()
    result = {
        "benchmark": "memory_model", "date": datetime.now(UTC).isoformat(timespec="seconds"), **environment("cpu"),
        "command": " ".join(sys.argv),
        "measurement": {"metric": "VmHWM (peak resident set) per phase, reset with /proc/self/clear_refs, minus the "
                        "VmRSS after the imports; one fresh process per run", "malloc": runs["malloc"],
                        "pattern": runs["pattern"], "shapes": {m: SHAPES[m] for m in {r["model"] for r in ok}},
                        "dtype": "bfloat16 weights, activations and AdamW state", "tolerance": TOLERANCE},
        "validation": rows, "cuts": cuts(rows), "predictions": pred,
        "runs": runs["runs"],
    }
    output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {output}")
    print(format_validation(rows))
    for c in result["cuts"]:
        print(f"token tiles at {c['model']} {c['seq_len'] // 1024}K: measured peak falls by "
              f"{c['measured_fall_mib']:.0f} MiB, predicted {c['predicted_fall_mib']:.0f} MiB")
    print()
    print(format_predictions(pred))
    from hf_sparse_cp.testing.benchmarking import format_targets

    print(format_targets(pred["targets"]))
    plot(result, output.with_suffix(".png"))
    return result


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", choices=sorted(GRIDS), default="validation", help="Which runs to measure.")
    parser.add_argument("--model_type", nargs="+", choices=sorted(ARCHITECTURES),
                        help="Measure the grid's runs of these model types only (the validation's are qwen2).")
    parser.add_argument("--runs", help="Measured runs (resumed: configurations already measured there are kept); "
                        "default: results/memory-model_cpu_runs.json (the architectures grid: "
                        "memory-model-architectures_cpu_runs.json).")
    parser.add_argument("--output", help="Report JSON (+ .png); default: results/memory-model_cpu.json "
                        "(memory-model-architectures_cpu.json).")
    parser.add_argument("--report_only", action="store_true", help="Do not measure; report the runs file.")
    parser.add_argument("--timeout_s", type=int, default=7200, help="Wall-clock limit of one run.")
    parser.add_argument("--start_length", metavar="MODEL",
                        help="Print the GPU session's starting length for bench_e2e's MODEL (0.5b, 1.5b) on CUDA "
                        "device 0 (or --gpu_memory) and exit: `bench_e2e_start_length`.")
    parser.add_argument("--gpu_memory", default="auto", help="With --start_length: the GPU's memory, e.g. 80GB.")
    args = parser.parse_args(argv)
    if args.start_length:
        from hf_sparse_cp.simulator.memory_cli import parse_memory

        try:
            print(bench_e2e_start_length(args.start_length, parse_memory(args.gpu_memory)))
        except (KeyError, ValueError) as e:
            parser.error(str(e))
        return
    stem = "memory-model-architectures" if args.grid == "architectures" else "memory-model"
    runs = Path(args.runs or RESULTS_DIR / f"{stem}_cpu_runs.json")
    if not args.report_only:
        measure(args.grid, runs, args.timeout_s, args.model_type)
    report(runs, Path(args.output or RESULTS_DIR / f"{stem}_cpu.json"))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1:])
