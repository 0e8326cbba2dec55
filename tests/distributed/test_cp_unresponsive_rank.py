"""A stopped rank does not hang the job (issue #41 item 6): in a CP 2 gloo group one rank stops itself
(SIGSTOP) and the other, in a CP forward (its first collective) and waiting on a ring transfer, ends each
within the process group's timeout with an error that names the stopped rank, and exits. Before, the CP
groups took torch's default timeout for new groups (30 min on gloo), not the job's; and on CPU processes
transformers does not pass the Trainer's --ddp_timeout to the process group at all."""

import datetime
import json
import os
import signal
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

# The job's timeout: the set-up's collectives (the group joined, two CP groups built, a barrier) start once both
# ranks have imported and built their model (`_meet`), so they take a second or two even on a busy machine.
TIMEOUT_S = 10
SETUP_LIMIT_S = 900  # spawning, importing and joining two processes, on a busy machine
EXIT_LIMIT_S = 6 * TIMEOUT_S + 60  # from the stop to the survivor's exit: two timeouts, the errors, the exit


def _meet(rank: int, workdir: str) -> None:
    """Wait (up to SETUP_LIMIT_S) until the other rank gets here too: their imports end seconds apart on a busy
    machine, which the group's short timeout must not have to cover."""
    Path(workdir, f"ready{rank}").touch()
    deadline = time.monotonic() + SETUP_LIMIT_S
    while not Path(workdir, f"ready{1 - rank}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {1 - rank} did not start within {SETUP_LIMIT_S} s")
        time.sleep(0.05)


def _rank(rank: int, workdir: str) -> None:
    """Rank 1 stops itself once two groups of the CP ranks are set up; rank 0 then runs a CP forward over the first (its
    first collective waits on rank 1) and a ring receive over the second, records the errors they end with,
    and re-raises the last, as a training script would."""
    from transformers import AutoModelForCausalLM

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig
    from hf_sparse_cp.distributed import ContextParallelConfig, ParallelDims, prepare_context_parallel_inputs
    from hf_sparse_cp.distributed.comm import P2PComm, Transfer
    from hf_sparse_cp.testing.tiny_models import tiny_config

    torch.set_num_threads(1)
    hf_sparse_cp.patch()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97)).eval()
    hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=16, min_seq_len=64, dense_first_layers=0))
    ids = torch.randint(3, 97, (1, 135), generator=torch.Generator().manual_seed(1))
    _meet(rank, workdir)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    forward_dims = ParallelDims.from_config(ContextParallelConfig(cp_size=2))
    # (the ring waits on another group of the same ranks, which the forward's timeout leaves whole: a layout built
    # again reuses its groups, a Ulysses layout's head group is its own)
    ring_group = ParallelDims.from_config(ContextParallelConfig(cp_size=2, cp_mode="ulysses")).head_group
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    Path(workdir, "started").write_text(str(time.time()))
    attempts = {
        "forward": lambda: model(**prepare_context_parallel_inputs({"input_ids": ids}, forward_dims, block_size=16)),
        "ring": lambda: P2PComm(ring_group).post([Transfer(1, torch.empty(64), send=False)]).wait(),
    }
    errors = {}
    for name, attempt in attempts.items():
        try:
            with torch.no_grad():
                attempt()
            errors[name] = {"type": None, "message": "returned without an error"}
        except Exception as error:
            errors[name] = {"type": type(error).__name__, "message": str(error), "trace": traceback.format_exc()}
            last = error
    Path(workdir, "errors.json").write_text(json.dumps(errors))
    raise last


def test_a_stopped_rank_makes_the_other_exit_naming_it_within_the_timeout():
    from hf_sparse_cp.testing.spawn import process_context

    ctx = process_context()  # (its processes have imported transformers already)
    with tempfile.TemporaryDirectory() as workdir:
        ranks = [ctx.Process(target=_rank, args=(rank, workdir)) for rank in range(2)]
        for p in ranks:
            p.start()
        try:
            started = Path(workdir, "started")
            deadline = time.monotonic() + SETUP_LIMIT_S
            while not started.exists() and ranks[0].is_alive() and time.monotonic() < deadline:
                time.sleep(0.5)
            assert started.exists(), f"rank 0 did not reach the stop (exit code {ranks[0].exitcode})"
            ranks[0].join(EXIT_LIMIT_S)
            exited = time.time()
            assert not ranks[0].is_alive(), f"rank 0 still runs {EXIT_LIMIT_S} s after rank 1 stopped"
            errors = json.loads(Path(workdir, "errors.json").read_text())
        finally:
            for p in ranks:
                if p.is_alive():
                    p.kill()  # (SIGKILL ends a stopped process too)
                p.join(60)
        took = exited - float(started.read_text())
    assert ranks[0].exitcode != 0
    for name, error in errors.items():
        assert error["type"] == "UnresponsiveRankError", (name, error)
        assert error["message"].startswith("rank 0: "), error["message"]
        assert f"rank 1 did not answer within the process group's timeout ({TIMEOUT_S} s" in error["message"]
    assert "the ring transfer from rank(s) [1] did not complete" in errors["ring"]["message"]
    assert 2 * TIMEOUT_S * 0.9 <= took <= EXIT_LIMIT_S, took


def _trainer_timeouts(rank: int, world: int) -> dict:
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.distributed.comm import group_timeout
    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.attach import detach_from_trainer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    before = group_timeout().total_seconds()
    rows = [{"input_ids": torch.arange(3, 200)}] * 2
    with tempfile.TemporaryDirectory() as tmp:
        args = SparseTrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, cp_size=2, ddp_timeout=45)
        trainer = SparseTrainer(model=AutoModelForCausalLM.from_config(tiny_config("llama")), args=args,
                                train_dataset=rows)
        during = [group_timeout().total_seconds(), group_timeout(trainer.parallel.cp_group).total_seconds()]
        detach_from_trainer(trainer)
    return {"before": before, "during": during, "after": group_timeout().total_seconds()}


def test_the_trainers_ddp_timeout_is_the_timeout_of_every_group_on_cpu():
    """transformers does not pass --ddp_timeout to accelerate on CPU processes: their gloo group kept 30 min."""
    from hf_sparse_cp.testing.spawn import run_gloo

    for result in run_gloo(_trainer_timeouts, 2, timeout_s=300):
        assert result == {"before": 300, "during": [45, 45], "after": 300}
