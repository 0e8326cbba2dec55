"""`hf-sparse-cp` command line: `train` runs the long-context example, `env` reports the setup."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys

EXAMPLE_MODULE = "hf_sparse_cp.examples.train_long_context"


def _env() -> int:
    import torch
    import transformers

    import hf_sparse_cp

    rows = {
        "hf-sparse-cp": hf_sparse_cp.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else "not available",
    }
    for name in ("accelerate", "peft", "datasets", "triton", "liger_kernel", "flash_attn"):
        try:
            module = __import__(name)
            rows[name] = getattr(module, "__version__", "installed")
        except ImportError:
            rows[name] = "not installed"
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
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
        return subprocess.run([*launcher, "-m", EXAMPLE_MODULE, *rest], check=False).returncode
    from hf_sparse_cp.examples.train_long_context import main as train_main

    train_main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
