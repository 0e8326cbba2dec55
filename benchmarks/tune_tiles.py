"""Tile tuning of the block-sparse attention kernels on a GPU: times candidate tiles per kernel.

The launchers take their tiles from `hf_sparse_cp.kernels.configs` (no autotuning at run time,
see there). This script measures which tiles to put there: for one sequence (bench_attention's
geometry: B = 1, 16 query heads, 2 key/value heads, head_dim 128, bf16, block 128) on a random
vertical-slash layout with about `--density` kept blocks, it launches every candidate `Tiles` of
one kernel through `configs.tiles_override`, the other kernels keeping their current tiles:

* forward: the time of the forward op;
* dq, dkdv: the time of the whole backward op (the other backward kernel fixed, so differences
  between candidates are this kernel's).

Kernels are tuned in the order given, each with the kernels before it launched with their chosen tiles,
so that the chosen tiles are a combination that was timed together. A kernel's chosen tiles are its fastest
candidate that computed the current tiles' result, where at least `MIN_GAIN` faster than the current tiles
(else none: the current tiles stay); the JSON's `chosen` holds them with the GPU, head_dim, layout block and
dtype they were measured on, the tile table that `$HF_SPARSE_CP_TILES` (`configs.TILES_ENV`) makes later
launches on that GPU and geometry use (benchmarks/gpu_session.sh quick: its later stages). The run itself
times the launchers' own tiles as the current ones, whatever that variable says.

dq candidates come in pairs: the columns' dk/dv inside the dq loop, or in a separate pass
(`Tiles.separate_columns`, column "sep"; "tma", "tm", "rl" and "ln": `Tiles.kv_descriptors`, `tile_major`,
`column_meta_reload`, `lean_index`). `--kernels columns` times the whole backward with the
columns' dk/dv from the key-major kernel (`kernels/column_bwd.py`, column "steps": query tiles per
program) against the launched path (the dq kernel's atomics, the "current" row, shown with the dq tiles).

Each candidate's result is compared with the current tiles' (relative RMS of out, or of dq, dk,
dv): tiles that compute something else (a NaN or inf included) are reported as "wrong" and never
picked. Candidates that fail to build (e.g. shared memory) are reported with their error. Prints one
table per kernel, fastest first, with the speed-up over the current tiles, and writes JSON to
benchmarks/results/.

    python benchmarks/tune_tiles.py
    python benchmarks/tune_tiles.py --kernels dkdv --seq_len 131072 --density 0.1

This is a GPU benchmark: without CUDA it refuses to run, except `--dry_run` (CPU, the kernels in Triton's
interpreter at the sizes given; benchmarks/gpu_session.sh quick --dry-run). The candidate grids, the ranking
and the table (`rank`, `format_table`) run anywhere. The candidates are `configs.tile_candidates`, or with
`--shortlist` the few of `configs.shortlist` (the quick GPU calls': `SHORTLIST`, `WIDE_HEAD_SHORTLIST` above head_dim
128).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch

from hf_sparse_cp.attention.call import AttentionCall
from hf_sparse_cp.attention.ops import attention_backward, attention_forward
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.env import environment
from hf_sparse_cp.kernels import configs
from hf_sparse_cp.kernels.configs import Tiles
from hf_sparse_cp.simulator.workloads import random_vertical_slash_layout
from hf_sparse_cp.testing.benchmarking import ReportFile, parse_gpu_benchmark_args, rel_rms, time_ms

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Largest relative RMS difference from the current tiles' result that still counts as the same
# function: only the fp32 accumulation order changes with the tiles.
SAME_RESULT_RTOL = 1e-3
# How much faster than the current tiles (a fraction of their time) a candidate must be to be chosen: the launched
# tiles stay on a tie within timing noise.
MIN_GAIN = 0.02


@dataclass
class TuneTilesArguments:
    seq_len: int = field(default=65536, metadata={"help": "Tokens of the one sequence."})
    density: float = field(default=0.05, metadata={"help": "Approximate kept-block fraction of the random layout."})
    num_verticals: int = field(default=1000, metadata={"help": "Random key columns per head."})
    kernels: list[str] = field(default_factory=lambda: list(configs.KERNELS),
                               metadata={"help": "Kernels to tune, from "
                                         f"{configs.KERNELS + configs.OPTIONAL_KERNELS}."})
    num_q_heads: int = field(default=16, metadata={"help": "Query heads."})
    num_kv_heads: int = field(default=2, metadata={"help": "Key/value heads."})
    head_dim: int = field(default=128, metadata={"help": "Head dimension."})
    block_size: int = field(default=128, metadata={"help": "Layout block size."})
    warmup: int = field(default=2, metadata={"help": "Untimed runs per candidate (the first compiles it)."})
    repeats: int = field(default=10, metadata={"help": "Timed runs per candidate; the median is reported."})
    seed: int = field(default=0, metadata={"help": "Seed of the layout and inputs."})
    shortlist: bool = field(
        default=False,
        metadata={"help": "Time only the few candidates of `configs.shortlist` (a short GPU call; their own above "
                  "head_dim 128) instead of every candidate of configs.tile_candidates."},
    )
    dry_run: bool = field(
        default=False,
        metadata={"help": "Run on the CPU (sizes from the command line; the kernels in Triton's interpreter, which "
                  "needs TRITON_INTERPRET=1; tiles capped at the layout block): checks the script, measures nothing "
                  "of the GPU."},
    )
    output: str | None = field(default=None, metadata={"help": "JSON path; default benchmarks/results/."})

    def __post_init__(self) -> None:
        unknown = set(self.kernels) - set(configs.KERNELS + configs.OPTIONAL_KERNELS)
        if unknown:
            raise ValueError(f"unknown kernels {sorted(unknown)}; use {configs.KERNELS + configs.OPTIONAL_KERNELS}.")
        if not 0 < self.density <= 1:
            raise ValueError(f"density must be in (0, 1]; got {self.density}.")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError("num_q_heads must be a multiple of num_kv_heads.")


def same_result(err: float) -> bool:
    """Whether a candidate whose result is `err` (relative RMS) from the current tiles' computes the same: finite
    and within SAME_RESULT_RTOL. A NaN or inf in either result makes `err` NaN or inf; a NaN compares false with
    any bound, so a bare `err > bound` would let it through."""
    return math.isfinite(err) and err <= SAME_RESULT_RTOL


def current_tiles(kernel: str, block_size: int, head_dim: int, on_gpu: bool = True) -> Tiles:
    """The launched tiles of `kernel`; for "columns", whose work the dq kernel does today, the dq tiles."""
    pick = {"forward": configs.forward_tiles, "dq": configs.dq_tiles, "dkdv": configs.dkdv_tiles,
            "columns": configs.dq_tiles}[kernel]
    return pick(block_size, head_dim, on_gpu)


def rank(rows: list[dict]) -> list[dict]:
    """One kernel's rows, fastest correct candidate first, then the wrong and failed ones."""
    ok = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["ms"])
    return ok + [r for r in rows if r["status"] != "ok"]


