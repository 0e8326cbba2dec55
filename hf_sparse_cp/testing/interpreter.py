"""Running the kernels on CPU tensors through Triton's interpreter (tests and debugging).

`@triton.jit` decides at decoration time whether a function is compiled or interpreted, by
reading TRITON_INTERPRET (through `triton.knobs` in Triton 3.4 and later, 3.6 and 3.9
included). Triton's own library functions (`tl.max`, `tl.sum`, ...) are `@triton.jit` functions
too, decorated when `triton` is first imported, and an interpreted kernel cannot call a compiled
one. So the variable must be set before the process imports triton at all; setting it inside a
running test session would come too late (or, set early, turn every Triton kernel of the
session into Python). `interpreter_pool()` therefore starts a separate worker process with the
variable set from its start: functions sent to it run the kernels under the interpreter, and
the calling process is left untouched.

Limits of the interpreter: fp32 and fp16 work; bf16 matrix products do not (numpy has no bf16,
and Triton's interpreter multiplies the raw bits), so bf16 is checked on a GPU only. Triton 3.6
and older cannot interpret loops bounded by a loaded value under numpy 2.4 and newer
(triton-lang/triton#9171); `interpreter_pool()` refuses that pair up front, naming the fix.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from collections.abc import Iterator

_ENV_LOCK = threading.Lock()


def interpreter_blocker(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's interpreter cannot run these kernels with these versions, or None if it can.

    Before Triton 3.7 the interpreter turns a loaded scalar into a Python int with `int()` on a
    one-element array, which numpy refuses from 2.4 on; every kernel loop bounded by a layout count
    would fail deep inside the interpreter.
    """
    from packaging.version import Version

    if Version(triton_version).release < (3, 7) and Version(numpy_version).release >= (2, 4):
        return (f"Triton {triton_version}'s interpreter cannot run these kernels with numpy {numpy_version} "
                "(triton-lang/triton#9171): install triton>=3.7, or numpy<2.4, for CPU kernel runs.")
    return None


@contextlib.contextmanager
def interpreter_pool() -> Iterator[multiprocessing.pool.Pool]:
    """A one-worker process pool in which every Triton kernel runs in the interpreter.

    Use `pool.apply(fn, args, kwargs)` with picklable functions (e.g.
    `hf_sparse_cp.kernels.ops.triton_forward`) and CPU tensors; results come back pickled.
    """
    import numpy
    import triton

    blocker = interpreter_blocker(triton.__version__, numpy.__version__)
    if blocker:
        raise RuntimeError(blocker)
    ctx = multiprocessing.get_context("spawn")
    with _ENV_LOCK:
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            pool = ctx.Pool(1)  # the worker starts here and copies the environment
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous
    try:
        yield pool
    finally:
        pool.terminate()
        pool.join()
