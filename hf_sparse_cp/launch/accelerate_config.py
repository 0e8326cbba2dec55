"""What an accelerate launch config (`--config_file`, its mapping read once by `processes.parse_launcher_options`) asks
of this machine, checked before any process starts (`processes.refuse_unrunnable_config`). Each mistake found here
ended, before, in accelerate launch's traceback or in every process's after they had all started.

This file imports nothing heavy, so that the launcher refuses before its slow imports.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

# accelerate's distributed types whose processes each take one accelerator of their machine (MULTI_CPU and NO run on
# CPUs; XLA's TPUs are not torch.accelerator's)
ACCELERATOR_TYPES = frozenset(("MULTI_GPU", "FSDP", "DEEPSPEED", "MEGATRON_LM", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU",
                               "MULTI_MUSA", "MULTI_SDAA", "MULTI_HPU"))
# The environment variables that hide some of a machine's accelerators from this process: accelerate sets its
# config's gpu_ids as one of them in the processes it starts, so ids count from the machine's first accelerator,
# which the accelerators this process sees may not start at
VISIBILITY_ENV = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ZE_AFFINITY_MASK",
                  "ASCEND_RT_VISIBLE_DEVICES", "MLU_VISIBLE_DEVICES", "MUSA_VISIBLE_DEVICES", "SDAA_VISIBLE_DEVICES",
                  "HABANA_VISIBLE_MODULES", "NEURON_RT_VISIBLE_CORES")
COUNT_SOURCE = "torch.accelerator.device_count()"
CPU_LAUNCH = ("Launch CPU processes instead: `--config_file cpu_2proc_cp2` (its num_processes set to N) or `--nproc "
              "N`, with the CP degree as --cp_size N")


def positive_count(value) -> int | None:
    """`value` when it is a count accelerate launch takes (an int of at least 1, not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def config_mistake(config: Mapping, found: int) -> str | None:
    """What keeps the accelerate `config` from running on this machine, which has `found` accelerators (a message
    that follows `--config_file PATH ` and names the fix); None where it runs, or where accelerate launch names what
    is wrong itself (a missing or odd process count)."""
    count, machines = positive_count(config.get("num_processes")), positive_count(config.get("num_machines", 1))
    if count is None or machines is None:
        return _gpu_ids_mistake(config, None, found) or _package_mistake(config)
    per_machine = count // machines  # (accelerate's nproc_per_node)
    return (_placement_mistake(config, count, machines, found) or _gpu_ids_mistake(config, per_machine, found)
            or _fsdp_mistake(config, found) or _package_mistake(config))


def _on_accelerators(config: Mapping, found: int) -> bool:
    """Whether the processes of `config` each take an accelerator of their own: its kind asks for them, and either
    the machine has some or its parallelism_config, which accelerate runs on accelerators only, needs them (without
    any, the plugin trains such a config's processes on the CPU, over gloo: `cpu_2proc_cp2`)."""
    return (config.get("distributed_type") in ACCELERATOR_TYPES and not config.get("use_cpu")
            and bool(found or config.get("parallelism_config")))


def _placement_mistake(config: Mapping, count: int, machines: int, found: int) -> str | None:
    per_machine = count // machines
    if found >= per_machine or not _on_accelerators(config, found):
        return None
    spread = f"{count} processes over {machines} machines, {per_machine} per machine" if machines > 1 else (
        f"{count} processes")
    if found:
        fix = (f"launch on machines with {per_machine} accelerators each, or set its num_processes to "
               f"{found * machines} (and its parallelism sizes to match)")
    else:
        fix = f"its parallelism_config runs only on accelerators. {CPU_LAUNCH}"
    return (f"starts {spread} ({config['distributed_type']}), each on an accelerator of its own, and this machine has "
            f"{found} ({COUNT_SOURCE}): {fix}")


def _gpu_ids_mistake(config: Mapping, per_machine: int | None, found: int) -> str | None:
    """gpu_ids that accelerate launch cannot read (not a string: its traceback), refuses (fewer than two for its
    multi-GPU launcher on one machine), or that leave a process without an accelerator of its own: fewer ids than
    processes per machine, one listed twice, or one this machine does not have."""
    given = config.get("gpu_ids")
    if given is None or given == "all":
        return None
    if not isinstance(given, str):
        example = ",".join(map(str, given)) if isinstance(given, (list, tuple)) else given
        return (f"sets gpu_ids: {given!r}, which accelerate launch reads as a string of comma-separated accelerator "
                f"ids: write it quoted (gpu_ids: \"{example}\"), or gpu_ids: all")
    ids = [part.strip() for part in given.split(",")]
    wanted = per_machine or 2
    listed = f"its gpu_ids \"{given}\""
    fix = f"list {wanted} ids, e.g. gpu_ids: \"{','.join(map(str, range(wanted)))}\", or gpu_ids: all"
    if "" in ids:
        return f"has an empty id in {listed}: {fix}"
    kind, machines = str(config.get("distributed_type") or ""), config.get("num_machines", 1)
    if len(ids) < 2 and kind.startswith("MULTI_") and kind != "MULTI_CPU" and machines == 1:
        return (f"runs on accelerate's multi-GPU launcher ({kind}), which refuses fewer than two gpu_ids on one "
                f"machine, and {listed} names one: {fix}")
    if per_machine is None or not _on_accelerators(config, found):
        return None
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        return (f"lists accelerator {twice[0]} more than once in {listed}, and each process takes an accelerator of "
                f"its own: {fix}")
    if len(ids) < per_machine:
        return (f"starts {per_machine} processes per machine, each on an accelerator of its own, and {listed} lists "
                f"{len(ids)}: {fix}, or set its num_processes to {len(ids) * machines}")
    absent = [i for i in ids if i.isdigit() and int(i) >= found]
    if absent and not any(name in os.environ for name in VISIBILITY_ENV):
        return (f"names accelerator {absent[0]} in {listed}, and this machine has {found} ({COUNT_SOURCE}), ids 0 to "
                f"{found - 1}: list {wanted} of those, or gpu_ids: all")
    return None


def _fsdp_mistake(config: Mapping, found: int) -> str | None:
    """FSDP version 1 without any accelerator: accelerate's FSDP1 needs a device (its plugin refuses CPU processes,
    and FSDP1 then refuses a CPU device), where the plugin runs FSDP2 on CPU processes (`trainer/cpu_fsdp.py`)."""
    if config.get("distributed_type") != "FSDP" or found:
        return None
    fsdp = config.get("fsdp_config")
    version = str(fsdp.get("fsdp_version", 1) if isinstance(fsdp, Mapping) else 1)
    if version == "2":
        return None
    return (f"runs FSDP version {version} (its fsdp_config's fsdp_version; accelerate's default is 1), which "
            "accelerate runs only on accelerators, and this machine has none: set fsdp_version: 2 in its fsdp_config "
            "(FSDP2, which the plugin runs on CPU processes over gloo)")


def _package_mistake(config: Mapping) -> str | None:
    """A DeepSpeed config without DeepSpeed installed (accelerate launch's ImportError, after the script's flags)."""
    if config.get("distributed_type") != "DEEPSPEED" or importlib.util.find_spec("deepspeed") is not None:
        return None
    return ("runs DeepSpeed (distributed_type: DEEPSPEED), which is not installed: pip install deepspeed, or shard "
            "with FSDP2 instead (distributed_type: FSDP with fsdp_version: 2 in its fsdp_config, e.g. `--config_file "
            "fsdp2_cp8_1node`)")
