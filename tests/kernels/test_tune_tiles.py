"""Tile overrides (`kernels.configs.tiles_override`) and the CPU-testable parts of
benchmarks/tune_tiles.py: its candidate grids, ranking and table; the tuning itself needs a GPU."""

import dataclasses
import json
import sys

import pytest
import torch

from hf_sparse_cp.kernels import configs
from hf_sparse_cp.kernels.configs import Tiles

from benchmark_loader import load_benchmark


@pytest.fixture(scope="module")
def tune():
    with load_benchmark("tune_tiles") as module:
        yield module


def test_override_applies_inside_the_block_only_and_nests():
    default, forward = configs.dq_tiles(128, 128, on_gpu=True), configs.forward_tiles(128, 128, on_gpu=True)
    with configs.tiles_override(dq=Tiles(64, 256, 64, 4, 2)):
        assert configs.dq_tiles(128, 128, on_gpu=True) == Tiles(64, 128, 64, 4, 2)  # capped at the block size
        assert configs.dq_tiles(32, 64, on_gpu=False) == Tiles(32, 32, 64, 4, 2)  # any device
        assert configs.forward_tiles(128, 128, on_gpu=True) == forward  # other kernels keep theirs
        with configs.tiles_override(forward=Tiles(64, 32, 64, 4, 2)):
            assert configs.forward_tiles(128, 128, on_gpu=True) == Tiles(64, 32, 64, 4, 2)
            assert configs.dq_tiles(128, 128, on_gpu=True) == Tiles(64, 128, 64, 4, 2)
        assert configs.forward_tiles(128, 128, on_gpu=True) == forward
    assert configs.dq_tiles(128, 128, on_gpu=True) == default


def test_override_is_undone_when_the_block_raises():
    default = configs.dkdv_tiles(128, 128, on_gpu=True)
    with pytest.raises(RuntimeError), configs.tiles_override(dkdv=Tiles(16, 64, 64, 4, 2)):
        raise RuntimeError
    assert configs.dkdv_tiles(128, 128, on_gpu=True) == default


def test_override_refuses_unknown_kernels():
    with pytest.raises(ValueError, match="unknown kernels"), configs.tiles_override(fwd=Tiles(64, 64, 64, 4, 2)):
        pass


@pytest.mark.parametrize("kernel,tiles,field,allowed", [
    ("forward", Tiles(48, 64, 64, 8, 2), "block_m=48", "a power of two."),
    ("dq", Tiles(64, 96, 64, 8, 2), "block_n=96", "a power of two."),
    ("forward", Tiles(64, 0, 64, 8, 2), "block_n=0", "a power of two."),  # 0 only where the kernel does not read it
    ("dq", Tiles(64, 64, 24, 8, 2), "block_c=24", "a power of two."),
    ("columns", Tiles(64, 0, 0, 8, 2, query_steps=16), "block_c=0", "a power of two."),
    ("columns", Tiles(64, 48, 64, 8, 2, query_steps=16), "block_n=48", "a power of two or 0"),
    ("dkdv", Tiles(64, 128, 12, 8, 3), "block_c=12", "a power of two or 0"),
    ("columns", Tiles(64, 0, 64, 8, 2, query_steps=3), "query_steps=3", "a power of two."),
    ("columns", Tiles(64, 0, 64, 8, 2, query_steps=0), "query_steps=0", "a power of two."),
    ("dq", Tiles(64, 64, 64, 8, 2, query_steps=-2), "query_steps=-2", "a power of two."),
    ("forward", Tiles(64, 64, 64, 6, 2), "num_warps=6", "a power of two."),
    ("dkdv", Tiles(64, 128, 64, 8, 0), "num_stages=0", "an integer of at least 1."),
])
def test_override_refuses_tiles_a_kernel_cannot_launch(kernel, tiles, field, allowed):
    """The refusal names the kernel, the field and its value, and what is allowed; nothing is overridden, not
    even the valid tiles given beside (dk/dv's, unless those are the refused ones)."""
    default = configs.dkdv_tiles(128, 128, on_gpu=True)
    with pytest.raises(ValueError) as refused, configs.tiles_override(**({"dkdv": Tiles(32, 64, 0, 4, 2)} |
                                                                          {kernel: tiles})):
        pass
    assert str(refused.value).startswith(f"{kernel} tiles: {field};") and allowed in str(refused.value)
    assert configs.dkdv_tiles(128, 128, on_gpu=True) == default
    assert configs.column_tiles(128) is None


