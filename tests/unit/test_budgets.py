"""The budget modes behind one interface (`hf_sparse_cp.attention.budgets`): each selects what its dense fp64
oracle (`budgets/naive.py`) selects, on random scores with exact ties, from whole rows as from the candidates
every holder offers; the interface's other answers (sizes, offers, diagonal scores) and the registry."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention.budgets import Budget, Entries, Mass, TopK, TopP
from hf_sparse_cp.attention.budgets.naive import naive_select
from hf_sparse_cp.config.sections import budget_class, budget_field_names, budget_modes

from oracle import select_vertical_slash

BS = 16
BUDGETS = [
    TopK(vertical_topk=9, slash_topk=13),
    TopK(vertical_topk=0, slash_topk=500),
    TopP(vertical_topp=0.5, slash_topp=0.8, vertical_cap=12, slash_cap=40),
    TopP(vertical_topp=0.95, slash_topp=0.3, vertical_cap=200, slash_cap=5),
    Mass(mass_target=0.6, mass_threshold=0.0, vertical_cap=10),
    Mass(mass_target=0.3, mass_threshold=0.02, vertical_cap=40),
    Mass(mass_target=0.9, mass_threshold=0.005, mass_near_blocks=2, vertical_cap=6),
    Mass(mass_target=0.5, mass_threshold=0.0, mass_near_blocks=1, vertical_cap=100),
]


def _scores(g: torch.Generator, heads: int, n: int) -> torch.Tensor:
    """Random fp64 scores with many exact ties (a few distinct values, dyadic: sums are exact) and zeros."""
    values = torch.randint(0, 6, (heads, n), generator=g).double() / 8
    return values * (torch.rand(heads, n, generator=g) < 0.8)


@pytest.mark.parametrize("budget", BUDGETS, ids=str)
@pytest.mark.parametrize("start, end, scored_end", [(0, 160, 160), (7, 140, 140), (32, 200, 120)],
                         ids=["aligned", "unaligned", "causal-chunk"])
def test_each_budget_selects_what_its_dense_oracle_selects(budget, start, end, scored_end):
    """The segment [start, end) of a row of 200 tokens, scored by the queries before `scored_end`: the
    pipeline's budget stage (anchors off) keeps exactly the oracle's columns and offsets."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{budget}|{start}".encode()))  # the same in every process
    s, h = 200, 3
    vertical, slash = torch.zeros(1, h, s, dtype=torch.float64), torch.zeros(1, h, s, dtype=torch.float64)
    vertical[0, :, start:scored_end] = _scores(g, h, scored_end - start)
    slash[0, :, start:scored_end] = _scores(g, h, scored_end - start) * 4
    cfg = SparseAttentionConfig(budget=budget, block_size=BS, sink_tokens=0, local_window=1)
    keep_v, keep_s = select_vertical_slash(vertical, slash, [[(start, end, scored_end)]], cfg)
    want_v, want_s = naive_select(budget, vertical[0, :, start:end], slash[0, :, start:end], start, end, scored_end, BS)
    keep_s[0, :, start] = False  # the local window's main diagonal (always kept)
    want_s = torch.tensor(want_s)
    want_s[:, 0] = False
    assert torch.equal(keep_v[0, :, start:end], torch.tensor(want_v)) and torch.equal(keep_s[0, :, start:end], want_s)
    assert not keep_v[0, :, :start].any() and not keep_v[0, :, end:].any()  # nothing outside the segment
    assert int(keep_v.sum()) + int(keep_s.sum()) > 0


