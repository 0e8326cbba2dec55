"""The install without Triton (macOS, Windows, a CPU-only torch: issue #52): with Triton hidden from imports as
when it is not installed (`HF_SPARSE_CP_TEST_HIDE=triton`), the demo trains sparse; `make test` also runs the unit
tier so (`make test-no-triton`)."""

import os
import subprocess
import sys

from hf_sparse_cp.testing.hidden import HIDE_ENV

DEMO = """
import sys
from hf_sparse_cp.testing.hidden import hide_from_environment
hide_from_environment()
from hf_sparse_cp.cli import main
code = main(sys.argv[1:])
assert sys.modules.get("triton") is None, "triton was imported"
sys.exit(code)
"""


def test_the_demo_trains_sparse_without_triton(tmp_path):
    flags = ["train", "--max_steps", "2", "--sparse_max_length", "1024", "--num_samples", "2", "--tiny_num_layers", "1",
             "--output_dir", str(tmp_path / "out")]
    done = subprocess.run([sys.executable, "-c", DEMO, *flags], capture_output=True, text=True, timeout=900,
                          env={**os.environ, HIDE_ENV: "triton", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("done: 2 steps at 1024 tokens"))
    assert float(line.split("mean kept fraction ")[1].split()[0]) < 1.0  # the sparse path ran
