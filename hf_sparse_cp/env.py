"""The environment report: device, library versions and allocator settings, printed by
`hf-sparse-cp env` and recorded in every benchmark's JSON."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path

import torch

# Packages the report lists besides torch (import names); None when not installed.
PACKAGES = ("transformers", "accelerate", "peft", "trl", "datasets", "triton", "liger_kernel", "flash_attn")


def _version(module: str) -> str | None:
    """The installed version of the distribution of `module`, read from its metadata: importing peft or
    datasets only to report them would cost every benchmark process seconds."""
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
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


def environment(device: torch.device | str | None = None) -> dict[str, str | None]:
    """Device (default: the current CUDA device, else the CPU), versions and allocator settings."""
    from .version import __version__

    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    return {
        "device": device_name(device),
        "device_type": device.type,
        "hf_sparse_cp": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        **{name: _version(name) for name in PACKAGES},
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        # the tile table the kernels launch from (`hf_sparse_cp.kernels.configs.TILES_ENV`; named here, not
        # imported: this report works without Triton)
        "HF_SPARSE_CP_TILES": os.environ.get("HF_SPARSE_CP_TILES"),
    }
