"""benchmarks/architecture_sweep.py, which checks every causal-LM type against the plugin's rule (sparse_cp with
every block kept equals sdpa, or a refusal naming the fix), gives its verdicts: a routed model is ok (Llama; DBRX,
whose sizes live in sub-configs of its own), one whose attention is its own code is refused."""

import json

from benchmark_loader import load_benchmark


def test_the_sweep_gives_each_type_its_outcome(tmp_path, capsys):
    out = tmp_path / "sweep.jsonl"
    with load_benchmark("architecture_sweep") as sweep:
        sweep.main(["--types", "llama,bloom,dbrx", "--out", str(out), "--timeout", "600"])
    results = {r["type"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert results["llama"]["outcome"] == "ok", results["llama"]
    assert results["llama"]["logits_rel"] <= 1e-12 and results["llama"]["cp_check"] == "pass"
    assert min(results["llama"]["sparse_kept"].values()) < 1.0  # (the sparse pattern ran)
    assert results["bloom"]["outcome"] == "refused" and "--sparse_attention false" in results["bloom"]["msg"]
    assert results["dbrx"]["outcome"] == "ok", results["dbrx"]  # (its tiny model untied, its sub-configs sized)
    assert results["dbrx"]["logits_rel"] <= 1e-12 and results["dbrx"]["cp_check"] == "pass"
    assert "refused: 1: bloom" in capsys.readouterr().out