@pytest.mark.parametrize("kernel", configs.KERNELS + configs.OPTIONAL_KERNELS)
def test_every_candidate_passes_the_override_checks(kernel):
    """Every tile candidate, at each layout block and head_dim, with 4 and 8 warps, is accepted as an override
    (the columns' with block_n 0, which that kernel does not read)."""
    cands = {t for bs in (64, 128) for d in (64, 128) for t in configs.tile_candidates(kernel, bs, d, warps=(4, 8))}
    assert cands
    for t in cands:
        with configs.tiles_override(**{kernel: t}):
            pass
    if kernel == "columns":
        assert {t.block_n for t in cands} == {0}


@pytest.mark.parametrize("kernel", configs.KERNELS)
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_candidates_fit_the_block_and_include_the_current_tiles(tune, kernel, block_size, head_dim):
    cands = configs.tile_candidates(kernel, block_size, head_dim)
    assert len(set(cands)) == len(cands) >= 3
    for t in cands:
        for size in (t.block_m, t.block_n, t.block_c):
            assert size & (size - 1) == 0
        assert t.block_m <= block_size and t.block_n <= block_size
    # 4 warps spill far more at head_dim 128 (kernel_resources --candidates); both are timed at 64
    assert {t.num_warps for t in cands} == ({8} if head_dim > 64 else {4, 8})
    assert tune.current_tiles(kernel, block_size, head_dim) in cands
    separate = {t.separate_columns for t in cands}
    assert separate == ({False, True} if kernel == "dq" else {False})
    # the key blocks through TMA descriptors where the kernel has them (forward, dq)
    assert {t.kv_descriptors for t in cands} == ({False} if kernel == "dkdv" else {False, True})
    assert {t.tile_major for t in cands} == {False, True}  # either grid order
    # masked column steps with and without their own read of the slots where the kernel has columns (forward, dq)
    assert {t.column_meta_reload for t in cands} == ({False} if kernel == "dkdv" else {False, True})
    assert {t.lean_index for t in cands} == {False, True}  # either row addressing
    both = configs.tile_candidates(kernel, block_size, head_dim, warps=(4, 8))
    assert set(cands) <= set(both) and {t.num_warps for t in both} == {4, 8}


@pytest.mark.parametrize("kernel", configs.KERNELS)
def test_the_short_list_holds_the_launched_tiles_among_the_candidates(tune, kernel):
    """`--shortlist` (the quick GPU call) times the launched tiles against a few other candidates."""
    short = configs.SHORTLIST[kernel]
    assert tune.current_tiles(kernel, 128, 128) in short and len(set(short)) == len(short) >= 2
    assert set(short) <= set(configs.tile_candidates(kernel, 128, 128))


@pytest.mark.parametrize("kernel", configs.KERNELS + configs.OPTIONAL_KERNELS)
def test_heads_above_128_lanes_have_a_short_list_of_their_own(tune, kernel):
    """`--shortlist` at head_dim 160-256 times the wide-head tiles (`WIDE_HEAD_TILES`, the launched ones) and a few
    others that pass the override checks, not the head_dim-128 list (whose 16-bit tiles need 256-321 KB of shared
    memory there); up to 128 lanes the list is `SHORTLIST`."""
    for head_dim in (160, 256):
        short = configs.shortlist(kernel, head_dim)
        assert short is configs.WIDE_HEAD_SHORTLIST[kernel] and len(set(short)) == len(short) >= 1
        if kernel in configs.KERNELS:
            assert tune.current_tiles(kernel, 128, head_dim) in short and len(short) >= 2
        for tiles in short:
            configs.check_tiles(kernel, tiles)
            assert configs.narrowest_wgmma_n(kernel, tiles, head_dim) >= configs.MIN_WGMMA_N
    assert configs.shortlist(kernel, 128) is configs.SHORTLIST[kernel] is configs.shortlist(kernel, 64)


