"""What the kernels use on Hopper, read from sm_90 builds made without a GPU, with the arguments of
real launches (divisibility hints included; `hf_sparse_cp.testing.sm90`).

For head_dim 64 and 128 (bf16, layout block 128, 16 query / 2 key-value heads at 128K tokens),
every kernel variant a GPU run launches is compiled for sm_90 with the installed Triton, with the
launchers' tiles and, beside them, with the tiles they launched before the hinted builds
(`PREVIOUS_TILES`): registers and stack bytes per thread (a stack frame holds spilled registers),
shared memory per program, wgmma instructions by shape, mma.sync count, hinted arguments and
16-byte loads. Prints a side-by-side table and writes JSON to benchmarks/results/. Runs on any
machine; nothing here is a GPU timing.

`--shortlist` builds the quick GPU calls' candidates (`configs.shortlist`, what `tune_tiles.py
--shortlist` times; their own above head_dim 128). `--candidates` builds instead every tile candidate of
the tuned kernels (`configs.tile_candidates` at 4 and 8 warps; dq with column gradients, its heaviest
variant; the key-major column kernel), the evidence behind which candidates `benchmarks/tune_tiles.py`
times; `--warps_stages` builds only the launchers' tile shapes at 4 and 8 warps and 2 to 4 pipeline
stages (a short sweep behind the warps and stages in `configs`).

    python benchmarks/kernel_resources.py
    python benchmarks/kernel_resources.py --candidates --head_dims 128
    python benchmarks/kernel_resources.py --warps_stages
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

from hf_sparse_cp.kernels import configs
from hf_sparse_cp.kernels.configs import Tiles
from hf_sparse_cp.testing import sm90
from hf_sparse_cp.testing.benchmarking import write_report

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# The tiles the launchers used before builds carried the launches' divisibility hints (issue #18),
# by head_dim and tuned kernel, kept to show what the hinted builds changed.
PREVIOUS_TILES = {
    64: {"forward": Tiles(128, 128, 64, 8, 3), "dq": Tiles(128, 64, 64, 8, 3), "dkdv": Tiles(64, 128, 0, 8, 3)},
    128: {"forward": Tiles(128, 64, 64, 8, 3), "dq": Tiles(128, 64, 64, 8, 3, separate_columns=True),
          "dkdv": Tiles(32, 64, 0, 8, 3)},
}


def _row(name: str, head_dim: int, dtype: str, tiles: Tiles, build) -> dict:
    return {"kernel": name, "head_dim": head_dim, "dtype": dtype, "tiles": dataclasses.asdict(tiles),
            **dataclasses.asdict(sm90.usage(build))}


def measure(head_dims=(64, 128), dtype: str = "bf16") -> list[dict]:
    """One row per launched variant with the launchers' tiles; for the tuned kernels a "previous"
    entry holds the same variant built with `PREVIOUS_TILES` (absent where the tiles are unchanged)."""
    rows = []
    for head_dim in head_dims:
        launch = sm90.launch_for(head_dim, dtype)
        for name, (tiles, build) in sm90.launcher_builds(head_dim, dtype).items():
            row = _row(name, head_dim, dtype, tiles, build)
            before = PREVIOUS_TILES.get(head_dim, {}).get(sm90.TUNED_KERNEL.get(name))
            if before is not None and before != tiles:
                row["previous"] = _row(name, head_dim, dtype, *sm90.build(name, before, launch))
            rows.append(row)
    return rows


# The variant built for each tuned kernel's candidates (and the key-major column kernel's, launched only under
# its override).
CANDIDATE_VARIANTS = {"forward": "forward", "dq": "dq_column_grads", "dkdv": "dkdv", "columns": "columns"}
LAUNCHED_TILES = {"forward": configs.forward_tiles, "dq": configs.dq_tiles, "dkdv": configs.dkdv_tiles}


def warps_stages_candidates(kernel: str, block_size: int, head_dim: int) -> list[Tiles]:
    """The launchers' tile shape of `kernel` at 4 and 8 warps and 2, 3 and 4 pipeline stages."""
    launched = LAUNCHED_TILES[kernel](block_size, head_dim, True)
    return [dataclasses.replace(launched, num_warps=w, num_stages=st) for w in (4, 8) for st in (2, 3, 4)]


# The variants built for each kernel's short list: dq also without column gradients, as it is launched when the
# key-major column kernel (a short-list candidate too) takes the columns' dk/dv.
SHORTLIST_VARIANTS = {"forward": ("forward",), "dq": ("dq_column_grads", "dq"), "dkdv": ("dkdv",),
                      "columns": ("columns",)}


