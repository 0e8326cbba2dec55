"""How much of the causal attention a pattern keeps at a sequence length: a measured curve.

A sparse pattern's kept fraction falls with length (attention grows more concentrated as there are more
keys to spread over), so a prediction at 128K or 1M cannot take the fraction measured at 8K or 32K. `KeptCurve`
holds what `benchmarks/pattern_quality.py --curve` measured on one model and one pattern setting (the
kept fraction of the causal blocks over the sparse layers, and the widest layout row as a share of the
query blocks) and answers for any length, saying how it got the answer:

- 'measured' at a measured length inside the model's trained context;
- 'interpolated' between two of them (a straight line in log-log);
- 'extrapolated' outside them: a power law S^b least-squares fitted to the in-context points of the
  longest two octaves measured (past the longest) or of the shortest two (below the shortest).

Lengths past the model's trained context are kept in the report but never used: the model breaks
down there (SmolLM2-135M, trained to 8K: dense perplexity 33 at 16K against 12 at 8K) and its attention with it.
A fraction never goes above 1 or below what every layout keeps (each query block row's own block).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..config import SparseAttentionConfig

# how an answer was obtained ('given': a share the caller set, e.g. the simulator's --density)
Basis = Literal["measured", "interpolated", "extrapolated", "given"]


@dataclass(frozen=True)
class KeptPoint:
    """One measured length: kept fraction of the causal blocks (mean over the sparse layers) and the widest
    layout row over the query blocks (max over the sparse layers)."""

    seq_len: int
    kept: float
    width_share: float
    beyond_context: bool = False


@dataclass(frozen=True)
class KeptAt:
    """A curve's answer at one length."""

    seq_len: int
    kept: float
    width_share: float
    basis: Basis
    source: str


def _power_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(log a, b) of y = a x^b least-squares in log-log; one point: a flat line through it."""
    xs, ys = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    if len(points) == 1:
        return ys[0], 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


@dataclass(frozen=True)
class KeptCurve:
    """Measured kept fractions of one pattern setting on one model (see the module docstring)."""

    points: tuple[KeptPoint, ...]
    source: str  # what was measured, for the answers' labels
    # the measured setting, sparse at any length
    pattern: SparseAttentionConfig = field(default_factory=lambda: SparseAttentionConfig(min_seq_len=0))

    def __post_init__(self) -> None:
        if not self.usable:
            raise ValueError(f"{self.source}: no measured length inside the model's trained context.")
        for p in self.points:
            if not (0 < p.kept <= 1 and 0 < p.width_share <= 1):
                raise ValueError(f"{self.source}: shares at {p.seq_len} must be in (0, 1], got kept={p.kept}, "
                                 f"width_share={p.width_share}.")

    @property
    def block_size(self) -> int:
        return self.pattern.block_size

    def measures(self, cfg: SparseAttentionConfig) -> bool:
        """Whether the curve was measured with the pattern `cfg` describes (its length threshold and engine aside:
        they decide where and how, not what a layout keeps)."""
        return cfg.replace(min_seq_len=0, attention_engine=self.pattern.attention_engine) == self.pattern

    @property
    def usable(self) -> list[KeptPoint]:
        """The points inside the model's trained context, by length."""
        return sorted((p for p in self.points if not p.beyond_context), key=lambda p: p.seq_len)

    def at(self, seq_len: int) -> KeptAt:
        """The kept fraction and layout width at `seq_len` tokens, with how they were obtained."""
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1.")
        pts = self.usable
        lengths = [p.seq_len for p in pts]
        if seq_len in lengths:
            p = pts[lengths.index(seq_len)]
            kept, width, basis = p.kept, p.width_share, "measured"
        elif lengths[0] < seq_len < lengths[-1]:
            hi = next(i for i, n in enumerate(lengths) if n > seq_len)
            kept, width = (self._fit([pts[hi - 1], pts[hi]], name, seq_len) for name in ("kept", "width_share"))
            basis = "interpolated"
        else:
            ends = [p for p in pts if p.seq_len >= lengths[-1] / 4] if seq_len > lengths[-1] else \
                [p for p in pts if p.seq_len <= lengths[0] * 4]
            kept, width = (self._fit(ends, name, seq_len) for name in ("kept", "width_share"))
            basis = "extrapolated"
        rows = -(-seq_len // self.block_size)
        floor_kept, floor_width = 2 / (rows + 1), 1 / rows  # each query block row's own block
        return KeptAt(seq_len, min(1.0, max(floor_kept, kept)), min(1.0, max(floor_width, width)), basis,
                      self.source)

    @staticmethod
    def _fit(points: list[KeptPoint], name: str, seq_len: int) -> float:
        log_a, b = _power_fit([(p.seq_len, getattr(p, name)) for p in points])
        return math.exp(log_a + b * math.log(seq_len))

    @classmethod
    def from_report(cls, path: str | Path, setting: str = "defaults") -> KeptCurve:
        """The curve of `setting` in a `pattern_quality.py --curve` report. Raises ValueError naming the file, the
        entry and what it must hold for a report that is missing, not JSON or not shaped as the script writes it."""
        try:
            report = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"kept-fraction curve {path}: {getattr(e, 'strerror', None) or 'not JSON'}; give a report "
                             "that benchmarks/pattern_quality.py --curve wrote.") from None
        if not isinstance(report, dict) or "curve_settings" not in report:
            raise ValueError(f"{path} is not a kept-fraction curve (benchmarks/pattern_quality.py --curve writes one).")
        settings = _entry(path, "curve_settings", report["curve_settings"], dict,
                          "a mapping of each measured setting's name to its changes to the defaults")
        if setting not in settings:
            raise ValueError(f"{path} has no setting {setting!r}; it has {sorted(settings)}.")
        lengths = _entry(path, "lengths", report.get("lengths"), dict,
                         "a mapping of each measured length in tokens (\"1024\") to what was measured there")
        points = tuple(point for key, length in lengths.items()
                       if (point := _point(path, key, length, setting)) is not None)
        # every field of the measured pattern where the report holds it (the settings are changes to the defaults
        # of the day, which may have changed since)
        stored = "patterns" in report
        where = f"patterns[{setting!r}]" if stored else f"curve_settings[{setting!r}]"
        fields = _entry(path, where, report["patterns"].get(setting) if stored else settings[setting], dict,
                        "the measured pattern's fields" if stored else "the setting's changes to the defaults")
        try:
            pattern = SparseAttentionConfig.from_dict(fields) if stored else \
                SparseAttentionConfig(min_seq_len=0, **fields)
        except (TypeError, ValueError) as e:  # (the config's own message names the field and value)
            raise ValueError(f"kept-fraction curve {path}: {where} is not a pattern: {e}") from None
        layers = report.get("layers_measured")
        label = report.get("model", "the measured model") + (", every layer" if layers is None else
                                                              f", layers {layers}")
        return cls(points, f"{Path(path).name} ({setting}, {label})", pattern)


    def to_dict(self) -> dict:
        """The curve as `from_dict` reads it (the shipped curve's file)."""
        return {"source": self.source, "pattern": self.pattern.to_dict(),
                "points": [dataclasses.asdict(p) for p in self.points]}

    @classmethod
    def from_dict(cls, data: dict) -> KeptCurve:
        return cls(tuple(KeptPoint(**p) for p in data["points"]), data["source"],
                   SparseAttentionConfig.from_dict(data["pattern"]))


