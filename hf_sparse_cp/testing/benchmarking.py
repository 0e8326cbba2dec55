"""What every benchmark shares: timing, kernel profiles, how it prints its targets and where it
writes its JSON (the machine and versions it records come from `hf_sparse_cp.env.environment`)."""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import torch

from ..backends import RECYCLING_MALLOC

ALLOCATORS = ("recycling", "system")


@contextmanager
def spawned_allocator(kind: str) -> Iterator[str | None]:
    """Processes spawned inside run with glibc's allocator `kind`: 'recycling' (`RECYCLING_MALLOC`) or
    'system' (glibc's defaults); they read GLIBC_TUNABLES at start. Yields the GLIBC_TUNABLES they get."""
    if kind not in ALLOCATORS:
        raise ValueError(f"allocator {kind!r} is unknown; use one of {ALLOCATORS}.")
    before = os.environ.get("GLIBC_TUNABLES")
    if kind == "recycling":
        os.environ["GLIBC_TUNABLES"] = RECYCLING_MALLOC
    else:
        os.environ.pop("GLIBC_TUNABLES", None)
    try:
        yield os.environ.get("GLIBC_TUNABLES")
    finally:
        if before is None:
            os.environ.pop("GLIBC_TUNABLES", None)
        else:
            os.environ["GLIBC_TUNABLES"] = before


def format_targets(targets: list[dict]) -> str:
    """One line per target of a report ({target, required, measured, pass}): the measured value and
    PASS, MISS or "not measured" (pass None: the run did not measure it; with a measured value, a figure
    reported for reference, no target), or the target's own `verdict` where it has one (INCONCLUSIVE), and its
    `ceiling` where it has one (with "unreachable" where the required bound is above it)."""
    lines = []
    for t in targets:
        verdict = t.get("verdict") or (("not measured" if t["measured"] is None else "for reference")
                                       if t["pass"] is None else ("PASS" if t["pass"] else "MISS"))
        value = t["measured"]
        shown = "" if value is None else (f"{value:.3f} " if isinstance(value, float) else f"{value} ")
        top = t.get("ceiling")  # (bench_attention's: the value at the best dense kernel's rate)
        bound = "" if top is None else f" (at the best dense rate {top:.3g}{'' if t['reachable'] else ': unreachable'})"
        lines.append(f"{t['target']}: {shown}(required {t['required']}) {verdict}{bound}")
    return "\n".join(lines)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS difference of `a` from the reference `b`, in fp32."""
    a, b = a.float(), b.float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def time_ms(fn: Callable[[], object], warmup: int, repeats: int, device: str = "cuda") -> float:
    """Median time of fn() in milliseconds: CUDA events on "cuda", the wall clock elsewhere."""
    for _ in range(warmup):
        fn()
    if device != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_profile(fn: Callable[[], object], device: str = "cuda", top: int = 8, warmup: int = 1) -> list[dict]:
    """Where one steady-state fn() call spends its time, by kernel (torch.profiler): a list of
    {name, ms, calls, share}, largest first, the `top` kernels and then one "(N other kernels)" row.
    On "cuda" each GPU kernel's device time; elsewhere each operator's own CPU time. fn() runs
    `warmup` times unprofiled first, so compilation and autotuning stay out of the profile."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    for _ in range(warmup):
        fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    totals: dict[str, list] = {}
    for e in prof.events():
        if cuda and e.device_type == DeviceType.CUDA:
            us = e.device_time_total
        elif not cuda and e.device_type == DeviceType.CPU:
            us = e.self_cpu_time_total
        else:
            continue
        entry = totals.setdefault(e.name, [0.0, 0])
        entry[0] += us / 1e3
        entry[1] += 1
    whole = sum(ms for ms, _ in totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])
    rows = [{"name": name, "ms": ms, "calls": calls, "share": ms / whole} for name, (ms, calls) in ranked[:top]]
    rest = ranked[top:]
    if rest:
        ms = sum(v[0] for _, v in rest)
        rows.append({"name": f"({len(rest)} other kernels)", "ms": ms, "calls": sum(v[1] for _, v in rest),
                     "share": ms / whole})
    return rows


def format_profile(title: str, kernels: list[dict], width: int = 72) -> str:
    """A `kernel_profile` as text: a title line, then one line per kernel (ms, calls, share)."""
    lines = [title]
    for k in kernels:
        name = k["name"] if len(k["name"]) <= width else k["name"][: width - 3] + "..."
        lines.append(f"  {name:<{width}} {k['ms']:9.3f} ms {k['calls']:>5}x {100 * k['share']:5.1f}%")
    return "\n".join(lines)


def format_profiles(rows: list[dict], title: Callable[[dict], str]) -> str:
    """The kernel profile of every row that has one (`row["kernels"]`), titled `title(row)`, each
    after a blank line; empty when no row was profiled."""
    return "".join(f"\n{format_profile(title(r), r['kernels'])}\n" for r in rows if r.get("kernels"))


def peak_rss() -> int:
    """This process's peak resident set since the last call (or its start), in bytes; then resets it (Linux)."""
    with open("/proc/self/status") as f:
        peak = int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return peak


def device_slug(device: str) -> str:
    """A device's name as a file-name part ('NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3')."""
    return "".join(c if c.isalnum() else "-" for c in device).strip("-").lower()[:40] or "device"


def write_report(report: dict, results_dir: Path, kind: str, output: str | None = None) -> Path:
    """Write a benchmark's JSON to `output`, or to results_dir/<kind>_<device>_<time>.json; returns the path."""
    slug = device_slug(report["device"])
    out = Path(output) if output else results_dir / f"{kind}_{slug}_{datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")  # written whole, then renamed: a run killed mid-write keeps the last
    part.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(part, out)
    print(f"wrote {out}")
    return out


def parse_gpu_benchmark_args(arguments_cls, argv: list[str], script: str):
    """`argv` parsed into the dataclass `arguments_cls` (which has a `dry_run` field); exits, saying nothing was
    measured, when this machine has no CUDA device (the GPU benchmarks refuse to time anything else), unless the
    arguments ask for their `dry_run` (the script checked on the CPU, nothing measured)."""
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(arguments_cls).parse_args_into_dataclasses(argv)
    if not torch.cuda.is_available() and not args.dry_run:
        raise SystemExit(f"{script} is a GPU benchmark and found no CUDA device; nothing was measured.")
    return args


class ReportFile:
    """A benchmark's JSON file, rewritten as results come in: the first `write` names it (as
    `write_report` does, unless `output` is given), later writes overwrite that same file."""

    def __init__(self, results_dir: Path, kind: str, output: str | None = None):
        self.results_dir, self.kind, self.path = results_dir, kind, output

    def write(self, report: dict) -> Path:
        path = write_report(report, self.results_dir, self.kind, self.path)
        self.path = str(path)
        return path

    def resumed(self, settings: dict, same: tuple[str, ...]) -> dict | None:
        """The report already at `output` (a run cut off, to be continued), or None when there is none; refuses one
        whose settings differ from `settings` in any field of `same` (what its measurements depend on)."""
        if self.path is None or not Path(self.path).is_file():
            return None
        report = json.loads(Path(self.path).read_text())
        differ = sorted(k for k in same if report.get("settings", {}).get(k) != settings.get(k))
        if differ:
            raise ValueError(f"{self.path} was measured with other {differ} than asked; continue it with its own "
                             "settings, or pass another --output.")
        print(f"continuing {self.path}")
        return report
