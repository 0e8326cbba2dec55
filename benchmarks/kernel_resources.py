"""What the kernels use on Hopper with the launchers' tiles, read from sm_90 builds made without a GPU.

For head_dim 64 and 128 (bf16, layout block 128), every kernel variant a GPU run launches is
compiled for sm_90 with the installed Triton (`hf_sparse_cp.kernels.sm90`): registers and stack
bytes per thread (a stack frame holds spilled registers), shared memory per program, and the
count of wgmma / mma.sync instructions in its PTX. Prints a table and writes JSON to
benchmarks/results/. Runs on any machine; nothing here is a GPU timing.

`--candidates` builds instead every tile candidate of the tuned kernels (`configs.tile_candidates`
at 4 and 8 warps; dq with column gradients, its heaviest variant), the evidence behind which
candidates `benchmarks/tune_tiles.py` times.

    python benchmarks/kernel_resources.py
    python benchmarks/kernel_resources.py --candidates --head_dims 128
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

from hf_sparse_cp.env import environment
from hf_sparse_cp.kernels import configs, sm90
from hf_sparse_cp.testing.benchmarking import write_report

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def measure(head_dims=(64, 128), dtype: str = "bf16") -> list[dict]:
    rows = []
    for head_dim in head_dims:
        for name, (tiles, build) in sm90.launcher_builds(head_dim, dtype).items():
            rows.append({"kernel": name, "head_dim": head_dim, "dtype": dtype, "tiles": dataclasses.asdict(tiles),
                         **dataclasses.asdict(sm90.usage(build))})
    return rows


# The variant built for each tuned kernel's candidates.
CANDIDATE_VARIANTS = {"forward": "forward", "dq": "dq_column_grads", "dkdv": "dkdv"}


def measure_candidates(head_dims=(128,), dtype: str = "bf16", block_size: int = 128) -> list[dict]:
    """Every tile candidate of the tuned kernels at 4 and 8 warps; a build that fails is a row with
    its error."""
    rows = []
    for head_dim in head_dims:
        for kernel, variant in CANDIDATE_VARIANTS.items():
            for tiles in configs.tile_candidates(kernel, block_size, head_dim, warps=(4, 8)):
                row = {"kernel": variant, "head_dim": head_dim, "dtype": dtype, "tiles": dataclasses.asdict(tiles)}
                try:
                    row.update(dataclasses.asdict(sm90.usage(sm90.build(variant, tiles, head_dim, dtype,
                                                                        block_size))))
                except Exception as e:  # a tile shape the compiler rejects is a finding, not the end of the sweep
                    row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
                print(f"[{variant} d={head_dim} {tiles}] {row.get('error') or row['stack_bytes']} stack B",
                      flush=True)
                rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    header = (f"{'kernel':<18} {'d':>4} {'m':>4} {'n':>4} {'c':>3} {'warps':>5} {'stages':>6} {'regs':>5} "
              f"{'stack B':>7} {'shared KB':>9} {'wgmma':>6} {'mma':>4}  note")
    lines = [header, "-" * len(header)]
    for r in rows:
        t = r["tiles"]
        cells = (f"{r['kernel']:<18} {r['head_dim']:>4} {t['block_m']:>4} {t['block_n']:>4} {t['block_c']:>3} "
                 f"{t['num_warps']:>5} {t['num_stages']:>6}")
        if "error" in r:
            lines.append(f"{cells}  {r['error']}"[:160])
            continue
        lines.append(f"{cells} {r['registers']:>5} {r['stack_bytes']:>7} {r['shared_bytes'] / 1024:9.1f} "
                     f"{r['wgmma']:>6} {r['mma_sync']:>4}  "
                     f"{'separate column pass' if t.get('separate_columns') else ''}".rstrip())
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--candidates", action="store_true",
                   help="Build every tile candidate of the tuned kernels instead of the launchers' tiles.")
    p.add_argument("--head_dims", type=int, nargs="+", default=[64, 128], help="Head dims to build for.")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="Input dtype of the builds.")
    p.add_argument("--output", default=None, help="JSON path; default benchmarks/results/.")
    return p.parse_args(argv)


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    rows = (measure_candidates if args.candidates else measure)(args.head_dims, args.dtype)
    env = environment(torch.device("cpu"))
    kind = "kernel-candidates" if args.candidates else "kernel-resources"
    report = {"benchmark": kind.replace("-", "_"), "date": datetime.now(UTC).isoformat(timespec="seconds"), **env,
              "target": "sm_90 (ahead-of-time build, no GPU)", "rows": rows}
    print(f"sm_90 builds with triton {env['triton']} (no GPU; registers and stack per thread)")
    print(format_table(rows))
    write_report(report, RESULTS_DIR, f"{kind}_triton-{env['triton']}", args.output)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
