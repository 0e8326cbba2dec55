"""The tape a step is replayed on: live allocations by term, each phase's peak with the live bytes of every term
then (`Tape`), and the prediction read from it (`MemoryEstimate`)."""

from __future__ import annotations

from dataclasses import dataclass

from .settings import StepSettings

GIB = 2**30

# The terms a step's bytes are reported under. Each allocation is bytes per token of the rank x its tokens
# plus constant bytes: `MemoryEstimate.token_scaled_bytes` sums the first parts.
TERMS = (
    "weights", "gradients", "optimizer state", "optimizer step temporaries", "FSDP gathered layers",
    "autocast weight copies", "loss: weight-gradient buffers", "loss: logits chunk", "attention workspace",
    "inputs and token metadata", "rotary cos/sin", "saved layer inputs", "recomputed layer: saved activations",
    "layers' saved activations",
    "MLP intermediate", "RMSNorm fp32 copies", "attention tensors", "attention layouts", "estimation buffers",
    "CP ring buffers", "CP all-to-all buffers", "hidden-state gradients", "loss: hidden gradient", "loss: logits",
)


class Tape:
    """Live allocations by term; the peak of each phase with the live bytes of every term then."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.live: dict[int, tuple[str, float, float]] = {}  # handle -> (term, per-token bytes, constant bytes)
        self.next = 0
        self.phase = ""
        self.peaks: dict[str, dict] = {}

    def alloc(self, term: str, per_token: float = 0.0, const: float = 0.0) -> int:
        if term not in TERMS:
            raise KeyError(term)
        self.next += 1
        self.live[self.next] = (term, per_token, const)
        self._check()
        return self.next

    def free(self, *handles: int | None) -> None:
        for h in handles:
            if h is not None:
                del self.live[h]

    def transient(self, term: str, per_token: float = 0.0, const: float = 0.0) -> None:
        """An allocation freed right after its use: it counts at this moment only."""
        self.free(self.alloc(term, per_token, const))

    def _check(self) -> None:
        total = sum(p * self.tokens + c for _, p, c in self.live.values())
        best = self.peaks.get(self.phase)
        if best is None or total > best["bytes"]:
            terms: dict[str, list[float]] = {}
            for term, p, c in self.live.values():
                acc = terms.setdefault(term, [0.0, 0.0])
                acc[0] += p * self.tokens
                acc[1] += c
            self.peaks[self.phase] = {"bytes": total, "terms": terms}


@dataclass
class MemoryEstimate:
    """Predicted peak of one training step on one rank.

    `phases`: per phase ('forward', 'loss', 'backward', 'optimizer'), its peak bytes and the bytes of
    every term then, split into the part that grows with the tokens and the constant part."""

    arch: str
    seq_len: int
    tokens_per_rank: int
    settings: StepSettings
    phases: dict[str, dict]
    layout_width: str = ""  # the widest layout row and where that width comes from

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: self.phases[p]["bytes"])

    @property
    def peak_bytes(self) -> float:
        return self.phases[self.peak_phase]["bytes"]

    def terms(self, phase: str | None = None) -> dict[str, float]:
        """Bytes of every term at the peak of `phase` (default: the step's peak), largest first."""
        raw = self.phases[phase or self.peak_phase]["terms"]
        return dict(sorted(((t, sum(v)) for t, v in raw.items() if sum(v) > 0), key=lambda x: -x[1]))

    def token_scaled_bytes(self) -> float:
        """Bytes of the terms that grow with the tokens, at the step's peak."""
        return sum(v[0] for v in self.phases[self.peak_phase]["terms"].values())

    @property
    def dominant_term(self) -> str:
        return next(iter(self.terms()))

    def to_dict(self) -> dict:
        return {"model": self.arch, "seq_len": self.seq_len, "tokens_per_rank": self.tokens_per_rank,
                "layout_width": self.layout_width,
                "peak_gib": self.peak_bytes / GIB, "peak_phase": self.peak_phase, "dominant_term": self.dominant_term,
                "token_scaled_bytes_per_token": self.token_scaled_bytes() / self.tokens_per_rank,
                "phases": {p: {"gib": v["bytes"] / GIB,
                               "terms_gib": {t: sum(x) / GIB for t, x in v["terms"].items() if sum(x) > 0}}
                           for p, v in self.phases.items()}}