@pytest.mark.parametrize("budget", BUDGETS, ids=str)
def test_the_union_of_every_holders_offer_selects_what_the_whole_row_selects(budget):
    """Under CP each rank offers its best entries (`offered`, ranked by `column_key`) and the mass of all it
    holds; selecting from the union (in any order) keeps exactly what the whole row keeps."""
    g = torch.Generator().manual_seed(3)
    h, n, start, end = 2, 150, 5, 155
    vertical, slash = _scores(g, h, n), _scores(g, h, n) * 4
    columns = Entries(vertical, torch.arange(start, end))
    diagonal_scores = budget.diagonal_scores(slash, BS)
    diagonals = Entries(diagonal_scores, torch.arange(diagonal_scores.shape[1]))
    whole = budget.select(columns, diagonals, start, end, end, BS)
    key = budget.column_key(start, end, BS)
    offers = []
    for entries, kind in ((columns, "columns"), (diagonals, "diagonals")):
        held = [torch.arange(r, entries.scores.shape[1], 3) for r in range(3)]  # three interleaved holders
        best = []
        for mine in held:
            m = int(budget.offered(kind, torch.tensor(len(mine))))
            rank = entries.scores[:, mine] if key is None or kind == "diagonals" else key(
                entries.scores[:, mine], positions=entries.ids[mine])
            order = torch.sort(rank, dim=1, descending=True, stable=True).indices[:, :m]
            best.append(mine[order].flip(1))  # each holder's offer, in an order of its own
        idx = torch.cat(best, 1)
        offers.append((idx, Entries(entries.scores.gather(1, idx), entries.ids[idx],
                                    entries.scores.sum(1, keepdim=True))))
    kept = budget.select(offers[0][1], offers[1][1], start, end, end, BS)
    for (idx, _), part, want in zip(offers, kept, whole):
        assert torch.equal(torch.zeros_like(want).scatter_(1, idx, part), want)


def test_the_interface_sizes_and_offers():
    topk, topp, mass = TopK(64, 128), TopP(vertical_cap=100, slash_cap=300), Mass(vertical_cap=50)
    assert [b.most_kept("columns") for b in (topk, topp, mass)] == [64, 100, 50]
    assert [b.most_kept("diagonals") for b in (topk, topp, mass)] == [128, 300, None]
    # a kept token offset crosses two block diagonals, a block diagonal is one; mass bounds none
    assert [b.most_diagonal_blocks(BS) for b in (topk, topp, mass)] == [256, 600, None]
    assert int(topk.offered("columns", torch.tensor(1000))) == 64 and int(mass.offered("diagonals",
                                                                                       torch.tensor(77))) == 77
    assert (topk.weighted, mass.weighted, mass.far_blocks, Mass(mass_near_blocks=3).far_blocks) == (False, True, 0, 3)
    # diagonal scores are linear in the slashes (partial sums on ranks add up), offsets or block diagonals
    g = torch.Generator().manual_seed(4)
    a, b = torch.rand(2, 70, generator=g, dtype=torch.float64), torch.rand(2, 70, generator=g, dtype=torch.float64)
    for budget in (topk, mass):
        assert torch.allclose(budget.diagonal_scores(a + b, BS), budget.diagonal_scores(a, BS)
                              + budget.diagonal_scores(b, BS))
    assert (topk.diagonal_step(BS), mass.diagonal_step(BS), mass.diagonal_scores(a, BS).shape[1]) == (1, BS, 6)
    assert "512 key columns" in TopK().describe() and "0.9 of each head's attention" in Mass().describe()


def test_the_registry_holds_each_mode_once_with_fields_of_its_own():
    assert budget_modes() == ("topk", "topp", "mass")
    assert {budget_class(m) for m in budget_modes()} == {TopK, TopP, Mass}
    assert budget_field_names() == ["vertical_topk", "slash_topk", "vertical_topp", "slash_topp", "vertical_cap",
                                    "slash_cap", "mass_target", "mass_threshold", "mass_near_blocks"]
    for mode in budget_modes():
        cls = budget_class(mode)
        assert all(f.default is not dataclasses.MISSING and f.default is not None for f in dataclasses.fields(cls))
        assert cls().to_dict()["mode"] == mode
    with pytest.raises(ValueError, match=r"budget_mode='greedy' \(str\) is not valid: use one of 'topk', 'topp', "
                                         r"'mass' \(a mode of your own: .*register_budget"):
        budget_class("greedy")
    for bad, match in ((dict(vertical_topk=-1), "vertical_topk=-1 must be >= 0"),
                       (dict(slash_topp=0.0), r"slash_topp=0.0 must be in \(0, 1\]"),
                       (dict(mass_threshold=1.0), r"mass_threshold=1.0 must be in \[0, 1\)"),
                       (dict(vertical_cap=0), "vertical_cap=0 must be >= 1")):
        with pytest.raises(ValueError, match=match):
            SparseAttentionConfig(**bad)


