"""What every benchmark report records about the machine it ran on, and how it prints its targets."""

from __future__ import annotations

import importlib
import os
import platform
from pathlib import Path

import torch


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return None


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU model with its core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("model name")]
        name = models[0] if models else name
    return f"CPU {name} ({os.cpu_count()} cores)"


def environment(device: torch.device) -> dict:
    """Device, library versions and allocator settings, for the JSON a benchmark writes."""
    import hf_sparse_cp

    return {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "accelerate": _version("accelerate"),
        "liger_kernel": _version("liger_kernel"),
        "flash_attn": _version("flash_attn"),
        "hf_sparse_cp": hf_sparse_cp.__version__,
        "python": platform.python_version(),
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }


def format_targets(targets: list[dict]) -> str:
    """One line per target of a report ({target, required, measured, pass}): the measured value and
    PASS, MISS or "not measured" (pass None: the run did not measure it)."""
    lines = []
    for t in targets:
        verdict = "not measured" if t["pass"] is None else ("PASS" if t["pass"] else "MISS")
        value = t["measured"]
        shown = "" if value is None else (f"{value:.3f} " if isinstance(value, float) else f"{value} ")
        lines.append(f"{t['target']}: {shown}(required {t['required']}) {verdict}")
    return "\n".join(lines)