def test_candidates_refuse_unknown_kernels():
    with pytest.raises(ValueError, match="unknown kernel"):
        configs.tile_candidates("fwd", 128, 128)


def _row(kernel, tiles, status, ms=None, current=False, reason=""):
    row = {"kernel": kernel, "tiles": dataclasses.asdict(tiles), "current": current, "status": status}
    return {**row, "ms": ms} if status == "ok" else {**row, "reason": reason}


def test_rank_puts_the_fastest_correct_tiles_first_and_failures_last(tune):
    rows = [
        _row("dq", Tiles(128, 64, 64, 8, 3), "ok", 2.0, current=True),
        _row("dq", Tiles(64, 32, 64, 4, 2), "wrong", reason="rel. RMS 1e-1"),
        _row("dq", Tiles(64, 64, 64, 8, 3), "ok", 1.5),
        _row("dq", Tiles(128, 128, 64, 8, 4), "error", reason="OutOfResources: shared memory"),
    ]
    ranked = tune.rank(rows)
    assert [r["status"] for r in ranked] == ["ok", "ok", "wrong", "error"]
    assert ranked[0]["ms"] == 1.5
    table = tune.format_table("dq", rows)
    lines = table.splitlines()
    assert "1.33" in lines[2] and "1.00" in lines[3] and "current" in lines[3]
    assert "shared memory" in table and "wrong" in table



def test_a_result_with_nan_or_inf_is_wrong_never_ok(tune):
    """A candidate whose result holds a NaN (its relative RMS is NaN, which passes no bound and fails none) or an
    inf is "wrong": not timed, never ranked (the H200's warp-specialized dq candidate was recorded "ok" with a
    NaN). The forward step here is a stand-in whose output depends on the tiles in force, no kernel runs."""
    args = tune.TuneTilesArguments(seq_len=64, num_verticals=4, num_q_heads=2, num_kv_heads=1, head_dim=16,
                                   block_size=32, warmup=0, repeats=1)
    tuner = tune.Tuner(args, device="cpu")
    current = tune.current_tiles("forward", 32, 16, on_gpu=False)
    poisoned = {Tiles(16, 32, 32, 1, 1): float("nan"), Tiles(32, 16, 16, 1, 1): float("inf")}
    ok = Tiles(16, 16, 16, 1, 1)
    assert current not in poisoned and ok != current

    def forward():
        out = torch.ones(1, 2, 64, 16)
        out[0, 1, 5, 3] = poisoned.get(configs.forward_tiles(32, 16, on_gpu=False), 1.0)
        return out, torch.zeros(1, 2, 64)

    tuner.forward = forward
    rows = tuner.run_kernel("forward", [current, *poisoned, ok])
    assert [r["status"] for r in rows] == ["ok", "wrong", "wrong", "ok"], rows
    assert "nan" in rows[1]["reason"] and "inf" in rows[2]["reason"]
    assert all("ms" not in r for r in rows[1:3]) and rows[3]["rel_rms"] == 0.0
    assert [r["status"] for r in tune.rank(rows)] == ["ok", "ok", "wrong", "wrong"]

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_tuning_refuses_without_gpu(tune):
    with pytest.raises(SystemExit, match="GPU benchmark"):
        tune.main(["--seq_len", "1024"])