def choose(rows: list[dict], min_gain: float = MIN_GAIN) -> dict | None:
    """The row of one kernel whose tiles to launch instead of the current ones: the fastest candidate that computed
    the current tiles' result, when the current tiles were timed too and it took at most (1 - min_gain) of their
    time; else None."""
    current = next((r for r in rows if r["current"] and r["status"] == "ok"), None)
    best = rank(rows)[0] if rows else None
    if current is None or best is None or best["status"] != "ok" or best["current"]:
        return None
    return best if best["ms"] <= (1 - min_gain) * current["ms"] else None


def format_table(kernel: str, rows: list[dict]) -> str:
    header = (f"{kernel:<7} {'m':>4} {'n':>4} {'c':>3} {'warps':>5} {'stages':>6} {'sep':>3} {'tma':>3} {'tm':>3} "
              f"{'rl':>3} {'ln':>3} {'steps':>5} {'ms':>9} {'x current':>9}  note")
    lines = [header, "-" * len(header)]
    base = next((r["ms"] for r in rows if r["current"] and r["status"] == "ok"), None)
    for r in rank(rows):
        t = r["tiles"]
        cells = (f"{'':<7} {t['block_m']:>4} {t['block_n']:>4} {t['block_c']:>3} {t['num_warps']:>5} "
                 f"{t['num_stages']:>6} {'yes' if t['separate_columns'] else '':>3} "
                 f"{'yes' if t.get('kv_descriptors') else '':>3} {'yes' if t.get('tile_major') else '':>3} "
                 f"{'yes' if t.get('column_meta_reload') else '':>3} {'yes' if t.get('lean_index') else '':>3} "
                 f"{t.get('query_steps', 1) if kernel == 'columns' and not r['current'] else '':>5}")
        if r["status"] == "ok":
            speedup = f"{base / r['ms']:9.2f}" if base else " " * 9
            note = ("current" + (" (the dq kernel's atomics)" if kernel in configs.OPTIONAL_KERNELS else "")
                    if r["current"] else "")
            lines.append(f"{cells} {r['ms']:9.3f} {speedup}  {note}".rstrip())
        else:
            lines.append(f"{cells} {'':9} {'':9}  {r['status']}: {r.get('reason', '')}"[:160])
    return "\n".join(lines)