def measure_candidates(head_dims=(128,), dtype: str = "bf16", warps_stages_only: bool = False,
                       shortlist: bool = False) -> list[dict]:
    """Every tile candidate of the tuned kernels at 4 and 8 warps (or, with `warps_stages_only`, the
    launchers' tile shapes at 4 and 8 warps and 2-4 stages; with `shortlist`, the quick GPU call's candidates,
    `configs.shortlist`, dq with and without column gradients), each row saying whether it is the one launched;
    a build that fails is a row with its error."""
    rows = []
    for head_dim in head_dims:
        launch = sm90.launch_for(head_dim, dtype)
        block_size = launch.block_size
        for kernel, variant in CANDIDATE_VARIANTS.items():
            launched = LAUNCHED_TILES[kernel](block_size, head_dim, True) if kernel in LAUNCHED_TILES else None
            if warps_stages_only:
                candidates = warps_stages_candidates(kernel, block_size, head_dim) if launched else []
            elif shortlist:
                candidates = configs.shortlist(kernel, head_dim)
            else:
                candidates = configs.tile_candidates(kernel, block_size, head_dim, warps=(4, 8))
            variants = SHORTLIST_VARIANTS[kernel] if shortlist else (variant,)
            for tiles, name in itertools.product(candidates, variants):
                row = {"kernel": name, "head_dim": head_dim, "dtype": dtype, "tiles": dataclasses.asdict(tiles),
                       "launched": tiles == launched}
                try:
                    row.update(dataclasses.asdict(sm90.usage(sm90.build(name, tiles, launch)[1])))
                except Exception as e:  # a tile shape the compiler rejects is a finding, not the end of the sweep
                    row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
                print(f"[{name} d={head_dim} {tiles}] {row.get('error') or row['stack_bytes']} stack B",
                      flush=True)
                rows.append(row)
    return rows


def _cells(r: dict | None) -> str:
    """Tiles and usage of one build: 'm x n /c warps stages regs stack shared wgmma-shapes'."""
    if r is None:
        return f"{'(unchanged)':<52}"
    t = r["tiles"]
    tiles = (f"{t['block_m']}x{t['block_n']}/{t['block_c']}{'s' if t.get('separate_columns') else ''}"
             f"{'T' if t.get('kv_descriptors') else ''}{'M' if t.get('tile_major') else ''}"
             f"{'R' if t.get('column_meta_reload') else ''}{'L' if t.get('lean_index') else ''}"
             f"{'*' if r.get('launched') else ''}")
    if "error" in r:
        return f"{tiles:<12} {r['error']}"[:52].ljust(52)
    shapes = " ".join(f"{s.split('k')[0]}:{n}" for s, n in r["wgmma_shapes"].items())
    return (f"{tiles:<12} {t['num_warps']}w{t['num_stages']}s {r['registers']:>4} {r['stack_bytes']:>5} "
            f"{r['shared_bytes'] / 1024:6.1f} {shapes}").ljust(52)[:70]


def format_table(rows: list[dict]) -> str:
    """One line per build: kernel, head_dim, then tiles (m x n / column step, 's' for a separate
    column pass, 'T' for TMA key blocks, 'M' for the tile-major grid, '*' for the tiles launched, in a
    sweep), warps and stages, registers, stack bytes, shared KB and wgmma shapes; with `previous` entries,
    the tiles launched before beside the current ones."""
    side = any("previous" in r for r in rows)
    cols = "tiles        warps regs stack shared wgmma m64nN:count"
    header = f"{'kernel':<18} {'d':>4}  " + (f"{'previous: ' + cols:<52}  current: {cols}" if side else cols)
    lines = [header, "-" * len(header)]
    for r in rows:
        prefix = f"{r['kernel']:<18} {r['head_dim']:>4}  "
        lines.append(prefix + (f"{_cells(r.get('previous'))}  {_cells(r)}" if side else _cells(r)).rstrip())
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--candidates", action="store_true",
                   help="Build every tile candidate of the tuned kernels instead of the launchers' tiles.")
    p.add_argument("--warps_stages", action="store_true",
                   help="Build the launchers' tile shapes at 4 and 8 warps and 2-4 pipeline stages.")
    p.add_argument("--shortlist", action="store_true",
                   help="Build the quick GPU calls' candidates (configs.shortlist; dq with and without column "
                   "gradients).")
    p.add_argument("--head_dims", type=int, nargs="+", default=[64, 128], help="Head dims to build for.")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="Input dtype of the builds.")
    p.add_argument("--output", default=None, help="JSON path; default benchmarks/results/.")
    return p.parse_args(argv)


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    if args.candidates or args.warps_stages or args.shortlist:
        rows = measure_candidates(args.head_dims, args.dtype, warps_stages_only=args.warps_stages,
                                  shortlist=args.shortlist)
    else:
        rows = measure(args.head_dims, args.dtype)
    kind = ("kernel-warps-stages" if args.warps_stages else "kernel-candidates" if args.candidates
            else "kernel-shortlist" if args.shortlist else "kernel-resources")
    report = sm90.build_report(
        kind.replace("-", "_"), rows,
        launch={k: v for k, v in dataclasses.asdict(sm90.Launch()).items() if k not in ("head_dim", "dtype")},
        hinted="arguments specialized as the JIT does at a launch (tt.divisibility=16, ints equal to 1)")
    print(f"sm_90 builds with triton {report['triton']} (no GPU; registers and stack per thread, shared KB per "
          "program)")
    print(format_table(rows))
    write_report(report, RESULTS_DIR, f"{kind}_triton-{report['triton']}", args.output)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
