"""The lean loss under FSDP2 (`integration/lean_loss.py`): accelerate shards the LM head with the final norm as one
FSDP2 unit, so its weight is a DTensor outside that unit's forward and the lean path was never taken: every training
step built the [tokens, vocab] logits through the stock loss. The loss now runs as the forward of a call of the head,
whose hooks unshard its weight and reduce-scatter its gradient: the lean path is taken on every training step, tied
and untied heads, DP 2 and CP 2, with the losses and weights of one process. The saved model.safetensors is one
process's too: the state dict gathered from the shards held a tied head apart from its embeddings, saved twice
(`trainer/tied_weights.py`)."""

import os
import tempfile

import pytest
import torch

from oracle import rel_rms

SEQ = 128


def _rows() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(3, 97, (SEQ,), generator=g)), "labels": ids} for _ in range(4)]


def _train(rank: int, world: int, tied: bool, cp: int) -> dict:
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.integration import lean_loss
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97, tie_word_embeddings=tied))
    calls = {"lean": 0, "through the module": 0}
    head_loss = lean_loss._head_loss

    def counted(lm_head, *args, **kwargs):
        calls["lean"] += 1
        calls["through the module"] += lean_loss._through_fsdp2(lm_head)
        return head_loss(lm_head, *args, **kwargs)

    lean_loss._head_loss = counted
    fsdp = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}} if world > 1 else {}
    with tempfile.TemporaryDirectory() as tmp:
        args = SparseTrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, max_steps=2, learning_rate=0.1,
                                       optim="sgd", per_device_train_batch_size=2 * cp // world, logging_steps=1,
                                       save_strategy="no", cp_size=cp, sparse_block_size=32, sparse_min_seq_len=64,
                                       **fsdp)
        trainer = SparseTrainer(model=model, args=args, train_dataset=_rows())
        trainer.train()
        trainer.save_model(f"{tmp}/final")
        saved = _saved(f"{tmp}/final/model.safetensors") if trainer.args.should_save else None
        weights = torch.cat([getattr(v, "full_tensor", lambda v=v: v)().flatten()
                             for v in trainer.model.state_dict().values()])
    lean_loss._head_loss = head_loss
    return {"calls": calls, "loss": [log["loss"] for log in trainer.state.log_history if "loss" in log],
            "weights": weights, "saved": saved}


def _saved(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("cp", [1, 2], ids=["dp2", "cp2"])
def test_fsdp2_trains_through_the_lean_loss_and_saves_as_one_process(tied, cp):
    from hf_sparse_cp.testing.spawn import run_gloo

    (one,) = run_gloo(_train, 1, tied, 1, timeout_s=300)
    assert one["calls"] == {"lean": 2, "through the module": 0}  # one process: a local head, one lean call a step
    ranks = run_gloo(_train, 2, tied, cp, timeout_s=600)
    for rank in ranks:
        assert rank["calls"] == {"lean": 2, "through the module": 2}, rank
        assert rank["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert rel_rms(rank["weights"], one["weights"]) < 1e-6
    saved = ranks[0]["saved"]
    assert sorted(saved) == sorted(one["saved"])  # a tied head saved once, as its embeddings
    assert ("lm_head.weight" in saved) == (not tied)
    for name, tensor in one["saved"].items():
        assert rel_rms(saved[name], tensor) < 1e-6, name