class Tuner:
    """The timing runs. `device` is "cuda" for measurements; on "cpu" (tests) the kernels need
    Triton's interpreter and times are wall-clock."""

    def __init__(self, args: TuneTilesArguments, device: str = "cuda"):
        self.args = args
        self.device = device
        a = args
        g = torch.Generator().manual_seed(a.seed)
        nb = -(-a.seq_len // a.block_size)
        # a random diagonal holds about nb/2 of the nb(nb+1)/2 causal blocks: density * nb of them
        diagonals = max(1, round(a.density * nb))
        self.meta = TokenMeta.contiguous(1, a.seq_len, device)
        self.layout = random_vertical_slash_layout(1, a.num_q_heads, a.seq_len, a.block_size,
                                                   num_diagonals=diagonals - 1, num_verticals=a.num_verticals,
                                                   generator=g).to(device)
        gd = torch.Generator(device=device).manual_seed(a.seed)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter has no bf16 products
        make = lambda h: torch.randn(1, h, a.seq_len, a.head_dim, generator=gd, device=device).to(dtype)
        self.q, self.k, self.v = make(a.num_q_heads), make(a.num_kv_heads), make(a.num_kv_heads)
        self.dout = make(a.num_q_heads)
        self.scale = a.head_dim**-0.5
        self.dtype = dtype
        self.rows: list[dict] = []
        # kernel -> the tiles chosen for it (`choose`), launched while the kernels after it are tuned
        self.chosen: dict[str, Tiles] = {}

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return attention_forward(AttentionCall(self.q, self.k, self.v, self.layout, self.scale, self.meta, self.meta),
                                 implementation="triton")

    def backward(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return attention_backward(AttentionCall(self.q, self.k, self.v, self.layout, self.scale, self.meta, self.meta),
                                  out, lse, self.dout, implementation="triton")

    def run_kernel(self, kernel: str, tiles_list: list[Tiles] | None = None,
                   after_each: Callable[[], None] | None = None) -> list[dict]:
        """Time `tiles_list` (default: `configs.tile_candidates`) for `kernel`, the kernels tuned before it with their
        chosen tiles; returns and keeps the rows, and chooses (`choose`). `after_each` is called after every
        candidate (main rewrites the JSON there)."""
        a = self.args
        with configs.tiles_override(**self.chosen):
            out, lse = self.forward()
        out = out.to(self.q.dtype)
        step = self.forward if kernel == "forward" else (lambda: self.backward(out, lse))
        # what the step computes, as one vector (out, or dq, dk, dv), compared outside the timing
        result = lambda: torch.cat([t.flatten() for t in step()[: 1 if kernel == "forward" else 3]])
        with configs.tiles_override(**self.chosen):
            reference = result()
        now = current_tiles(kernel, a.block_size, a.head_dim, self.device == "cuda")
        rows = []
        candidates = tiles_list or (configs.shortlist(kernel, a.head_dim) if a.shortlist else
                                    configs.tile_candidates(kernel, a.block_size, a.head_dim))
        if kernel in configs.OPTIONAL_KERNELS:  # timed against the launched path: no override (None)
            candidates = [None, *candidates]
        for i, tiles in enumerate(candidates, 1):
            row = {"kernel": kernel, "tiles": dataclasses.asdict(tiles or now), "current": tiles in (None, now)}
            try:
                with configs.tiles_override(**self.chosen, **({kernel: tiles} if tiles else {})):
                    start = time.perf_counter()
                    got = result()
                    checked_ms = 1e3 * (time.perf_counter() - start)
                    err = rel_rms(got, reference)
                    if not same_result(err):
                        row.update(status="wrong", reason=f"rel. RMS {err:.2e} from the current tiles' result")
                    else:
                        # a dry run (off CUDA, no warm-up, one repeat): the checked call is the timed one
                        once = self.device != "cuda" and a.warmup == 0 and a.repeats == 1
                        row.update(status="ok", rel_rms=err,
                                   ms=checked_ms if once else time_ms(step, a.warmup, a.repeats, self.device))
            except Exception as e:  # a candidate that does not build is data, not the end of the run
                row.update(status="error", reason=f"{type(e).__name__}: {e}".splitlines()[0][:300])
            if self.device == "cuda":
                torch.cuda.empty_cache()
            shown = f"{row['ms']:.3f} ms" if row["status"] == "ok" else row["reason"]
            print(f"[{kernel} {i}/{len(candidates)} {tiles or 'launched'}] {row['status']}: {shown}", flush=True)
            rows.append(row)
            self.rows.append(row)
            if after_each is not None:
                after_each()
        if (pick := choose(rows)) is not None:
            self.chosen[kernel] = Tiles(**pick["tiles"])
        return rows


def build_report(tuner: Tuner, env: dict, complete: bool) -> dict:
    """The JSON of the run so far; `complete` is false while candidates remain."""
    a = tuner.args
    tuned = [k for k in a.kernels if any(r["kernel"] == k for r in tuner.rows)]
    return {
        "benchmark": "tune_tiles",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "complete": complete,
        **env,
        "settings": {**dataclasses.asdict(a), "kept_fraction": float(tuner.layout.kept_fraction())},
        "results": tuner.rows,
        "best": {k: rank([r for r in tuner.rows if r["kernel"] == k])[0] for k in tuned},
        # the tile table (configs.TILES_ENV): the kernels whose chosen tiles beat the launched ones, so far
        "chosen": {"applies_to": {"device": env.get("device"), "head_dim": a.head_dim, "block_size": a.block_size,
                                  "dtype": str(tuner.dtype).removeprefix("torch.")},
                   "min_gain": MIN_GAIN, "tiles": {k: dataclasses.asdict(t) for k, t in tuner.chosen.items()}},
    }


def main(argv: list[str]) -> dict:
    args = parse_gpu_benchmark_args(TuneTilesArguments, argv, "tune_tiles.py")
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("tune_tiles.py --dry_run runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1.")
    device = "cpu" if args.dry_run else "cuda"
    os.environ.pop(configs.TILES_ENV, None)  # the current tiles are the launchers' own, never an earlier table's
    tuner = Tuner(args, device)
    env = environment(torch.device(device))
    out = ReportFile(RESULTS_DIR, "tiles", args.output)
    save = lambda: out.write(build_report(tuner, env, complete=False))
    tables = [format_table(kernel, tuner.run_kernel(kernel, after_each=save)) for kernel in args.kernels]
    report = build_report(tuner, env, complete=True)
    print(f"\n{env['device']}, torch {env['torch']}, triton {env['triton']}; S={args.seq_len}, kept fraction "
          f"{report['settings']['kept_fraction']:.3f}")
    for table in tables:
        print()
        print(table)
    chosen = report["chosen"]["tiles"] or "none: the launched tiles stay"
    print(f"\nchosen (the tile table, ${configs.TILES_ENV}): {chosen}")
    out.write(report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
