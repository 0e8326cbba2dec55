"""The wheel's package list in setup.cfg names every package of the plugin (a package left out installs
nowhere, and only a slow wheel test would notice)."""
import configparser
from pathlib import Path

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