def _entry(path: str | Path, where: str, value, kind: type | tuple[type, ...], what: str):
    """`value`, the report's entry `where`, when it is of `kind` (bool is not a number); ValueError naming the file,
    the entry and `what` it must hold otherwise."""
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        found = "missing" if value is None else f"{value!r}"
        raise ValueError(f"kept-fraction curve {path}: {where} is {found}; it must hold {what} (as "
                         "benchmarks/pattern_quality.py --curve writes it).")
    return value


def _point(path: str | Path, key: str, length, setting: str) -> KeptPoint | None:
    """The point of `setting` in the report's entry `lengths[key]`, or None where that setting was not measured."""
    where = f"lengths[{key!r}]"
    if not key.isdigit() or int(key) < 1:
        raise ValueError(f"kept-fraction curve {path}: {where}: a key of 'lengths' must be a sequence length in "
                         "tokens, a whole number such as \"1024\".")
    length = _entry(path, where, length, dict, "'beyond_context' (true or false) and 'settings'")
    beyond = _entry(path, f"{where}['beyond_context']", length.get("beyond_context"), bool,
                    "true or false: whether the length is past the model's trained context")
    measured = _entry(path, f"{where}['settings']", length.get("settings"), dict,
                      "a mapping of each setting's name to its measurement at this length")
    if measured.get(setting) is None:
        return None
    shares = _entry(path, f"{where}['settings'][{setting!r}]", measured[setting], dict,
                    "'kept_sparse_layers' and 'width_share_max'")
    if "kept_sparse_layers" not in shares:  # (a setting measured without the pattern's layouts at this length)
        return None
    kept, width = (_entry(path, f"{where}['settings'][{setting!r}][{name!r}]", shares.get(name), (int, float),
                          f"a number in (0, 1]: {what}")
                   for name, what in (("kept_sparse_layers", "the kept fraction of the causal blocks, e.g. 0.72"),
                                      ("width_share_max", "the widest layout row over the query blocks, e.g. 0.9")))
    return KeptPoint(int(key), kept, width, beyond)


# The shipped curve: the default pattern measured by `python benchmarks/pattern_quality.py --curve` (its source says
# on which model, layers and report; tests/unit/test_kept_curve.py checks it against that report in
# benchmarks/results and that it measured today's defaults). Package data, rewritten from a report by
# `python -m hf_sparse_cp.simulator.kept_curve REPORT`.
DEFAULT_CURVE_FILE = Path(__file__).resolve().parent / "data" / "default_kept_curve.json"
DEFAULT_CURVE = KeptCurve.from_dict(json.loads(DEFAULT_CURVE_FILE.read_text()))


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Write the shipped kept-fraction curve from a `pattern_quality.py --curve` "
                                "report.")
    p.add_argument("report")
    p.add_argument("--setting", default="defaults")
    args = p.parse_args(argv)
    try:  # (a report not there, not JSON or without the setting: a usage error naming it, not a traceback)
        curve = KeptCurve.from_report(args.report, args.setting)
    except (OSError, ValueError) as e:
        p.error(str(e))
    DEFAULT_CURVE_FILE.write_text(json.dumps(curve.to_dict(), indent=1) + "\n")
    print(f"wrote {DEFAULT_CURVE_FILE}: {curve.source}")


if __name__ == "__main__":
    main()
