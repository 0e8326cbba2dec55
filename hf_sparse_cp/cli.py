"""`hf-sparse-cp` command line: `train` runs the long-context example, `env` reports the setup."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

EXAMPLE_MODULE = "hf_sparse_cp.examples.train_long_context"


def _env() -> int:
    from hf_sparse_cp.env import PACKAGES, environment

    rows = {name: ("not installed" if name in PACKAGES else "-") if value is None else value
            for name, value in environment().items()}
    width = max(map(len, rows))
    for key, value in rows.items():
        print(f"{key:<{width}}  {value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="hf-sparse-cp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="Run the long-context Trainer example (tiny model, passkey data); extra flags go to the script.",
        add_help=False,
    )
    train.add_argument("--nproc", type=int, default=1,
                       help="Local processes to launch (torchrun; gloo on CPU), e.g. --nproc 2 --cp_size 2.")
    sub.add_parser("env", help="Print the versions and devices the plugin sees.")
    args, rest = parser.parse_known_args(argv)
    if args.command == "env":
        return _env()
    if args.nproc < 1:
        parser.error(f"--nproc {args.nproc}: give at least 1 process.")
    from hf_sparse_cp.backends import is_available

    if not is_available("datasets"):
        parser.error("`hf-sparse-cp train` makes its demo data with `datasets`: pip install 'hf-sparse-cp[demo]'.")
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
        return subprocess.run([*launcher, "-m", EXAMPLE_MODULE, *rest], check=False).returncode
    from hf_sparse_cp.examples.train_long_context import main as train_main

    train_main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
