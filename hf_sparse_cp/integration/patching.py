"""Reversible changes, recorded in one place so the matching disable call undoes exactly them.

Every change the plugin makes to transformers, accelerate, a model, a Trainer, its callbacks or the
user's `TrainingArguments` goes through a `PatchSet`, and only changes listed in
`compat.PATCHES` (with why and their undo) are accepted. Undoing restores a value only while it is
still the one the plugin set: if another library replaced it after us (Liger patching a forward, a
user registering another attention function), theirs stays.

A record kept on an object (`record_on`) goes with copies of it (`copy.deepcopy`, pickle, `torch.save`):
the copy's record holds the undo of the changes made inside that object, re-bound to the copy, so the
matching disable call on the copy restores the copy. Changes outside it (process-wide registrations,
other objects such as the training arguments; `outside=True`) stay the original's to undo. Undo actions
of a record are therefore picklable: module-level functions, `functools.partial`s of them, objects.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

from .compat_checks import replacement_for


class _Absent(enum.Enum):
    """No value (an enum member: the same object after pickling and copying)."""

    MISSING = "missing"


_MISSING = _Absent.MISSING


def _current(owner: Any, name: str) -> Any:
    """What `owner.name` is now: a class's own member (not an inherited one), an instance's attribute."""
    return owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)


def _stored_on(owner: Any, name: str) -> bool:
    """Whether assigning `owner.name` stores the value on `owner` itself, so that restoring means putting
    the previous value back (or deleting ours, revealing the class member, when there was none)."""
    if isinstance(owner, type):
        return True
    # (looked up without calling descriptors: `__class__` is the type's data descriptor, not the instance's class)
    member = inspect.getattr_static(type(owner), name, None)
    return not hasattr(member, "__set__")  # a property or other data descriptor (`__class__`) stores elsewhere


class PatchSet:
    """A stack of undo actions; `undo()` runs them in reverse order."""

    def __init__(self) -> None:
        self._undo: list[tuple[Callable[[], None], bool]] = []  # (action, whether it undoes a change outside)

    def __getstate__(self) -> dict[str, Any]:
        # a copy (deepcopy, pickle) of the object holding this record undoes only what is inside that object
        return {"_undo": [(action, False) for action, outside in self._undo if not outside]}

    def set_attr(self, owner: Any, name: str, value: Any, *, outside: bool = False) -> None:
        """Set `owner.name = value`, remembering the previous value (or its absence); undoing
        restores it only while `owner.name` is still `value`. Raises LookupError unless
        `compat.PATCHES` lists the change. `outside`: see `on_undo`."""
        replacement_for(owner, name)
        stored = _stored_on(owner, name)
        previous = owner.__dict__.get(name, _MISSING) if stored else _current(owner, name)
        setattr(owner, name, value)
        self.on_undo(functools.partial(_restore_attr, owner, name, previous, value), outside=outside)

    def insert(self, owner: Any, name: str, index: int, item: Any) -> None:
        """`owner.name.insert(index, item)` (a list); undoing removes that item (wherever it is by then)."""
        replacement_for(owner, name)
        items = getattr(owner, name)
        items.insert(index, item)
        self.on_undo(functools.partial(_remove_item, items, item))

    def set_item(self, mapping: MutableMapping, key: str, value: Any) -> None:
        """`mapping[key] = value` (e.g. an environment variable); undoing restores the previous value (or
        its absence) while `mapping[key]` is still `value`."""
        replacement_for(mapping, key)
        previous = mapping.get(key, _MISSING)
        mapping[key] = value
        self.on_undo(functools.partial(_restore_item, mapping, key, previous, value))

    def record_changes(self, owners: list[Any], change: Callable[[], Any], *, outside: bool = False) -> Any:
        """Run `change()`, another library's own patching function, and record every attribute of `owners` (modules,
        classes, objects; a torch module's child modules too) that it set, replaced or deleted: undoing restores each
        while it is still the value `change` left. Returns what `change` returned. The caller's `compat.PATCHES`
        entry names the function called (its members are not known beforehand). `outside`: see `on_undo`."""
        before = [(owner, _attributes(owner)) for owner in owners]
        result = change()
        for owner, previous in before:
            now = _attributes(owner)
            for name in previous.keys() | now.keys():
                old, new = previous.get(name, _MISSING), now.get(name, _MISSING)
                if old is not new:
                    self.on_undo(functools.partial(_restore_recorded, owner, name, old, new), outside=outside)
        return result

    def on_undo(self, action: Callable[[], None], *, outside: bool = False) -> None:
        """Run `action` on undo. `outside=True` for a change outside the object this record is kept on
        (process-wide state, another object): a copy of that object does not carry it."""
        self._undo.append((action, outside))

    def undo(self) -> None:
        while self._undo:
            action, _ = self._undo.pop()
            action()


@contextlib.contextmanager
def temporarily(owner: Any, name: str, value: Any) -> Iterator[None]:
    """`owner.name` is `value` inside the block (a change `compat.PATCHES` lists), and what it was after it."""
    patches = PatchSet()
    patches.set_attr(owner, name, value)
    try:
        yield
    finally:
        patches.undo()


def _restore_attr(owner: Any, name: str, previous: Any, value: Any) -> None:
    if _current(owner, name) is not value:
        return  # replaced after us: leave theirs
    if previous is _MISSING:
        delattr(owner, name)
    else:
        setattr(owner, name, previous)


def _attributes(owner: Any) -> dict[str, Any]:
    """`owner`'s own attributes by name, a torch module's children included (they live in `_modules`)."""
    found = dict(vars(owner))
    children = found.get("_modules")
    if isinstance(children, dict):
        found.update(children)
    return found


def _restore_recorded(owner: Any, name: str, previous: Any, value: Any) -> None:
    if _attributes(owner).get(name, _MISSING) is not value:
        return  # changed again after the recorded change: leave it
    if previous is _MISSING:
        delattr(owner, name)
    else:
        setattr(owner, name, previous)


def _remove_item(items: list, item: Any) -> None:
    for i, x in enumerate(items):
        if x is item:
            del items[i]
            return


def _restore_item(mapping: MutableMapping, key: str, previous: Any, value: Any) -> None:
    if mapping.get(key, _MISSING) != value:
        return  # changed after us: leave it
    if previous is _MISSING:
        del mapping[key]
    else:
        mapping[key] = previous


def attached_patches(owner: Any, feature: str) -> PatchSet | None:
    """The `PatchSet` of `feature` recorded on `owner` by `record_on`, or None."""
    return owner.__dict__.get(f"_hf_sparse_cp_{feature}")


def record_on(owner: Any, feature: str) -> PatchSet:
    """A new `PatchSet` kept on `owner` under `feature`, which removes itself from `owner` when undone.
    Raises ValueError when `feature` is already recorded there (undo it first)."""
    key = f"_hf_sparse_cp_{feature}"
    if key in owner.__dict__:
        raise ValueError(f"{feature.replace('_', ' ')} is already enabled on this {type(owner).__name__}; "
                         "disable it first to change it.")
    patches = PatchSet()
    owner.__dict__[key] = patches
    patches.on_undo(functools.partial(_forget, owner, key))
    return patches


def _forget(owner: Any, key: str) -> None:
    owner.__dict__.pop(key, None)


def undo_recorded(owner: Any, feature: str) -> bool:
    """Undo the `PatchSet` of `feature` recorded on `owner`; False when there is none."""
    patches = attached_patches(owner, feature)
    if patches is None:
        return False
    patches.undo()
    return True
