"""How far does it scale? Predicted training-step time of context parallelism on a GPU cluster,
written to benchmarks/results/ (the same code as `hf-sparse-cp simulate`: `hf_sparse_cp.simulator.simulate_cli`).

    python benchmarks/simulate_cluster.py                        # Qwen2.5-3B on 8xH100 nodes + MTraining's setting
    python benchmarks/simulate_cluster.py --model qwen2.5-7b --cluster 8xA100-IB200 --seq 262144 --cp 8 16
    python benchmarks/simulate_cluster.py --mix long-tail --seq 524288 --cp 8 16 32   # packed rows
"""

from __future__ import annotations

import sys
from pathlib import Path

from hf_sparse_cp.simulator.simulate_cli import main as simulate

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> dict:
    """The full table (`--all`: every configuration, the block-only bounds, MTraining's setting unless
    --no-mtraining) into benchmarks/results/."""
    return simulate(["--all", *(sys.argv[1:] if argv is None else argv)], results=RESULTS)


if __name__ == "__main__":
    main()
