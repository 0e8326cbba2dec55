"""The light commands of the command line import only what they need (issue #52): `--help`, `--version`,
`recipes` and `recipes --path` answer without importing torch or transformers, which take seconds to import."""

import json
import subprocess
import sys

import pytest

from hf_sparse_cp.version import __version__

HEAVY = ("torch", "transformers", "accelerate", "triton", "numpy")
# Runs the command line in a fresh interpreter, then prints the heavy modules it imported (as JSON, last line).
PROBE = """
import json, sys
from hf_sparse_cp.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["recipes"], ["recipes", "--path", "cpu_2proc_cp2"],
                                  ["recipes", "--paht", "x"], ["launch", "--nproc", "0", "train.py"]], ids=" ".join)
def test_light_commands_import_neither_torch_nor_transformers(argv):
    done = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv, heavy=HEAVY)], capture_output=True,
                          text=True, timeout=300)
    assert json.loads(done.stdout.splitlines()[-1]) == [], done.stdout + done.stderr


def test_launchers_checks_before_any_process_starts_import_no_trainer(tmp_path):
    """`hf-sparse-cp launch --nproc N` checks the plugin's flags once, before it starts the processes (each of which
    imports the Trainer and the model code itself): that check reads them without either, seconds sooner."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('not run: the launch is refused before')\n")
    heavy = ("transformers.trainer", "transformers.modeling_utils")
    argv = ["launch", "--nproc", "2", "--sparse_block_size", "64", "--cp_schedule", "0:128:1,2:256:4", str(script)]
    done = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv, heavy=heavy)], capture_output=True,
                          text=True, timeout=300)
    assert "--cp_schedule stage 1 (2:256:4): cp_size=4 does not divide the world size 2" in done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [], done.stdout + done.stderr


def test_launchers_checks_of_a_scripts_flags_import_neither_training_arguments_nor_the_smet_optimizer(tmp_path):
    """The checks of `launch --nproc N` that read the script's --use_cpu (its plugin flags checked as on the CPU) and
    the --smet* flags imported transformers' TrainingArguments (with accelerate) and SMET's optimizer (with
    torch.distributed.tensor): seconds before any process started, in every launch. They read the flags without
    them now."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('not run: the launch is refused before')\n")
    heavy = ("transformers.training_args", "transformers.trainer", "accelerate", "torch.distributed.tensor")
    argv = ["launch", "--nproc", "2", str(script), "--use_cpu", "--smet", "--smet_density", "0.5", "--cp_size", "4"]
    done = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv, heavy=heavy)], capture_output=True,
                          text=True, timeout=300)
    assert "cp_size=4 does not divide the world size 2" in done.stderr, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [], done.stdout + done.stderr


def test_launchers_help_imports_no_trainer():
    """`hf-sparse-cp launch --help` (and `python -m hf_sparse_cp.run --help`) lists the plugin's flags before
    `hf_sparse_cp.run` imports the Trainer's modules: it took 8 s on a busy machine, 3 s now."""
    heavy = ("transformers.trainer", "transformers.training_args", "hf_sparse_cp.launch.launched")
    done = subprocess.run([sys.executable, "-c", PROBE.format(argv=["launch", "--help"], heavy=heavy)],
                          capture_output=True, text=True, timeout=300)
    assert "--sparse_block_size" in done.stdout, done.stdout + done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [], done.stdout + done.stderr


def test_version_names_the_package_version(capsys):
    from hf_sparse_cp.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"hf-sparse-cp {__version__}\n"


def test_import_of_the_package_is_light():
    done = subprocess.run([sys.executable, "-c", "import sys, hf_sparse_cp; print(hf_sparse_cp.__version__, "
                           f"sorted(m for m in {HEAVY!r} if m in sys.modules))"], capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.split() == [__version__, "[]"], done.stderr


def test_simulate_from_the_command_line_runs_with_a_recycling_allocator(monkeypatch):
    """glibc's default malloc page-faults the simulator's large temporaries at every use (a third of its CPU time):
    the command runs again in a process that recycles memory, unless the user set GLIBC_TUNABLES."""
    from hf_sparse_cp import cli
    from hf_sparse_cp.backends import RECYCLING_MALLOC

    calls = []
    monkeypatch.setattr(cli.os, "execve", lambda *args: calls.append(args) or sys.exit(0))
    monkeypatch.setattr(sys, "argv", ["hf-sparse-cp", "simulate", "--seq", "32768"])
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    with pytest.raises(SystemExit):
        cli.command_line()
    (executable, args, env), = calls
    assert args[1:] == ["-m", "hf_sparse_cp.cli", "simulate", "--seq", "32768"]
    assert env["GLIBC_TUNABLES"] == RECYCLING_MALLOC


def test_the_interrupted_line_names_the_checkpoint_without_importing_torch(tmp_path):
    """After Ctrl-C the launcher, once its processes are gone, names the newest complete checkpoint: it imported the
    Trainer's checkpoint module for it (torch, transformers), seconds before the command returned (13 s on a busy
    machine, more than the processes took to stop); it now reads the markers alone."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    from hf_sparse_cp.checkpoint_marker import CHECKPOINT_PREFIX, MARKER

    assert CHECKPOINT_PREFIX == PREFIX_CHECKPOINT_DIR  # (the Trainer's checkpoint-N folders)
    for step, complete in ((2, True), (4, False)):
        tmp_path.joinpath(f"checkpoint-{step}").mkdir()
        tmp_path.joinpath(f"checkpoint-{step}", MARKER).write_text(json.dumps({"complete": complete, "step": step}))
    code = ("import json, sys; from hf_sparse_cp.launch.interrupts import interrupted_line; "
            f"print(interrupted_line(2, [{str(tmp_path)!r}]), end=''); "
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert f"the last checkpoint is {tmp_path / 'checkpoint-2'} " in done.stdout, done.stdout + done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [], done.stdout + done.stderr
