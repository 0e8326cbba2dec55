"""Smoke test of benchmarks/bench_smet.py with tiny sizes on CPU."""

import json

import pytest

from benchmark_loader import load_benchmark


@pytest.fixture(scope="module")
def bench():
    with load_benchmark("bench_smet") as module:
        yield module


@pytest.mark.usefixtures("single_thread")
def test_tiny_run_prints_and_writes_the_report(tmp_path, bench, capsys):
    out = tmp_path / "smet.json"
    report = bench.main([
        "--hidden_size", "80", "--intermediate_size", "160", "--num_hidden_layers", "1", "--num_attention_heads", "4",
        "--num_key_value_heads", "2", "--vocab_size", "64", "--block_size", "8", "--densities", "0.5", "0.1",
        "--seq_len", "16", "--warmup_steps", "1", "--timed_steps", "1", "--device", "cpu", "--output", str(out),
    ])
    assert "vs AdamW" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    for key in ("device", "torch", "transformers", "hf_sparse_cp", "date", "settings"):
        assert saved[key]
    adam, half, tenth = saved["rows"]
    assert adam["optimizer"] == "adamw" and half["density"] == 0.5 and tenth["active_fraction"] == pytest.approx(0.1)
    # hidden 80 / intermediate 160 in blocks of 8: 10 or 20 blocks per row, so 0.1 is exact.
    assert 0.1 < tenth["sparse_state_vs_adamw"] <= 0.15 < half["sparse_state_vs_adamw"] <= 0.6
    assert tenth["state_bytes"] < half["state_bytes"] < adam["state_bytes"]
    assert 0 < tenth["index_bytes"] < tenth["sparse_state_bytes"]
    assert all(row["optimizer_step_ms"] > 0 and row["train_step_ms"] > 0 for row in saved["rows"])
