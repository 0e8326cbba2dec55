"""transformers' just-in-time checkpoint on SIGTERM (`--enable_jit_checkpoint`) under CP 2: a SIGTERM that reaches
rank 0 alone mid-step (a node preempted; torchrun's own forwarding reaches the ranks at different moments too) stops
both ranks at the same step with a complete, marked checkpoint, which resumes as the uninterrupted run continues.
Before, rank 0 saved while rank 1 trained on, each in another collective: a deadlock until the launcher killed them,
leaving a checkpoint folder with transformers' sentinel file alone."""

import json
import os
import signal

import torch

SIGNALLED_AT = 2  # rank 0 gets SIGTERM as step 3 begins


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.arange(128).mul(i + 1).remainder(250).add(3)
        return {"input_ids": ids, "labels": ids}


def _run(rank: int, world: int, out: str) -> dict:
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments, default_data_collator

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments, attach_to_trainer, detach_from_trainer
    from hf_sparse_cp.distributed import ContextParallelConfig
    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.checkpoints import MARKER

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    hf_sparse_cp.patch()

    class Preempt(TrainerCallback):  # SIGTERM to rank 0 as step SIGNALLED_AT + 1 begins
        def on_step_begin(self, args, state, control, **kwargs):
            if rank == 0 and state.global_step == SIGNALLED_AT:
                os.kill(os.getpid(), signal.SIGTERM)

    def trained(folder: str, jit: bool, resume: str | None = None):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("llama"))
        hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=16, min_seq_len=64, vertical_topk=2,
                                                            slash_topk=2, local_window=16, sink_tokens=4, last_q=16))
        args = TrainingArguments(output_dir=folder, report_to="none", use_cpu=True, max_steps=6, learning_rate=1e-2,
                                 per_device_train_batch_size=1, logging_steps=1, save_strategy="no", seed=0,
                                 enable_jit_checkpoint=jit, ddp_timeout=60)
        trainer = Trainer(model=model, args=args, train_dataset=Rows(), data_collator=default_data_collator,
                          callbacks=[Preempt()] if jit else None)
        if jit:  # (the handler's grace period before it requests the save: none here)
            next(c.jit_manager for c in trainer.callback_handler.callbacks if getattr(c, "jit_manager", None)
                 ).kill_wait = 0
        attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True), ContextParallelConfig(cp_size=world))
        trainer.train(resume_from_checkpoint=resume)
        detach_from_trainer(trainer)
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        return trainer.state.global_step, losses, torch.cat([p.detach().flatten() for p in model.parameters()])

    stopped, _, _ = trained(os.path.join(out, "stopped"), jit=True)
    checkpoint = os.path.join(out, "stopped", f"checkpoint-{stopped}")
    torch.distributed.barrier()
    marker = json.loads(open(os.path.join(checkpoint, MARKER)).read())
    _, resumed, weights = trained(os.path.join(out, "resumed"), jit=False, resume=checkpoint)
    _, full, reference = trained(os.path.join(out, "full"), jit=False)
    return {"stopped": stopped, "marker": marker, "files": sorted(os.listdir(checkpoint)), "resumed": resumed,
            "full": full, "weights": weights, "reference": reference}


def test_a_sigterm_to_one_rank_stops_both_at_one_step_with_a_complete_checkpoint_that_resumes(tmp_path):
    from hf_sparse_cp.testing.spawn import run_gloo

    results = run_gloo(_run, 2, str(tmp_path), timeout_s=300)
    stopped = {r["stopped"] for r in results}
    assert len(stopped) == 1 and SIGNALLED_AT < stopped.pop() < 6, [r["stopped"] for r in results]
    got = results[0]
    assert got["marker"]["complete"] and got["marker"]["settings"]["cp_size"] == 2, got["marker"]
    assert "checkpoint-is-incomplete.txt" not in got["files"] and "optimizer.pt" in got["files"], got["files"]
    # the resumed run logs its checkpoint's steps (the stopped one's included), then the steps after it as the
    # uninterrupted run trains them
    assert got["resumed"] == got["full"], (got["resumed"], got["full"])
    torch.testing.assert_close(got["weights"], got["reference"], rtol=0, atol=0)