def test_the_registry_holds_the_built_in_modes_whatever_was_imported_first(monkeypatch):
    """A process whose first use of the budget registry comes before anything imported the budget modes (the
    registry empty, their package not imported) still finds every built-in mode, in flag-page order."""
    import sys

    import hf_sparse_cp.attention
    from hf_sparse_cp.config import sections

    monkeypatch.setattr(sections, "_BUDGETS", {})
    monkeypatch.setattr(hf_sparse_cp.attention, "budgets", hf_sparse_cp.attention.budgets)
    for name in [m for m in sys.modules if m.startswith("hf_sparse_cp.attention.budgets")]:
        monkeypatch.delitem(sys.modules, name)
    assert sections.budget_modes() == ("topk", "topp", "mass")
    assert sections.default_budget().mode == sections.DEFAULT_MODE


@dataclasses.dataclass
class _AboveShare(Budget):
    """A plug-in mode that bounds nothing: every entry holding more than 1/8 of its row's mass."""

    mode = "above_share"

    def most_kept(self, kind):
        return None

    def select(self, columns, diagonals, start, end, scored_end, block_size):
        def above(entries):
            total = entries.scores.sum(-1, keepdim=True) if entries.total is None else entries.total
            return entries.scores * 8 > total

        return above(columns), above(diagonals)

    def describe(self):
        return "above 1/8 of the mass"


@dataclasses.dataclass
class _AboveShareBounded(_AboveShare):
    """The same selection, with a bound it never reaches."""

    mode = "above_share_bounded"

    def most_kept(self, kind):
        return 1 << 20


def test_a_mode_that_bounds_no_columns_runs(monkeypatch):
    """`most_kept` may say None (any number), as its docstring says: the layout's column bound, the document
    planner's row width and the memory model's columns took it as a number (TypeError at the first forward, #50).
    The layout equals that of the same selection under a bound it never reaches."""
    from hf_sparse_cp.attention.sequence import sequence_attention
    from hf_sparse_cp.attention.tokens import TokenMeta
    from hf_sparse_cp.config import sections
    from hf_sparse_cp.distributed.split.documents import kept_blocks_per_row
    from hf_sparse_cp.simulator.memory_model.presets import PRESETS
    from hf_sparse_cp.simulator.memory_model.settings import StepSettings
    from hf_sparse_cp.simulator.memory_model.step import predict_step_memory

    monkeypatch.setattr(sections, "_BUDGETS", dict(sections._registered()))
    for cls in (_AboveShare, _AboveShareBounded):
        sections.register_budget(cls)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 150, 16, generator=g, dtype=torch.float64) for _ in range(3))
    meta = TokenMeta.from_segments(torch.zeros(1, 150, dtype=torch.int32))
    outs = []
    for budget in (_AboveShare(), _AboveShareBounded()):
        cfg = SparseAttentionConfig(budget=budget, block_size=BS, min_seq_len=0, sink_tokens=2, local_window=4,
                                    last_q=16, attention_engine="reference")
        outs.append(sequence_attention(q, k, v, meta, cfg))
    assert torch.equal(outs[0][0], outs[1][0]) and float(outs[0][1]) == float(outs[1][1]) < 1.0
    unbounded = SparseAttentionConfig(budget=_AboveShare())
    assert kept_blocks_per_row(unbounded) is None
    assert predict_step_memory(PRESETS["qwen2.5-3b"], 1 << 16, StepSettings(pattern=unbounded)).peak_bytes > 0