def _toy_tuner(module_path: str):
    """In the interpreter worker: benchmarks/tune_tiles.py loaded from `module_path`, and its tuner at toy size."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tune_tiles", module_path)
    tune = importlib.util.module_from_spec(spec)
    sys.modules["tune_tiles"] = tune
    spec.loader.exec_module(tune)
    # 3 layout blocks, one diagonal beside the main one (round(0.5 * 3) - 1), 2 query heads on 1
    args = tune.TuneTilesArguments(seq_len=96, density=0.5, num_verticals=12, num_q_heads=2, num_kv_heads=1,
                                   head_dim=16, block_size=32, warmup=0, repeats=1)
    return tune, tune.Tuner(args, device="cpu")


def _tune_on_cpu(module_path: str):
    """In the interpreter worker: the tuner's runs at toy size, each kernel with the current tiles
    and one other candidate."""
    tune, tuner = _toy_tuner(module_path)
    others = {"forward": Tiles(16, 32, 32, 1, 1), "dq": Tiles(16, 32, 32, 1, 1, separate_columns=True),
              "dkdv": Tiles(32, 16, 16, 1, 1)}
    saved = []  # what main would write after each candidate: (results so far, kernels with a best)
    save = lambda: saved.append((len(tuner.rows), sorted(tune.build_report(tuner, {}, complete=False)["best"])))
    rows = [row for kernel, other in others.items()
            for row in tuner.run_kernel(kernel, [tune.current_tiles(kernel, 32, 16, on_gpu=False), other], save)]
    return rows, saved


@pytest.fixture(scope="module")
def interp():
    """One interpreter worker for the module's tuning runs."""
    from hf_sparse_cp.testing.interpreter import interpreter_pool

    with interpreter_pool() as pool:
        yield pool


def test_tuner_times_each_candidate_and_checks_it_computes_the_same(tune, interp):
    rows, saved = interp.apply(_tune_on_cpu, (tune.__file__,))
    assert [n for n, _ in saved] == [1, 2, 3, 4, 5, 6]  # a report after every candidate
    assert saved[1][1] == ["forward"] and saved[-1][1] == ["dkdv", "dq", "forward"]
    assert [r["kernel"] for r in rows] == ["forward", "forward", "dq", "dq", "dkdv", "dkdv"]
    assert [r["current"] for r in rows] == [True, False] * 3
    for r in rows:
        assert r["status"] == "ok", r
        assert r["ms"] > 0 and r["rel_rms"] <= tune.SAME_RESULT_RTOL
    assert "current" in tune.format_table("dq", rows[2:4])


def _tune_columns_on_cpu(module_path: str):
    """In the interpreter worker: the columns kernel's tuning run at toy size with one candidate, its rows
    and table."""
    tune, tuner = _toy_tuner(module_path)
    rows = tuner.run_kernel("columns", [Tiles(16, 0, 16, 1, 1, query_steps=2)])
    return rows, tune.format_table("columns", rows)


def test_the_columns_kernel_is_timed_against_the_dq_kernels_atomics(tune, interp):
    """`--kernels columns`: the launched backward (the dq kernel's column atomics, the "current" row with the dq
    tiles) first, then each key-major candidate, checked to compute the same and timed."""
    rows, table = interp.apply(_tune_columns_on_cpu, (tune.__file__,))
    assert [r["kernel"] for r in rows] == ["columns"] * 2 and [r["current"] for r in rows] == [True, False]
    assert rows[0]["tiles"] == dataclasses.asdict(tune.current_tiles("dq", 32, 16, on_gpu=False))
    assert rows[1]["tiles"]["query_steps"] == 2
    for r in rows:
        assert r["status"] == "ok", r
        assert r["ms"] > 0 and r["rel_rms"] <= tune.SAME_RESULT_RTOL
    assert rows[0]["rel_rms"] == 0.0 < rows[1]["rel_rms"]  # the candidate's sums differ in order only
    assert "atomics" in table and len(table.splitlines()) == 4


@pytest.mark.parametrize("head_dim", [64, 128])
def test_columns_candidates_are_full_width_and_hold_the_short_list(tune, head_dim):
    cands = configs.tile_candidates("columns", 128, head_dim)
    assert len(set(cands)) == len(cands) >= 4 and {t.block_c for t in cands} == {64}
    assert all(configs.narrowest_wgmma_n("columns", t, head_dim) >= configs.MIN_WGMMA_N for t in cands)
    assert set(configs.SHORTLIST["columns"]) <= set(configs.tile_candidates("columns", 128, 128))
    assert configs.column_tiles(128) is None  # launched only under an override


