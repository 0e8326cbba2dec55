"""The helpers every benchmark shares (`hf_sparse_cp.testing.benchmarking`), on CPU: the kernel profile
behind a benchmark's figures, its text form, and where reports are written."""

import json

import pytest
import torch

from hf_sparse_cp.testing.benchmarking import ReportFile, format_profile, format_profiles, kernel_profile, write_report


def _step():
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0), requires_grad=True)
    return lambda: (a @ a).relu().sum().backward()


def test_kernel_profile_ranks_the_operators_and_folds_the_rest():
    step = _step()
    full = kernel_profile(step, "cpu", top=100)
    assert not any(k["name"].endswith("other kernels)") for k in full)
    times = [k["ms"] for k in full]
    assert times == sorted(times, reverse=True) and min(times) > 0
    mm = next(k for k in full if k["name"] == "aten::mm")  # not necessarily first: own times vary under load
    assert mm["calls"] >= 3  # one forward, two backward products
    assert sum(k["share"] for k in full) == pytest.approx(1.0)

    top = kernel_profile(step, "cpu", top=2)
    assert len(top) == 3 and top[-1]["name"].endswith("other kernels)")
    assert sum(k["share"] for k in top) == pytest.approx(1.0)


def test_format_profile_one_line_per_kernel():
    kernels = [{"name": "_dq_kernel", "ms": 3.5, "calls": 1, "share": 0.7},
               {"name": "x" * 200, "ms": 1.5, "calls": 2, "share": 0.3}]
    text = format_profile("S=128K vs@5% ours", kernels, width=40)
    lines = text.splitlines()
    assert lines[0] == "S=128K vs@5% ours" and len(lines) == 3
    assert "_dq_kernel" in lines[1] and "3.500 ms" in lines[1] and "70.0%" in lines[1]
    assert "x" * 37 + "..." in lines[2] and "x" * 41 not in lines[2]


def test_format_profiles_titles_each_profiled_row_after_a_blank_line():
    kernels = [{"name": "_dq_kernel", "ms": 3.5, "calls": 1, "share": 1.0}]
    rows = [{"name": "a", "kernels": kernels}, {"name": "b"}, {"name": "c", "kernels": kernels}]
    text = format_profiles(rows, lambda r: f"row {r['name']}")
    assert text == f"\n{format_profile('row a', kernels)}\n\n{format_profile('row c', kernels)}\n"
    assert format_profiles([{"name": "b"}], lambda r: "") == ""


def test_write_report_names_the_file_after_kind_and_device(tmp_path):
    out = write_report({"device": "NVIDIA H100 80GB HBM3", "x": 1}, tmp_path, "attention")
    assert out.parent == tmp_path and out.name.startswith("attention_nvidia-h100-80gb-hbm3_")
    assert json.loads(out.read_text())["x"] == 1
    explicit = write_report({"device": "cpu"}, tmp_path, "attention", str(tmp_path / "sub" / "r.json"))
    assert explicit == tmp_path / "sub" / "r.json" and explicit.exists()


def test_report_file_rewrites_the_file_its_first_write_named(tmp_path):
    out = ReportFile(tmp_path, "attention")
    first = out.write({"device": "NVIDIA H100", "complete": False})
    second = out.write({"device": "NVIDIA H100", "complete": True})
    assert first == second and list(tmp_path.iterdir()) == [first]
    assert json.loads(first.read_text())["complete"] is True