@dataclasses.dataclass
class _AboveShareUnderstated(_AboveShare):
    """Every entry, with a bound of one."""

    mode = "above_share_understated"

    def most_kept(self, kind):
        return 1

    def select(self, columns, diagonals, start, end, scored_end, block_size):
        return torch.ones_like(columns.scores, dtype=torch.bool), torch.ones_like(diagonals.scores, dtype=torch.bool)


def test_a_mode_whose_selection_passes_its_own_bound_is_refused_naming_the_fix(monkeypatch):
    """Under CP each rank offers only a budget's `most_kept` best entries: a plug-in mode whose select kept more gave
    another pattern than one process's (logits 0.049 apart, silently, #50). Its selection is checked against the
    bound (one process too, so that both refuse alike)."""
    from hf_sparse_cp.attention.sequence import sequence_attention
    from hf_sparse_cp.attention.tokens import TokenMeta
    from hf_sparse_cp.config import sections

    monkeypatch.setattr(sections, "_BUDGETS", dict(sections._registered()))
    sections.register_budget(_AboveShareUnderstated)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 150, 16, generator=g, dtype=torch.float64) for _ in range(3))
    meta = TokenMeta.from_segments(torch.zeros(1, 150, dtype=torch.int32))
    cfg = SparseAttentionConfig(budget=_AboveShareUnderstated(), block_size=BS, min_seq_len=0, sink_tokens=2,
                                local_window=4, last_q=16, attention_engine="reference")
    with pytest.raises(ValueError, match=r"budget mode 'above_share_understated' \(_AboveShareUnderstated\) kept "
                                         r"\d+ (columns|diagonals) of a segment for one head, where its most_kept\("
                                         r"'(columns|diagonals)'\) says at most 1: .* Make most_kept return a bound"):
        sequence_attention(q, k, v, meta, cfg)


def test_the_registry_refuses_what_it_cannot_run(monkeypatch):
    """A plug-in mode without a method of the interface failed at its first forward with a bare
    NotImplementedError, one under a taken name replaced that mode silently (a built-in one too), and one without
    `mode` or @dataclass failed with AttributeError / TypeError of the registry's internals (#50): each is refused
    when registered, naming the fix. Registering a class again, or its redefinition (a notebook's cell run again),
    is not a conflict."""
    from hf_sparse_cp.attention.budgets import Budget as Base
    from hf_sparse_cp.config import sections

    monkeypatch.setattr(sections, "_BUDGETS", dict(sections._registered()))

    @dataclasses.dataclass
    class NoSelect(Base):
        mode = "no_select"

        def most_kept(self, kind):
            return 1

    with pytest.raises(TypeError, match="NoSelect does not implement describe, select: subclass"):
        sections.register_budget(NoSelect)
    with pytest.raises(TypeError, match="with abstract methods describe, select"):
        SparseAttentionConfig(budget=NoSelect())

    @dataclasses.dataclass
    class Shadow(TopK):
        """Inherits TopK's mode."""

    with pytest.raises(ValueError, match=r"budget mode 'topk' is already registered \(hf_sparse_cp.attention.budgets."
                                         r"ranked.TopK\); give .*Shadow another `mode`"):
        sections.register_budget(Shadow)
    assert sections.budget_class("topk") is TopK and sections.register_budget(TopK) is TopK

    for bad, error, match in (
            (TopK(), TypeError, "takes a budget mode's dataclass, not TopK"),
            (dataclasses.make_dataclass("NoMode", [], bases=(_AboveShare,), namespace={"mode": None}), ValueError,
             "NoMode has no `mode`"),
            (dataclasses.make_dataclass("Scored", [("last_q", int, 3)], bases=(_AboveShare,),
                                        namespace={"mode": "scored"}), ValueError,
             "field named 'last_q', which is the budget section's mode or a scoring field")):
        with pytest.raises(error, match=match):
            sections.register_budget(bad)
    again = dataclasses.make_dataclass("_AboveShare", [], bases=(Base,), namespace={
        "mode": "above_share", "__module__": __name__, "__qualname__": "_AboveShare",
        **{name: getattr(_AboveShare, name) for name in ("most_kept", "select", "describe")}})
    sections.register_budget(_AboveShare)
    assert sections.register_budget(again) is again and sections.budget_class("above_share") is again


