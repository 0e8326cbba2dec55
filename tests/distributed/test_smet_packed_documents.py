"""SMET on packed documents under document-sharded CP 2 (`--smet --cp_sharding document`) takes the topology
decisions one process takes: a float64 tiny Llama trained through the stock Trainer on one flattened row
(DataCollatorWithFlattening: documents of 1 to 290 tokens, one longer than a rank's shard, sparse and dense ones),
gradient regrowth (its scores reduced over the ranks that each hold part of the row), a topology update every 2 steps.
(In float32 two blocks' pruning scores can lie 1 ulp apart, in another order in each run: one block of one row then
differs.)"""

import os

import pytest
import torch

from smet_common import tiny_llama

LENGTHS = [1, 37, 290, 5, 100, 1, 30]
STEPS = 4


def _train(rank: int, world: int, out_dir: str) -> dict:
    from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

    from hf_sparse_cp import (
        SparseAttentionConfig,
        SparseCPArguments,
        attach_to_trainer,
        enable_sparse_attention,
        install_smet,
    )
    from hf_sparse_cp.distributed import ContextParallelConfig
    from hf_sparse_cp.smet import SMETConfig, unwrap_smet

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    g = torch.Generator().manual_seed(0)
    documents = [{"input_ids": torch.randint(3, 64, (n,), generator=g).tolist()} for n in LENGTHS]
    model = tiny_llama(dtype=torch.float64, max_position_embeddings=512)
    sparse = SparseCPArguments(sparse_attention=True, sparse_fused_loss=False)
    args = TrainingArguments(output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=len(LENGTHS),
                             learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1, report_to="none",
                             use_cpu=True, seed=0, save_strategy="no", train_sampling_strategy="sequential")
    trainer = Trainer(model=model, args=args, train_dataset=documents * STEPS,
                      data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True))
    enable_sparse_attention(model, sparse, SparseAttentionConfig(block_size=16, min_seq_len=64, vertical_topk=2,
                                                                 slash_topk=2, local_window=16, sink_tokens=2))
    attach_to_trainer(trainer, sparse, ContextParallelConfig(cp_size=world, **({"cp_sharding": "document"} if world > 1
                                                                             else {})))
    install_smet(trainer, SMETConfig(density=0.5, block_size=8, update_interval=2, prune_rate=0.5,
                                     regrowth="gradient", regrow_warmup_steps=2))
    masks = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            smet = unwrap_smet(optimizer)
            masks.append({name: smet.state[param]["block_index"].clone() for group in smet.param_groups
                          if group["smet"] for name, param in zip(group["param_names"], group["params"])})

    trainer.add_callback(Record())
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    return {"loss": [log["loss"] for log in logs], "replaced": [log["smet/replaced_fraction"] for log in logs],
            "masks": masks, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from hf_sparse_cp.testing.spawn import run_gloo

    return (run_gloo(_train, 1, str(tmp_path_factory.mktemp("one")), timeout_s=600)[0],
            run_gloo(_train, 2, str(tmp_path_factory.mktemp("cp2")), timeout_s=600))


def test_smet_on_packed_documents_under_document_sharded_cp2_equals_one_process(runs):
    one, ranks = runs
    assert len(one["masks"]) == STEPS and max(one["replaced"]) > 0  # (the topology moved)
    for cp in ranks:
        assert cp["loss"] == pytest.approx(one["loss"], rel=1e-6)  # (the Trainer logs them rounded to float32)
        for step, (ours, theirs) in enumerate(zip(cp["masks"], one["masks"])):
            assert ours.keys() == theirs.keys()
            assert all(torch.equal(ours[k], theirs[k]) for k in ours), f"masks differ after step {step + 1}"
        for name, weight in one["weights"].items():
            torch.testing.assert_close(cp["weights"][name], weight, rtol=1e-10, atol=1e-12, msg=name)
