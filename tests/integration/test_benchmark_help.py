"""`python benchmarks/<script>.py --help`, which the docs send readers to, renders for every benchmark whose flags
come from a dataclass: argparse formats help texts with `%`, so a bare `95%` in one crashed `--help`
(pattern_quality.py: `TypeError: %i format`, bench_smet.py: `%o format`)."""

import dataclasses

import pytest
from transformers import HfArgumentParser

from benchmark_loader import BENCHMARKS, load_benchmark

SCRIPTS = sorted(path.stem for path in BENCHMARKS.glob("*.py") if "HfArgumentParser" in path.read_text())


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_help_of_every_dataclass_flag_renders(name):
    with load_benchmark(name) as module:
        arguments = [value for value in vars(module).values() if isinstance(value, type) and
                     dataclasses.is_dataclass(value) and value.__module__ == name and "Arguments" in value.__name__]
        assert arguments, f"benchmarks/{name}.py builds its HfArgumentParser over no dataclass of its own"
        for cls in arguments:
            assert "--" in HfArgumentParser(cls).format_help()