@dataclasses.dataclass
class _AboveOwnShare(_AboveShare):
    """A plug-in mode with a field of its own, without help text (a plain dataclass field)."""

    mode = "above_own_share"
    share: float = 0.125


def test_a_registered_modes_fields_are_no_flags_whatever_was_imported_first(monkeypatch):
    """The flags list the built-in budget modes: a mode registered before the Trainer's arguments were built (a script
    that imports its plug-ins first) made its fields flags, and one without help text (`share: float = 0.125`) ended
    the import of `hf_sparse_cp.trainer.arguments` with KeyError: 'help' (#50). Its config files still read it."""
    from hf_sparse_cp.config import sections
    from hf_sparse_cp.trainer.arguments import pattern_flag_fields

    monkeypatch.setattr(sections, "_BUDGETS", dict(sections._registered()))
    sections.register_budget(_AboveOwnShare)
    names = [name for name, _, _ in pattern_flag_fields()]
    assert "share" not in names and "vertical_topk" in names
    mode_flag = next(hint for name, hint, _ in pattern_flag_fields() if name == "budget_mode")
    assert "above_own_share" not in str(mode_flag) and "'mass'" in str(mode_flag)
    assert sections.builtin_budget_modes() == ("topk", "topp", "mass")
    assert SparseAttentionConfig.from_dict({"budget_mode": "above_own_share", "share": 0.25}).budget.share == 0.25


@dataclasses.dataclass
class _OneMask(_AboveShare):
    """A selection of columns alone, not the (columns, diagonals) pair."""

    mode = "one_mask"

    def select(self, columns, diagonals, start, end, scored_end, block_size):
        return columns.scores > 0


@dataclasses.dataclass
class _Scores(_AboveShare):
    """The scores themselves, not bool masks."""

    mode = "scores"

    def select(self, columns, diagonals, start, end, scored_end, block_size):
        return columns.scores, diagonals.scores


def test_a_selection_of_the_wrong_kind_is_refused_naming_the_mode_and_what_select_returns(monkeypatch):
    """A plug-in's `select` returning one mask, or scores, ended in the marking of the layout ('Index tensor must have
    the same number of dimensions as self tensor', 'where expected condition to be a boolean tensor', #50)."""
    from hf_sparse_cp.attention.sequence import sequence_attention
    from hf_sparse_cp.attention.tokens import TokenMeta
    from hf_sparse_cp.config import sections

    monkeypatch.setattr(sections, "_BUDGETS", dict(sections._registered()))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 150, 16, generator=g, dtype=torch.float64) for _ in range(3))
    meta = TokenMeta.from_segments(torch.zeros(1, 150, dtype=torch.int32))
    for cls, got in ((_OneMask, r"returned torch.bool \[2, 150\]: "), (_Scores, r"returned torch.float64 \[2, 150\], "
                                                                                r"torch.float64 \[2, 150\]: ")):
        sections.register_budget(cls)
        cfg = SparseAttentionConfig(budget=cls(), block_size=BS, min_seq_len=0, sink_tokens=2, local_window=4,
                                    last_q=16, attention_engine="reference")
        with pytest.raises(TypeError, match=rf"budget mode '{cls.mode}' \({cls.__qualname__}.select\) {got}it must "
                                            r"return \(kept columns, kept diagonals\), two bool tensors"):
            sequence_attention(q, k, v, meta, cfg)
