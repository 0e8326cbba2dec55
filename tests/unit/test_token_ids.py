"""The CP data loader's checks of its batches: token ids against the model's vocabulary, labels against its head's
classes, a composite model's image inputs (`trainer/token_ids.py`)."""

import pickle

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    PretrainedConfig,
)

from hf_sparse_cp.testing.tiny_models import tiny_config
from hf_sparse_cp.trainer.token_ids import (
    CheckedCollate,
    check_label_ids,
    check_token_ids,
    label_classes_of,
    vocabulary_of,
)


def _collate(rows):
    return {key: torch.stack([r[key] for r in rows]) for key in rows[0]}


def test_ids_outside_the_vocabulary_are_refused_naming_the_id_the_vocabulary_and_the_fix():
    ok = torch.tensor([[0, 5, 9]])
    check_token_ids({"input_ids": ok}, 10)
    for bad, where in ((10, [0, 2]), (-1, [0, 0]), (1 << 40, [0, 1])):
        ids = ok.clone()
        ids[tuple(where)] = bad
        with pytest.raises(ValueError, match=rf"token id {bad} at input_ids\{where}.*10 rows.*resize_token_embeddings"):
            check_token_ids({"input_ids": ids}, 10)
    with pytest.raises(ValueError, match="chosen_input_ids"):  # (TRL's preference batches)
        check_token_ids({"prompt_input_ids": ok, "chosen_input_ids": ok + 8}, 10)
    check_token_ids({"labels": ok + 20, "attention_mask": ok, "input_ids": ok.float() + 20}, 10)  # not token ids
    check_token_ids({"input_ids": torch.tensor([[3, 12]])}, 10, frozenset({12}))  # replaced by the model


def test_the_vocabulary_is_the_input_embedding_and_the_special_ids_past_it():
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=64))
    assert vocabulary_of(model) == (64, frozenset())
    model.config.image_token_id = 70  # (PaliGemma, Gemma 3: an image token past the vocabulary, swapped before lookup)
    model.config.text_config = PretrainedConfig(boi_token_index=[-5, 3])
    assert vocabulary_of(model) == (64, frozenset({70, -5}))
    assert vocabulary_of(torch.nn.Linear(2, 2)) is None

    class NoEmbedding(torch.nn.Module):
        def get_input_embeddings(self):
            raise NotImplementedError

    assert vocabulary_of(NoEmbedding()) is None


def test_labels_outside_the_classes_other_than_minus_100_are_refused_naming_the_label_and_the_fix():
    ok = torch.tensor([[-100, 0, 9]])
    check_label_ids({"labels": ok, "shift_labels": ok}, 10)
    for key in ("labels", "shift_labels"):
        for bad, where in ((10, [0, 2]), (-1, [0, 0]), (-101, [0, 1])):
            labels = ok.clone()
            labels[tuple(where)] = bad
            with pytest.raises(ValueError, match=rf"label {bad} at {key}\{where} .* 10 classes.*-100.*resize_token"):
                check_label_ids({key: labels}, 10)
    check_label_ids({"labels": ok.float() + 20, "input_ids": ok + 20}, 10)  # (a regression's; not labels)


def test_the_classes_are_the_lm_heads_outputs_or_the_token_classifiers_labels():
    config = tiny_config("llama", vocab_size=64, num_labels=3)
    assert label_classes_of(AutoModelForCausalLM.from_config(config)) == 64
    assert label_classes_of(AutoModelForTokenClassification.from_config(config)) == 3
    assert label_classes_of(AutoModelForSequenceClassification.from_config(config)) is None  # (per row: every rank's)
    assert label_classes_of(torch.nn.Linear(2, 2)) is None


def test_the_checked_collate_checks_every_batch_and_pickles_for_worker_processes():
    collate = pickle.loads(pickle.dumps(CheckedCollate(_collate, (10, frozenset()), classes=12)))
    batch = collate([{"input_ids": torch.tensor([1, 2])}, {"input_ids": torch.tensor([3, 4])}])
    assert batch["input_ids"].tolist() == [[1, 2], [3, 4]]
    with pytest.raises(ValueError, match="token id 11 at input_ids"):
        collate([{"input_ids": torch.tensor([1, 11])}])
    with pytest.raises(ValueError, match="label 12 at labels"):
        collate([{"input_ids": torch.tensor([1, 2]), "labels": torch.tensor([-100, 12])}])


def test_a_composite_models_collate_refuses_image_inputs_and_drops_all_zero_token_types():
    """For a model with towers (`towers`), the CP loader refuses the towers' inputs and token types marking image
    tokens on the host, and drops all-zero token types (a processor's text batch), which mark nothing; a text
    model's token types (GPT-2's) and a vocabulary of None pass as they were."""
    rows = [{"input_ids": torch.tensor([1, 2]), "token_type_ids": torch.tensor([0, 0])}]
    collate = pickle.loads(pickle.dumps(CheckedCollate(_collate, None, towers=True)))
    assert set(collate(rows)) == {"input_ids"}
    with pytest.raises(ValueError, match=r"the batch carries token_type_ids: .*--cp_size 1"):
        collate([{**rows[0], "token_type_ids": torch.tensor([0, 1])}])
    with pytest.raises(ValueError, match=r"the batch carries pixel_values: .*--cp_size 1"):
        collate([{**rows[0], "pixel_values": torch.zeros(3)}])
    text = CheckedCollate(_collate, None)
    assert text([{**rows[0], "token_type_ids": torch.tensor([0, 1])}])["token_type_ids"].tolist() == [[0, 1]]