# ---- the tile table: a tuning run's chosen tiles, launched where they were measured (configs.TILES_ENV) --------

def _table(path, tiles, device="NVIDIA H200", head_dim=128, block_size=128, dtype="bfloat16"):
    chosen = {"applies_to": {"device": device, "head_dim": head_dim, "block_size": block_size, "dtype": dtype},
              "min_gain": 0.02, "tiles": {k: dataclasses.asdict(t) for k, t in tiles.items()}}
    path.write_text(json.dumps({"benchmark": "tune_tiles", "chosen": chosen}))
    return path


@pytest.fixture
def on_h200(monkeypatch):
    """The current CUDA device reads as an H200 (configs checks the GPU a table was measured on)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")


def test_the_tile_table_applies_only_to_the_gpu_and_geometry_it_was_measured_on(tmp_path, monkeypatch, on_h200):
    fwd, cols = Tiles(128, 64, 64, 8, 3, tile_major=True), Tiles(64, 0, 64, 8, 2, query_steps=16)
    default = configs.forward_tiles(128, 128, True, torch.bfloat16)
    others = ((128, 64, True, torch.bfloat16), (64, 128, True, torch.bfloat16), (128, 128, True, torch.float16),
              (128, 128, True, torch.float32), (128, 128, True, None))
    untabled = [configs.forward_tiles(*other) for other in others]
    monkeypatch.setenv(configs.TILES_ENV, str(_table(tmp_path / "tiles.json", {"forward": fwd, "columns": cols})))
    assert configs.forward_tiles(128, 128, True, torch.bfloat16) == fwd
    assert configs.column_tiles(128, 128, True, torch.bfloat16) == cols
    assert configs.dq_tiles(128, 128, True, torch.bfloat16) == configs.dq_tiles(128, 128, True)  # not in the table
    for other, tiles in zip(others, untabled):
        assert configs.forward_tiles(*other) == tiles, other
    assert configs.forward_tiles(128, 128, False, torch.bfloat16) == configs.forward_tiles(128, 128, False)
    assert configs.column_tiles(128) is None
    with configs.tiles_override(forward=Tiles(64, 64, 64, 4, 2)):  # an override (a tuning run) comes first
        assert configs.forward_tiles(128, 128, True, torch.bfloat16) == Tiles(64, 64, 64, 4, 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    assert configs.forward_tiles(128, 128, True, torch.bfloat16) == default
    monkeypatch.delenv(configs.TILES_ENV)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    assert configs.forward_tiles(128, 128, True, torch.bfloat16) == default


def test_the_launchers_launch_the_tile_tables_tiles(tmp_path, monkeypatch, on_h200):
    """The forward and backward launchers pass their dtype: a launch recorded on meta tensors (bf16, head_dim 128,
    layout block 128) takes the table's tiles, the key-major column kernel included."""
    from hf_sparse_cp.testing import sm90

    tm, kv = Tiles(128, 64, 64, 8, 3, tile_major=True), Tiles(64, 128, 64, 8, 3, tile_major=True)
    cols = Tiles(64, 0, 64, 8, 2, query_steps=16)
    table = {"forward": tm, "dq": tm, "dkdv": kv, "columns": cols}
    monkeypatch.setenv(configs.TILES_ENV, str(_table(tmp_path / "t.json", table)))
    launches = sm90.recorded_launches(sm90.Launch())
    for name in ("forward", "forward_merge", "dq", "dq_column_grads", "dkdv", "dkdv_no_columns"):
        _, _, kwargs = launches[name]
        expected = dataclasses.replace(kv, block_c=0) if "dkdv" in name else tm  # (dk/dv take no column step)
        assert kwargs["TILE_MAJOR"] and sm90._tiles_of(kwargs) == expected, name
    assert "columns" in launches and sm90._tiles_of(launches["columns"][2]).query_steps == 16
    monkeypatch.delenv(configs.TILES_ENV)
    launches = sm90.recorded_launches(sm90.Launch())
    assert not launches["forward"][2]["TILE_MAJOR"] and "columns" not in launches


