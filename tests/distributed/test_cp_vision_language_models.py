"""Vision-language models under CP 2 (#50): every model with a vision tower was refused at attach ("non-text towers
... --cp_size 1"), though long-context checkpoints ship as such (Gemma 3, Mistral Small 3.1, Qwen2.5-VL). Their
text-only batches now train under CP as in one process (Qwen-VL's multimodal RoPE from the global position_ids the
split passes, Gemma 3's sliding layers and the all-zero token types of its processor's text batches, Mllama's
cross-attention layers skipped without an image, Mistral 3's Pixtral tower beside Mistral); a batch that
carries the towers' inputs is refused on every rank together, on the host before its step, naming the key and
--cp_size 1."""

import os
import tempfile

import pytest
import torch

from hf_sparse_cp.integration.architectures import CP_TESTED_VISION_LANGUAGE_TYPES
from hf_sparse_cp.testing.spawn import run_gloo_each

from oracle import rel_rms, trained_under

SEQ, ROWS, VOCAB = 128, 4, 300
MODEL_TYPES = CP_TESTED_VISION_LANGUAGE_TYPES
MODES = {"one": {}, "ring": {}, "ulysses": {"cp_mode": "ulysses"}}


def _rows() -> list[dict]:
    """Rows of text (below the tiny models' special ids), row i right-padded by 8 i tokens."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(ROWS):
        ids = torch.randint(3, VOCAB - 6, (SEQ,), generator=g)
        mask = (torch.arange(SEQ) < SEQ - 8 * i).long()
        ids = ids.masked_fill(mask == 0, 0)
        labels = ids.masked_fill(mask == 0, -100)
        labels[: 20 * i + 5] = -100
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def _model(model_type: str, sliding: bool = False):
    from transformers import AutoModelForImageTextToText

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig
    from hf_sparse_cp.testing.tiny_vlms import tiny_vlm_config

    hf_sparse_cp.patch()
    torch.manual_seed(0)
    config = tiny_vlm_config(model_type, VOCAB)
    if sliding:  # (Gemma 3's layers: sliding windows of 32 tokens beside full attention)
        text = config.get_text_config()
        text.sliding_window, text.layer_types = 32, ["sliding_attention", "full_attention"]
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa")
    model = model.double()
    hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=16, min_seq_len=0, vertical_topk=10**4,
                                                        slash_topk=10**4))  # (sdpa's attention, sparse path)
    return model


def _trainer(rank: int, world: int, model, tmp: str, rows: list[dict], collator=None):
    from transformers import Trainer, TrainingArguments

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    args = TrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, max_steps=2, learning_rate=0.5,
                             optim="sgd", per_device_train_batch_size=2, logging_steps=1, save_strategy="no",
                             train_sampling_strategy="sequential")
    return Trainer(model=model, args=args, train_dataset=rows, data_collator=collator)


def _with_zero_token_types(rows: list[dict]) -> dict:
    """The default collation with all-zero token_type_ids, as Gemma 3's processor gives a text batch."""
    from transformers import default_data_collator

    batch = default_data_collator(rows)
    return {**batch, "token_type_ids": torch.zeros_like(batch["input_ids"])}


def _train(rank: int, world: int, model_type: str, mode: str, zero_token_types: bool = False, sliding: bool = False
           ) -> dict:
    """Two SGD steps of text-only batches of 2 through the Trainer, in one process or under CP 2: the losses it logs
    and the update of the weights."""
    from hf_sparse_cp.distributed import ContextParallelConfig

    model = _model(model_type, sliding)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(rank, world, model, tmp, _rows(), _with_zero_token_types if zero_token_types else None)
        return trained_under(trainer, ContextParallelConfig(cp_size=world, **MODES[mode]))


class _WithImages:
    """A collator of the rows with one image per row (`with_image`): the towers' inputs beside the ids."""

    def __init__(self, config, only_token_types: bool = False):
        self.config, self.only_token_types = config, only_token_types

    def __call__(self, rows: list[dict]) -> dict:
        from hf_sparse_cp.testing.tiny_vlms import with_image

        ids = torch.stack([r["input_ids"] for r in rows])
        batch = with_image(self.config, ids, torch.Generator().manual_seed(2))
        if self.only_token_types:  # (the image's token types without its pixels)
            batch = {k: v for k, v in batch.items() if k in ("input_ids", "token_type_ids", "mm_token_type_ids")}
        return {**batch, "labels": batch["input_ids"]}


