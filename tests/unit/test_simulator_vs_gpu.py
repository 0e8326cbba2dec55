"""benchmarks/simulator_vs_gpu.py: which committed bench_e2e steps it compares with the simulator, and how it
matches a sparse step's layout (tiny lengths, a results folder written here)."""

import json

import pytest

from hf_sparse_cp.simulator.shapes import MODELS
from hf_sparse_cp.simulator.step_model import SPARSE_KERNELS

from benchmark_loader import load_benchmark

LAYERS = MODELS["qwen2.5-0.5b"].layers


def _run(tmp_path, name, rows, *, warmup=1, max_seq=32768, compile_=False, command=()):
    run = {"benchmark": "bench_e2e", "device": "NVIDIA H200", "command": ["bench_e2e.py", *command],
           "settings": {"warmup_steps": warmup, "max_seq": max_seq, "torch_compile": compile_}, "results": rows}
    (tmp_path / f"{name}_nvidia-h200_20261205.json").write_text(json.dumps(run))


def _sparse(seq, per_layer, **extra):
    return {"model": "0.5b", "variant": "sparse_cp", "seq_len": seq, "status": "ok", "step_s": 1.0,
            "kept_fraction": sum(per_layer) / len(per_layer),
            "kept_fraction_per_layer": {str(i): v for i, v in enumerate(per_layer)}, **extra}


def test_only_warm_uncompiled_steps_are_compared_and_a_sparse_step_keeps_its_sparse_layers_share(tmp_path):
    layer0_dense = [1.0] + [0.2] * (LAYERS - 1)
    profile = [{"name": "_forward_kernel", "ms": 3.0}, {"name": "_dq_kernel", "ms": 2.0},
               {"name": "nvjet_sm90_gemm", "ms": 9.0}]
    _run(tmp_path, "e2e", [_sparse(32768, layer0_dense, fused_ops={"choice": "liger"}, kernels=profile),
                           {"model": "0.5b", "variant": "sdpa+liger", "seq_len": 32768, "status": "ok", "step_s": 2.0},
                           {"model": "0.5b", "variant": "sdpa", "seq_len": 32768, "status": "oom"},
                           _sparse(65536, layer0_dense)])  # beyond max_seq: a longest-fit step, cold
    _run(tmp_path, "e2e-cold", [_sparse(32768, layer0_dense)], warmup=0)
    _run(tmp_path, "e2e-compile", [_sparse(32768, layer0_dense)], compile_=True)
    _run(tmp_path, "e2e-layer0", [_sparse(32768, [0.3] * LAYERS)], command=("--sparse_dense_first_layers", "0"))
    with load_benchmark("simulator_vs_gpu") as module:
        rows = module.measured_rows(tmp_path)
        assert [(r["file"].split("_")[0], r["variant"], r["seq"]) for r in rows] == [  # (files in name order)
            ("e2e-layer0", "sparse_cp", 32768), ("e2e", "sparse_cp", 32768), ("e2e", "sdpa+liger", 32768)]
        layer0, sparse, dense = rows
        assert sparse["kept"] == pytest.approx(0.2) and sparse["dense_first_layers"] == 1
        assert sparse["fused_ops"] == "liger" and dense["kept"] is None
        assert sparse["attention_kernels_ms"] == 5.0 and layer0["attention_kernels_ms"] is None  # (ours only)
        assert layer0["kept"] == pytest.approx(0.3) and layer0["dense_first_layers"] == 0
        without_layers = {k: v for k, v in _sparse(32768, layer0_dense).items() if k != "kept_fraction_per_layer"}
        assert module.sparse_layers_kept(without_layers, 1, LAYERS) == pytest.approx(0.2)

        predicted = module.predict(sparse)
        blocks = 32768 // 128
        assert abs(predicted["simulated_kept"] - 0.2) <= 1 / blocks  # (at most half a block diagonal's share away)
        assert set(predicted["predicted_s"]) == set(predicted["predicted_attention_kernels_ms"]) == set(SPARSE_KERNELS)
        assert all(0 < predicted["predicted_attention_kernels_ms"][k] < 1e3 * predicted["predicted_s"][k]
                   for k in SPARSE_KERNELS)
        assert predicted["predicted_over_measured"]["ours"] == pytest.approx(predicted["predicted_s"]["ours"])
        assert set(module.predict(dense)["predicted_s"]) == {"cudnn", "fa2"}
        with pytest.raises(SystemExit, match="nothing to compare"):
            module.main(["--results", str(tmp_path / "empty"), "--json", str(tmp_path / "out.json")])
