"""A token id outside the model's vocabulary under CP 2 (#50): only the rank whose shard held it failed, in the
embedding, while the other waited for it in the ring until the launcher ended it; a label outside the LM head's
classes (not -100) likewise, in the loss. The CP data loader now checks the ids and labels where it builds each batch,
on the host (no device read per step): both ranks refuse the batch together, naming the id, the vocabulary and the
fix."""

import os
import tempfile

import pytest
import torch

from hf_sparse_cp.testing.spawn import run_gloo

VOCAB = 259


def _train(rank: int, world: int, bad: int, key: str = "input_ids") -> str:
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    ids = torch.randint(3, VOCAB, (2, 256), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    (ids if key == "input_ids" else labels)[1, 200] = bad  # the second step's batch; its shard on one rank only
    rows = [{"input_ids": r, "labels": t} for r, t in zip(ids, labels)]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=VOCAB))
    with tempfile.TemporaryDirectory() as tmp:
        args = SparseTrainingArguments(
            output_dir=tmp, max_steps=2, per_device_train_batch_size=1, learning_rate=1e-3, report_to="none",
            save_strategy="no", use_cpu=True, cp_size=world, sparse_block_size=32, sparse_min_seq_len=128,
            train_sampling_strategy="sequential")
        trainer = SparseTrainer(model=model, args=args, train_dataset=rows)
        try:
            trainer.train()
        except ValueError as e:
            return str(e)
    return "trained"


@pytest.mark.parametrize("bad", [VOCAB + 41, -3])
def test_every_cp_rank_refuses_a_token_id_outside_the_vocabulary_together(bad):
    messages = run_gloo(_train, 2, bad, timeout_s=240)  # (a rank left waiting would time out: no hang)
    assert messages[0] == messages[1], messages
    assert f"token id {bad} at input_ids[0, 200]" in messages[0], messages
    assert f"{VOCAB} rows" in messages[0] and "resize_token_embeddings" in messages[0], messages


@pytest.mark.parametrize("bad", [VOCAB + 5, -1])
def test_every_cp_rank_refuses_a_label_outside_the_models_classes_together(bad):
    """A target outside the LM head's classes (and not -100): one process fails in its loss; under CP only the rank
    whose shard held it did, and the other waited for it in the loss's sum over the group until the timeout."""
    messages = run_gloo(_train, 2, bad, "labels", timeout_s=120)
    assert messages[0] == messages[1], messages
    assert f"label {bad} at labels[0, 200]" in messages[0], messages
    assert f"{VOCAB} classes" in messages[0] and "-100" in messages[0], messages
