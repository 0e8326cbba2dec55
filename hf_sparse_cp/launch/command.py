"""The grammar of a launch command (`python -m hf_sparse_cp.run`, `hf-sparse-cp launch`): the plugin's flags, then
the script (a path, or `-m module`), then the script's own arguments. A leaf, so that the command line splits a
command without importing transformers."""

from __future__ import annotations

from collections.abc import Sequence


def split_command(argv: Sequence[str]) -> tuple[list[str], str | None, bool, list[str]]:
    """(plugin flags, the script's path or module name, whether it is a module, the script's arguments):
    the script is the first argument ending in `.py`, or the one after `-m`."""
    for i, arg in enumerate(argv):
        if arg == "-m" and i + 1 < len(argv):
            return list(argv[:i]), argv[i + 1], True, list(argv[i + 2:])
        if arg.endswith(".py") and not arg.startswith("-"):
            return list(argv[:i]), arg, False, list(argv[i + 1:])
    return list(argv), None, False, []
