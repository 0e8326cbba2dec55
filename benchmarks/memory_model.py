"""Peak memory of one training step, measured on this CPU, against `hf_sparse_cp.memory`'s prediction.

Measurement: every (model, variant, S) runs in a fresh subprocess, so nothing a previous run freed
but kept (allocator arenas, fragments) raises its peak. The process's resident set is read from
/proc/self/status: `VmRSS` after the imports (the runtime's baseline), and `VmHWM`, the high-water
mark, reset at each phase of the step (`/proc/self/clear_refs` <- 5) so that forward (which
includes the lean loss), backward and the optimizer step each get their own peak. glibc's malloc
runs with a fixed mmap threshold of 64 KiB (`GLIBC_TUNABLES`): every tensor buffer above it is
mapped on allocation and returned to the kernel on free, so the resident set follows the live
tensors (the dynamic threshold glibc uses by default would put buffers below 32 MiB on its heap,
where freed memory stays resident).

The step is the one the plugin trains with: a Qwen2-architecture model in bf16 (AdamW state in
bf16 too), gradient checkpointing (non-reentrant), the `sparse_cp` backend with a sparse pattern
from the first layer on (CPU: the PyTorch reference), the lean loss (chunked PyTorch), one
sequence of S tokens. A warm-up step of `--warmup_len` tokens creates the optimizer state first.

Prediction: `hf_sparse_cp.memory.predict_step_memory` for the same shape, length, settings and
implementation ('reference'); the measured peak minus the baseline is compared with the predicted
tensor bytes, per phase. Each run's terms are in the JSON.

    python benchmarks/memory_model.py                    # the validation grid (about an hour on 2 cores)
    python benchmarks/memory_model.py --grid quick       # tiny model only (minutes)
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
# The pattern of every measured run: sparse from the first layer on and from 1K tokens, budgets small enough
# that the reference attention stays cheap on a CPU at 64K.
PATTERN = dict(block_size=128, min_seq_len=1024, dense_first_layers=0, vertical_topk=64, slash_topk=4,
               sink_tokens=64, local_window=128, last_q=64)


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE).group(1))


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def run_one(spec: dict) -> dict:
    """Build the model of `spec`, run the warm-up and the measured step, return the measurements."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig, configure

    baseline = _status_kib("VmRSS") * 1024
    seq_len = spec["seq_len"]
    hf_sparse_cp.patch()
    hf_sparse_cp.enable_lean_loss()
    config = Qwen2Config(**SHAPES[spec["model"]], max_position_embeddings=max(32768, seq_len),
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, attention_dropout=0.0, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sparse_cp", dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    configure(model, SparseAttentionConfig(**PATTERN))
    savers = spec.get("savers", {})
    if savers:
        from hf_sparse_cp.memory import MemorySavers, enable_memory_savers

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
            phases["forward"] = {"peak": _status_kib("VmHWM") * 1024, "after": _status_kib("VmRSS") * 1024,
                                 "s": time.perf_counter() - mark}
            mark = time.perf_counter()
            _reset_peak()
        loss.backward()
        if phases is not None:
            phases["backward"] = {"peak": _status_kib("VmHWM") * 1024, "after": _status_kib("VmRSS") * 1024,
                                  "s": time.perf_counter() - mark}
            mark = time.perf_counter()
            _reset_peak()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if phases is not None:
            phases["optimizer"] = {"peak": _status_kib("VmHWM") * 1024, "after": _status_kib("VmRSS") * 1024,
                                   "s": time.perf_counter() - mark}
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
    # (model, S, savers): the stock step, then the memory savers.
    "stock": [("tiny", 4096, {}), ("tiny", 16384, {}), ("tiny", 65536, {}),
              ("0.5b-2l", 4096, {}), ("0.5b-2l", 8192, {}),
              ("0.5b-2l-v8k", 16384, {}), ("0.5b-4l-v8k", 16384, {}), ("0.5b-2l-v8k", 32768, {})],
}


def measure(grid: str, output: Path, timeout_s: int) -> list[dict]:
    """Run every configuration of `grid` in its own process, rewriting `output` after each."""
    results = json.loads(output.read_text())["runs"] if output.exists() else []
    done = {(r["model"], r["seq_len"], json.dumps(r.get("savers", {}), sort_keys=True)) for r in results
            if r["status"] == "ok"}
    for model, seq_len, savers in GRIDS[grid]:
        if (model, seq_len, json.dumps(savers, sort_keys=True)) in done:
            continue
        spec = {"model": model, "seq_len": seq_len, "warmup_len": 256, "savers": savers}
        start = time.time()
        r = run_in_subprocess(spec, timeout_s)
        r["wall_s"] = time.time() - start
        results = [x for x in results if (x["model"], x["seq_len"], x.get("savers")) != (model, seq_len, savers)]
        results.append(r)
        output.write_text(json.dumps({"grid": grid, "runs": results}, indent=1) + "\n")
        peak = max(p["peak"] for p in r["phases"].values()) if r["status"] == "ok" else None
        print(f"[{model} S={seq_len} {savers or 'stock'}] {r['status']}"
              + (f": peak {peak / 2**30:.2f} GiB, {r['wall_s']:.0f} s" if peak else f": {r.get('reason')}"), flush=True)
    return results


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2], sys.argv[3])
    else:
        measure(sys.argv[1], Path(sys.argv[2]), 7200)
