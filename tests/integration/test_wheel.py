"""The wheel carries what the README points to (issue #30): built from the repository and installed into a
fresh virtual environment (its dependencies are this environment's: nothing is downloaded), it holds the
recipes and the LICENSE, lists the recipes, and runs one for a tiny step from the installed package."""

import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*command, cwd: Path, timeout: int = 300) -> str:
    done = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the wheel, the fresh environment's python) with the wheel installed, outside the repository."""
    tmp = tmp_path_factory.mktemp("wheel")
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist", ROOT,
         cwd=tmp)
    (wheel,) = (tmp / "dist").glob("hf_sparse_cp-*.whl")
    env = tmp / "env"
    _run(sys.executable, "-m", "venv", "--without-pip", env, cwd=tmp)
    python = env / "bin" / "python"
    # the dependencies (torch, transformers, ...) come from this environment's site-packages, read as plain paths:
    # their .pth files, this repository's editable install among them, are not run there
    purelib = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp).strip()
    Path(purelib, "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q", wheel, cwd=tmp)
    return wheel, python, tmp


def test_the_wheel_holds_the_recipes_and_the_license(installed):
    wheel, _, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {p.relative_to(ROOT).as_posix() for p in (ROOT / "recipes").rglob("*.yaml")}
    assert {f"hf_sparse_cp/{name}" for name in shipped} <= set(names)
    assert "hf_sparse_cp/simulator/data/default_kept_curve.json" in names  # the shipped kept-fraction curve
    (license_file,) = [name for name in names if name.endswith(".dist-info/licenses/LICENSE")]
    text = zipfile.ZipFile(wheel).read(license_file).decode()
    assert text == (ROOT / "LICENSE").read_text() and "Apache License" in text and "Version 2.0" in text


def test_the_installed_package_lists_and_runs_a_recipe(installed):
    _, python, tmp = installed
    where = _run(python, "-c", "import hf_sparse_cp; print(hf_sparse_cp.__file__)", cwd=tmp)
    assert where.startswith(str(tmp / "env")), where  # the installed package, not the repository's
    # the simulator and `memory` read the shipped kept-fraction curve from the installed package data
    source = _run(python, "-c", "from hf_sparse_cp.simulator.kept_curve import DEFAULT_CURVE; "
                  "print(DEFAULT_CURVE.source)", cwd=tmp)
    assert "defaults" in source
    cli = tmp / "env" / "bin" / "hf-sparse-cp"
    listed = _run(cli, "recipes", cwd=tmp)
    assert "qwen2.5-3b_32k" in listed and "cpu_2proc_cp2" in listed
    assert _run(cli, "recipes", "--path", "qwen2.5-3b_32k", cwd=tmp).startswith(str(tmp / "env"))
    out = _run(cli, "train", "--recipe", "qwen2.5-3b_32k", "--sparse_max_length", "256", "--sparse_min_seq_len", "128",
               "--num_samples", "1", "--max_steps", "1", "--tiny_num_layers", "1", "--cp_size", "1",
               "--output_dir", tmp / "run", "--save_strategy", "no", cwd=tmp)
    done = next(line for line in out.splitlines() if line.startswith("done: "))
    assert done.startswith("done: 1 step at 256 tokens on 1 process(es), CP=1 | loss ")
    assert "->" not in done.split("|")[1]  # (one logged loss: no first -> last)