@pytest.mark.parametrize("content", ["{", '{"chosen": {}}', '{"chosen": {"applies_to": {"device": "x", "head_dim": '
                                     '128, "block_size": 128, "dtype": "bfloat16"}, "tiles": {"fwd": {}}}}'],
                         ids=["not-json", "no-geometry", "unknown-kernel"])
def test_a_tile_table_that_is_not_one_is_refused_naming_the_variable(tmp_path, monkeypatch, on_h200, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    monkeypatch.setenv(configs.TILES_ENV, str(path))
    with pytest.raises(ValueError, match="HF_SPARSE_CP_TILES.*not a tile table"):
        configs.forward_tiles(128, 128, True, torch.bfloat16)
    monkeypatch.setenv(configs.TILES_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="does not exist"):
        configs.forward_tiles(128, 128, True, torch.bfloat16)


def test_a_candidate_is_chosen_only_when_correct_and_faster_by_the_margin(tune):
    cur, a, b = Tiles(128, 64, 64, 8, 3), Tiles(128, 64, 64, 8, 3, tile_major=True), Tiles(128, 32, 64, 8, 3)
    rows = lambda ms_a, status_b="wrong": [_row("dq", cur, "ok", 10.0, current=True), _row("dq", a, "ok", ms_a),
                                          _row("dq", b, status_b, 1.0) if status_b == "ok" else _row("dq", b, status_b)]
    assert tune.choose(rows(9.0))["tiles"] == dataclasses.asdict(a)
    assert tune.choose(rows(9.9)) is None  # within the margin: the launched tiles stay
    assert tune.choose(rows(11.0)) is None
    assert tune.choose(rows(9.0, "ok"))["tiles"] == dataclasses.asdict(b)  # the fastest correct one
    assert tune.choose(rows(9.0)[1:]) is None  # the launched tiles were not timed: nothing to beat
    failed = [_row("dq", cur, "error", current=True, reason="x"), _row("dq", a, "ok", 1.0)]
    assert tune.choose(failed) is None


def test_each_kernel_is_tuned_with_the_earlier_kernels_chosen_tiles(tune, monkeypatch):
    """The dq candidates run (checked and timed) with the forward's chosen tiles in force, and the fastest correct
    one becomes dq's choice; the report's `chosen` holds both with the geometry they were measured on. Stand-in
    steps, no kernel runs: the timing reads the tiles in force."""
    args = tune.TuneTilesArguments(seq_len=64, num_verticals=4, num_q_heads=2, num_kv_heads=1, head_dim=16,
                                   block_size=32, warmup=0, repeats=2)  # (2: timed through time_ms, the stand-in)
    tuner = tune.Tuner(args, device="cpu")
    fwd = Tiles(16, 16, 16, 1, 1, tile_major=True)
    current, faster = tune.current_tiles("dq", 32, 16, on_gpu=False), Tiles(16, 16, 16, 1, 1, tile_major=True)
    tuner.chosen = {"forward": fwd}
    seen = []

    def backward(out, lse):
        seen.append(configs.forward_tiles(32, 16, on_gpu=False))
        return torch.ones(1, 2, 64, 16), torch.ones(1, 1, 64, 16), torch.ones(1, 1, 64, 16)

    tuner.forward = lambda: (torch.ones(1, 2, 64, 16), torch.zeros(1, 2, 64))
    tuner.backward = backward
    monkeypatch.setattr(tune, "time_ms", lambda *a: 1.0 if configs.dq_tiles(32, 16, on_gpu=False) == faster else 2.0)
    rows = tuner.run_kernel("dq", [current, faster])
    assert [r["status"] for r in rows] == ["ok", "ok"] and set(seen) == {fwd}
    assert tuner.chosen == {"forward": fwd, "dq": faster}
    report = tune.build_report(tuner, {"device": "CPU x"}, complete=True)
    assert report["chosen"]["applies_to"] == {"device": "CPU x", "head_dim": 16, "block_size": 32, "dtype": "float32"}
    assert report["chosen"]["tiles"] == {"forward": dataclasses.asdict(fwd), "dq": dataclasses.asdict(faster)}
