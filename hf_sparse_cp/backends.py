"""Optional dependencies and the choice between implementations, in one place.

Optional packages (flash-attn, liger-kernel, matplotlib) are probed once, on first use, and imported only
then. Where the plugin can run one of several implementations, an environment variable may force
one (`choose_backend`): an explicit argument wins, then the variable, then "auto".
"""

from __future__ import annotations

import functools
import importlib
import os


@functools.cache
def is_available(module: str, attribute: str | None = None) -> bool:
    """True when `module` imports (and has `attribute`, if given); checked once per process."""
    try:
        imported = importlib.import_module(module)
    except ImportError:
        return False
    return attribute is None or hasattr(imported, attribute)


# glibc's malloc set to keep freed memory for reuse (the CPU analogue of PyTorch's caching allocator on a GPU), as
# `GLIBC_TUNABLES`, which a process reads at start. By default glibc hands every allocation above its mmap threshold
# (at most 32 MiB) fresh pages from the kernel and returns them on free, so large CPU tensors pay page faults at
# every use: the simulator's plans (a third of `hf-sparse-cp simulate`'s CPU time) and CPU benchmark runs.
RECYCLING_MALLOC = "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296"

# The extra that brings matplotlib, for every figure the plugin draws.
PLOT_EXTRA = "pip install 'hf-sparse-cp[plot]'"
# Triton is installed only where its kernels can run (torch's CUDA builds on Linux bring it); where it is missing,
# CPU training runs the PyTorch reference and CUDA training FlexAttention, and asking for the kernels names this.
TRITON_INSTALL = ("pip install 'hf-sparse-cp[cuda]' (Triton >= 3.4; Linux on x86_64 or aarch64 with a CUDA build of "
                  "torch, whose wheels usually bring it)")


def is_triton_available() -> bool:
    """Whether a Triton our kernels run on is installed: >= 3.4, whose host-side tensor descriptors
    (`triton.tools.tensor_descriptor`) they use. An older one (torch 2.6's 3.2, 2.7's 3.3) counts as missing."""
    return is_available("triton.tools.tensor_descriptor")


def require_triton(what: str) -> None:
    """Raise ImportError, naming the install, when Triton is missing and `what` (e.g. "The attention engine
    'triton'") needs it."""
    if not is_triton_available():
        raise ImportError(f"{what} needs Triton, not installed or too old: {TRITON_INSTALL}; or set the attention "
                          "engine to 'auto' (--sparse_attention_engine auto: FlexAttention on CUDA, the PyTorch "
                          "reference on CPU).")


def require_matplotlib() -> None:
    """Raise ImportError, naming the extra to install, when matplotlib is missing (imported here, the figures
    need it next)."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        raise ImportError(f"Drawing hf-sparse-cp's figures needs matplotlib: {PLOT_EXTRA}") from None


def choose_backend(what: str, env_var: str, choices: tuple[str, ...], given: str | None = None) -> str:
    """The backend to use for `what`: `given`, else `$env_var`, else "auto" (which must be the first
    of `choices`); an unknown name is a ValueError that lists the choices."""
    backend = given or os.environ.get(env_var) or choices[0]
    if backend not in choices:
        raise ValueError(
            f"{what} backend {backend!r} is unknown (from the argument or ${env_var}); use one of {choices}."
        )
    return backend
