"""The table of someone else's members the plugin uses (`compat.PATCHES`) read against what is installed: whether
each member is there with the parameters relied on (`check_patches`, and `require` at the moment a feature needs
one, naming the member, the versions and the fix), the name it has in this release (`member_name`), the entry that
allows a change (`replacement_for`, which `patching.PatchSet` asks before every change) and the argument parser
classes importable here (`argument_parser_classes`)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import Any

from .compat import PARSERS, PATCHES, TESTED_VERSIONS, Patch

_BY_NAME = {p.qualified: p for p in PATCHES}


def _resolve(dotted: str) -> Any:
    """The module, class or attribute `dotted` names: its longest importable prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            target = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and e.name != name and not name.startswith(e.name + "."):
                raise  # (the module is there, a package it imports is not)
            continue
        except ImportError:
            continue
        for attr in parts[cut:]:
            target = getattr(target, attr)
        return target
    raise ImportError(f"no module of {dotted} can be imported")


def _parameters(fn: Any) -> tuple[str, ...]:
    prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return tuple(prefix.get(p.kind, "") + p.name for p in inspect.signature(fn).parameters.values())


def release(package: str) -> tuple[int, ...]:
    """The installed release of `package`, e.g. (2, 11, 0)."""
    from packaging.version import Version

    return Version(importlib.import_module(package).__version__).release


def versions(package: str) -> str:
    """The installed release of `package` and the tested range, for a message: 'torch 2.11.0 (tested 2.6 to 2.13)'."""
    low, high = TESTED_VERSIONS.get(package, ("?", "?"))
    version = getattr(importlib.import_module(package), "__version__", "?")
    return f"{package} {version} (tested {low} to {high})"


def _holds(owner: Any, patch: Patch) -> str | None:
    """The name under which `owner` has the patch's member, or None."""
    names = (patch.name, *patch.alternatives)
    if isinstance(owner, type) and hasattr(owner, "__dataclass_fields__"):
        found = [n for n in names if n in owner.__dataclass_fields__ or hasattr(owner, n)]
    else:
        found = [n for n in names if hasattr(owner, n)]
    return found[0] if found else None


# The packages setup.cfg requires (the others' members are checked where they import).
_REQUIRED = ("torch", "transformers", "accelerate")


def problem(patch: Patch, instance: Any = None) -> str | None:
    """Why `patch`'s member cannot be used as the plugin uses it, or None. Instance members are checked on
    `instance` (skipped without one)."""
    if patch.package == "hf_sparse_cp" or patch.added or importlib.util.find_spec(patch.package) is None:
        return None  # (ours, or an optional package that is not installed: nothing of theirs in use)
    if patch.on_instances and instance is None:
        return None
    if patch.since and release(patch.package) < patch.since:
        return None  # (not yet there: that release's own way needs nothing of it)
    try:
        owner = instance if patch.on_instances else _resolve(patch.owner)
    except ModuleNotFoundError as e:
        if e.name and e.name.partition(".")[0] != patch.package:
            return None  # (installed without a package it needs, e.g. liger-kernel without Triton: unusable, so
            #             nothing of theirs is in use either)
        return f"{patch.owner} cannot be imported ({e})"
    except RuntimeError as e:
        if patch.package not in _REQUIRED:
            return None  # (an optional package whose import fails here, e.g. liger-kernel on Triton 3.2 without a
            #             GPU, '0 active drivers': unusable, so nothing of theirs is in use)
        return f"{patch.owner} cannot be imported ({e})"
    except (ImportError, AttributeError) as e:
        return f"{patch.owner} cannot be imported ({e})"
    name = _holds(owner, patch)
    if name is None:
        return f"{patch.qualified} no longer exists"
    if patch.parameters is not None:
        found = _parameters(getattr(owner, name))
        if found != patch.parameters:
            return f"{patch.qualified} takes ({', '.join(found)}), not ({', '.join(patch.parameters)})"
    return None


def check_patches(instances: dict[str, Any] | None = None) -> list[str]:
    """One line per member that changed: what changed, what the plugin uses it for, the installed and
    tested versions. `instances` maps an owner (e.g. "accelerate.Accelerator") to an object on which
    its instance members are checked."""
    instances = instances or {}
    lines = []
    for patch in PATCHES:
        why = problem(patch, instances.get(patch.owner))
        if why is not None:
            lines.append(f"{why}; hf-sparse-cp {patch.action} it because {patch.why}. Installed: "
                         f"{versions(patch.package)}.")
    return lines


def member_name(qualified: str, owner: Any) -> str | None:
    """The name under which `owner` has the member `qualified` names (or one of its `alternatives`), or None."""
    return _holds(owner, _BY_NAME[qualified])


def require(qualified: str, instance: Any = None) -> None:
    """Raise RuntimeError, naming the member, the versions and the fix, unless the member `qualified`
    (e.g. "transformers.Trainer._track_num_input_tokens") is usable."""
    patch = _BY_NAME[qualified]
    why = problem(patch, instance)
    if why is not None:
        raise RuntimeError(
            f"{why}: hf-sparse-cp {patch.action} it because {patch.why}. Installed: {versions(patch.package)}. "
            f"Install a {patch.package} release in the tested range, or an hf-sparse-cp release that supports yours."
        )


def _matches(owner: Any, patch: Patch) -> bool:
    # by the defining module and name first: the dotted name may now hold another class (liger-kernel replaces the
    # norm and MLP classes in the modeling modules, after the model's own instances were built)
    cls = owner if isinstance(owner, type) else type(owner)
    if any(f"{c.__module__}.{c.__qualname__}" == patch.owner for c in cls.__mro__):
        return True
    try:
        target = _resolve(patch.owner)
    except (ImportError, AttributeError):
        return False
    if target is owner:
        return True
    if isinstance(target, type):
        return isinstance(owner, target) or (isinstance(owner, type) and issubclass(owner, target))
    return False


def replacement_for(owner: Any, name: str) -> Patch:
    """The `PATCHES` entry that allows changing `owner.name` (or the item `name` of a mapping `owner`).
    Raises LookupError when there is none: every change must be listed (with why and its undo)."""
    for patch in PATCHES:
        if patch.changes and name in (patch.name, *patch.alternatives) and _matches(owner, patch):
            return patch
    raise LookupError(f"hf-sparse-cp changes {type(owner).__name__}.{name} without an entry in "
                      "hf_sparse_cp.integration.compat.PATCHES: add one (why, undo) and its apply/undo test.")


def argument_parser_classes() -> list[type]:
    """The classes of `PARSERS` that can be imported here (TRL's only where TRL is installed and has its copy)."""
    found = []
    for dotted in PARSERS:
        try:
            found.append(_resolve(dotted))
        except (ImportError, AttributeError):
            continue
    return found