def _refused(rank: int, world: int, model_type: str, only_token_types: bool) -> str:
    """The error of a CP 2 Trainer whose batches carry an image (or its token types alone)."""
    from hf_sparse_cp import SparseCPArguments, attach_to_trainer, detach_from_trainer
    from hf_sparse_cp.distributed import ContextParallelConfig

    model = _model(model_type)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(rank, world, model, tmp, _rows(), _WithImages(model.config, only_token_types))
        attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True), ContextParallelConfig(cp_size=world))
        try:
            trainer.train()
            message = "trained"
        except ValueError as e:
            message = str(e)
        detach_from_trainer(trainer)
    return message


def _refused_direct(rank: int, world: int) -> str:
    """The error of `prepare_context_parallel_inputs` (the path outside the Trainer) for a batch with an image."""
    from hf_sparse_cp.distributed import ContextParallelConfig, ParallelDims, prepare_context_parallel_inputs
    from hf_sparse_cp.testing.tiny_vlms import tiny_vlm_config, with_image

    parallel = ParallelDims.from_config(ContextParallelConfig(cp_size=world))
    batch = with_image(tiny_vlm_config("qwen2_vl", VOCAB), torch.randint(3, 290, (2, SEQ)))
    try:
        prepare_context_parallel_inputs(batch, parallel, block_size=16)
    except ValueError as e:
        return str(e)
    return "prepared"


@pytest.fixture(scope="module")
def runs():
    one = run_gloo_each({**{t: (_train, (t, "one")) for t in MODEL_TYPES},
                         "gemma3 sliding": (_train, ("gemma3", "one", False, True))}, 1, timeout_s=900)
    calls = {(t, mode): (_train, (t, mode)) for t in MODEL_TYPES for mode in ("ring", "ulysses")}
    calls.update({("gemma3 sliding", mode): (_train, ("gemma3", mode, False, True)) for mode in ("ring", "ulysses")})
    calls["gemma3", "ring", "zero token types"] = (_train, ("gemma3", "ring", True))
    calls.update({("refused", t, tokens): (_refused, (t, tokens))
                  for t, tokens in (("qwen2_vl", False), ("mllama", False), ("gemma3", True))})
    calls["direct"] = (_refused_direct, ())
    return one, run_gloo_each(calls, 2, timeout_s=1200)  # (a rank left waiting would time out: no hang)


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("model_type", [*MODEL_TYPES, "gemma3 sliding"])
def test_text_batches_of_a_vision_language_model_under_cp2_equal_one_process(runs, model_type, mode):
    one, cp2 = runs
    (ref,) = one[model_type]
    for r in cp2[model_type, mode]:
        # (float64 weights, float32 losses: transformers' causal-LM loss takes the logits .float())
        assert r["logged"] == pytest.approx(ref["logged"], rel=1e-6)
        assert rel_rms(r["update"], ref["update"]) <= 1e-6, rel_rms(r["update"], ref["update"])


def test_gemma3s_sliding_windows_matter_in_its_text_batches(runs):
    one = runs[0]
    assert rel_rms(one["gemma3 sliding"][0]["update"], one["gemma3"][0]["update"]) > 1e-3


def test_all_zero_token_types_of_a_text_batch_train_as_one_process_does_without_them(runs):
    """Gemma 3's processor gives a text batch all-zero token_type_ids, for which Gemma 3 overlays its image mask (no
    image token: the causal mask), refused by the backend at the call; the CP loader drops them."""
    one, cp2 = runs
    (ref,) = one["gemma3"]
    for r in cp2["gemma3", "ring", "zero token types"]:
        assert r["logged"] == pytest.approx(ref["logged"], rel=1e-6)
        assert rel_rms(r["update"], ref["update"]) <= 1e-6, rel_rms(r["update"], ref["update"])


@pytest.mark.parametrize(("model_type", "only_token_types", "key"), [
    ("qwen2_vl", False, "pixel_values, image_grid_thw"), ("mllama", False, "pixel_values, aspect_ratio_ids"),
    ("gemma3", True, "token_type_ids")])
def test_a_batch_with_the_towers_inputs_is_refused_on_every_rank_naming_the_key_and_the_fix(
        runs, model_type, only_token_types, key):
    messages = runs[1]["refused", model_type, only_token_types]
    assert messages[0] == messages[1], messages
    assert f"the batch carries {key}" in messages[0], messages
    assert "--cp_size 1" in messages[0], messages


def test_prepare_context_parallel_inputs_refuses_a_batch_with_an_image(runs):
    for message in runs[1]["direct"]:
        assert "the batch carries pixel_values, image_grid_thw" in message and "--cp_size 1" in message, message
