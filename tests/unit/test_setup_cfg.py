"""setup.cfg: the wheel's package list names every package of the plugin (a package left out installs nowhere, and
only a slow wheel test would notice), Triton is required only where it can run, and the console script ends the
process with the command's status."""
import configparser
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def _options() -> configparser.SectionProxy:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    return parser["options"]


def _listed(key: str) -> list[str]:
    return [line.strip() for line in _options()[key].splitlines() if line.strip()]


def test_every_package_folder_is_listed_for_the_wheel():
    folders = {"hf_sparse_cp": ROOT / "hf_sparse_cp"}
    folders |= {package.split(" = ")[0]: ROOT / package.split(" = ")[1] for package in _listed("package_dir")}
    found = set()
    for name, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            if "__pycache__" not in parts:
                found.add(".".join((name, *parts)))
    assert sorted(found) == sorted(_listed("packages"))


def _requirements(text: str) -> list[Requirement]:
    lines = (line.strip() for line in text.splitlines())
    return [Requirement(line) for line in lines if line and not line.startswith("#")]


PLATFORMS = {  # (platform_system, platform_machine) -> whether Triton's wheels exist there
    ("Linux", "x86_64"): True, ("Linux", "aarch64"): True, ("Darwin", "arm64"): False, ("Darwin", "x86_64"): False,
    ("Windows", "AMD64"): False,
}


def test_triton_is_installed_only_where_it_can_run():
    """The plugin installs without Triton (macOS, Windows, CPU-only: issue #52): not a requirement, and the extras
    that bring it (the kernels' `cuda`, the interpreter tests' `test`) select it only on Linux x86_64 / aarch64."""
    assert "triton" not in {r.name for r in _requirements(_options()["install_requires"])}
    extras = _options().parser["options.extras_require"]
    for extra in ("cuda", "test"):
        (triton,) = [r for r in _requirements(extras[extra]) if r.name == "triton"]
        assert triton.specifier.contains("3.4.0") and not triton.specifier.contains("3.3.1")  # (kernels: >= 3.4)
        for (system, machine), expected in PLATFORMS.items():
            environment = {"platform_system": system, "platform_machine": machine}
            assert triton.marker.evaluate(environment) is expected, (extra, system, machine)


def test_the_console_script_runs_the_command_line_entry_that_ends_the_process():
    """`hf_sparse_cp.cli.main` returns the status to a Python caller; the console script's entry ends the process with
    it (and ends a launcher whose run is over without the interpreter's teardown)."""
    from hf_sparse_cp import cli

    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    name, target = (part.strip() for part in parser["options.entry_points"]["console_scripts"].split("="))
    module, function = target.split(":")
    assert (name, module) == ("hf-sparse-cp", "hf_sparse_cp.cli") and getattr(cli, function) is cli.command_line
