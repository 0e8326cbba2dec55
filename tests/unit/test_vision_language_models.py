"""Vision-language models (a language model beside a vision tower): sparse_cp runs in the language model, the towers
keep their own attention; what the language model's attention is not (bidirectional image blocks, a prefix-LM
prefix, cross-attention) is refused, naming the fix."""

import copy

import pytest
import torch
from transformers import AutoModelForImageTextToText

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.integration import upstream
from hf_sparse_cp.integration.models import check_model_supports_context_parallel
from hf_sparse_cp.integration.stats import pop_kept_fractions
from hf_sparse_cp.testing.tiny_vlms import tiny_vlm_config, with_image

from oracle import rel_rms

PATTERN = dict(block_size=16, min_seq_len=0, sink_tokens=0, dense_first_layers=0)
KEEP_ALL = SparseAttentionConfig(**PATTERN, vertical_topk=10**4, slash_topk=10**4)  # (sdpa's attention, sparse path)


def _pair(model_type: str):
    """(sdpa model, its float64 copy configured with the backend), equal weights, in training mode."""
    torch.manual_seed(0)
    ref = AutoModelForImageTextToText.from_config(tiny_vlm_config(model_type), attn_implementation="sdpa")
    ref = ref.double().train()
    model = copy.deepcopy(ref)
    hf_sparse_cp.patch()
    hf_sparse_cp.configure(model, KEEP_ALL)
    return ref, model


def _batch(config, image: bool) -> dict:
    ids = torch.randint(3, 290, (2, 64), generator=torch.Generator().manual_seed(1))
    batch = with_image(config, ids, torch.Generator().manual_seed(2)) if image else {"input_ids": ids}
    return {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}


def _errors(ref, model, batch) -> tuple[float, float]:
    """The relative errors of `model`'s logits and gradients (the largest of any parameter) from `ref`'s."""
    out = {}
    for name, m in (("ref", ref), ("model", model)):
        result = m(**batch, labels=batch["input_ids"])
        grads = torch.autograd.grad(result.loss, list(m.parameters()), allow_unused=True)
        out[name] = result.logits.detach(), grads
    grads = [rel_rms(g, r) for g, r in zip(out["model"][1], out["ref"][1]) if r is not None and r.norm() > 0]
    return rel_rms(out["model"][0], out["ref"][0]), max(grads)


@pytest.mark.parametrize("image", [False, True], ids=["text", "image"])
@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next", "idefics3",
                                        "smolvlm", "mistral3"])
def test_a_vision_language_model_trains_sparse_attention_in_its_language_model_as_sdpa_does(model_type, image):
    """configure() refused every vision-language model ('has bidirectional attention layers (model.visual...)'): its
    vision tower's attention, which transformers selects apart. Now the language model runs sparse_cp and the tower
    keeps sdpa: logits and gradients equal sdpa's, with batches of text and of images (Qwen2/2.5/3-VL: multimodal
    RoPE positions of the image tokens; Qwen3-VL: deepstack features added in the language model's layers)."""
    ref, model = _pair(model_type)
    implementations = {type(m).__name__: m.config._attn_implementation for m in model.modules() if hasattr(m, "config")}
    towers = {type(m).__name__ for m in model.modules() if getattr(m, "config", None) is model.config.vision_config}
    assert towers and {implementations[t] for t in towers} == {"sdpa"}
    assert upstream.attn_implementation(model.config.get_text_config()) == "sparse_cp"
    logits, grads = _errors(ref, model, _batch(model.config, image))
    assert logits <= 1e-12 and grads <= 1e-10, (logits, grads)
    assert len(pop_kept_fractions(model)) == model.config.get_text_config().num_hidden_layers  # (every layer sparse)


def test_the_pattern_runs_in_the_language_model_of_an_image_batch():
    """A narrow pattern keeps fewer blocks of the image batch's language model than all, and changes its logits."""
    ref, model = _pair("qwen2_vl")
    batch = _batch(model.config, image=True)
    hf_sparse_cp.configure(model, SparseAttentionConfig(**PATTERN, vertical_topk=1, slash_topk=1, local_window=16))
    with torch.no_grad():
        logits = model(**batch).logits
        assert rel_rms(logits, ref(**batch).logits) > 1e-3
    assert all(kept < 0.9 for kept in pop_kept_fractions(model).values())


@pytest.mark.parametrize("model_type", ["gemma3", "mllama"])
def test_image_blocks_and_cross_attention_are_refused_at_the_call_and_text_batches_stay_exact(model_type):
    """Gemma 3's bidirectional attention over an image's tokens (an or-mask over the causal one) and Mllama's
    cross-attention layers (keys of the image's features; Mllama's was refused as 'a 4D attention mask ... call
    hf_sparse_cp.patch() before building the model') are refused, naming the cause; their text batches, which have
    neither, equal sdpa's."""
    ref, model = _pair(model_type)
    logits, grads = _errors(ref, model, _batch(model.config, image=False))
    assert logits <= 1e-12 and grads <= 1e-10, (logits, grads)
    cause = {"gemma3": "overlays its own mask on the causal one",
             "mllama": r"MllamaTextCrossAttention\) of model type 'mllama_text_model' is cross-attention"}[model_type]
    fix = r".*attn_implementation='sdpa'( or 'eager')? \(--sparse_attention false\)"
    with pytest.raises(ValueError, match=cause + fix):
        model(**_batch(model.config, image=True))


def test_a_prefix_lm_language_model_is_refused_by_configure():
    """PaliGemma's language model attends bidirectionally over its prefix: configure() names its layer."""
    model = AutoModelForImageTextToText.from_config(tiny_vlm_config("paligemma"), attn_implementation="sdpa")
    hf_sparse_cp.patch()
    with pytest.raises(ValueError, match=r"bidirectional attention layers \(model.language_model.layers.0.self_attn"):
        hf_sparse_cp.configure(model)
    assert upstream.attn_implementation(model.config) == "sdpa"


@pytest.mark.parametrize("model_type, layer", [("llava", "CLIPAttention, model type 'clip_vision_model'"),
                                               ("mistral3", "PixtralAttention, model type 'pixtral'")])
def test_a_tower_loaded_on_the_backend_moves_to_sdpa_and_the_switch_is_undone(model_type, layer):
    """A model loaded with attn_implementation='sparse_cp' everywhere: its tower is refused at its first image batch,
    naming configure (Mllama's tower, which has no `is_causal`, was refused as 'a 4D attention mask ... call
    hf_sparse_cp.patch() before building the model'; Mistral 3's Pixtral tower, whose config has no base_config_key,
    as a bidirectional layer, naming sdpa only); enable_sparse_attention keeps the language model on it and moves the
    tower to sdpa; the undo restores each sub-config's implementation."""
    from hf_sparse_cp import SparseCPArguments
    from hf_sparse_cp.trainer.attach import disable_sparse_attention, enable_sparse_attention

    hf_sparse_cp.patch()
    model = AutoModelForImageTextToText.from_config(tiny_vlm_config(model_type), attn_implementation="sparse_cp")
    batch = with_image(model.config, torch.randint(3, 290, (1, 64)))
    with pytest.raises(ValueError, match=rf"this layer \({layer}\) is in the model's vision tower.*"
                                         r"hf_sparse_cp.configure\(model\).*'vision_config': 'sdpa'"):
        model(**batch)
    enable_sparse_attention(model, SparseCPArguments(sparse_attention=True), KEEP_ALL)
    assert upstream.attn_implementation(model.config.vision_config) == "sdpa"
    assert upstream.attn_implementation(model.config.text_config) == "sparse_cp"
    model(**batch)
    disable_sparse_attention(model)
    assert upstream.attn_implementation(model.config.vision_config) == "sparse_cp"


@pytest.mark.parametrize("model_type, tower", [("mistral3", "vision_config"), ("voxtral", "audio_config"),
                                               ("qwen2_audio", "audio_config")])
def test_a_tower_config_without_a_base_config_key_is_known_by_the_inputs_its_models_take(model_type, tower):
    """A composite holds these towers' configs under AutoConfig sub-configs, which give them no base_config_key (Mistral
    3's Pixtral tower was refused as a plain bidirectional layer, naming sdpa only): `tower_key` knows them by their
    models' input_modalities, and neither the language model's config nor the composite's."""
    import importlib

    from transformers import AutoConfig

    from hf_sparse_cp.integration.composite import tower_key

    config = AutoConfig.for_model(model_type)
    importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")  # (as a built model has)
    assert getattr(config, tower).base_config_key == ""
    assert tower_key(getattr(config, tower)) == tower
    assert tower_key(config.text_config) is None and tower_key(config) is None


def test_context_parallelism_takes_a_vision_language_model_whose_towers_mix_tokens_outside_attention():
    """Under CP every vision-language model was refused ('has non-text towers'), and, the towers set aside, their patch
    convolutions (Qwen2-VL's Conv3d) were refused as token mixers of the sequence: they run on the batch's images,
    not on a shard of the tokens. The check now passes; the towers' inputs are refused with the batch instead."""
    _, model = _pair("qwen2_vl")
    check_model_supports_context_parallel(model)


@pytest.mark.parametrize(("batch", "token_types", "refused"), [
    ({"pixel_values": torch.zeros(1), "image_grid_thw": torch.ones(1, 3)}, False, "pixel_values, image_grid_thw"),
    ({"input_features": torch.zeros(1), "pixel_values": None}, False, "input_features"),
    ({"aspect_ratio_ids": torch.ones(1), "cross_attention_mask": torch.ones(1)}, False,
     "aspect_ratio_ids, cross_attention_mask"),
    ({"token_type_ids": torch.tensor([[0, 1]])}, True, "token_type_ids"),
    ({"mm_token_type_ids": torch.tensor([[0, 2]])}, True, "mm_token_type_ids"),
    ({"token_type_ids": torch.tensor([[0, 1]])}, False, None),  # (GPT-2's token types: no towers)
    ({"token_type_ids": torch.zeros(1, 2), "mm_token_type_ids": torch.zeros(1, 2)}, True, None),  # (text)
])
def test_a_batch_carrying_the_towers_inputs_is_refused_naming_the_key_and_the_fix(batch, token_types, refused):
    from hf_sparse_cp.distributed.inputs import check_text_only

    batch = {"input_ids": torch.ones(1, 2, dtype=torch.long), **batch}
    if refused is None:
        check_text_only(batch, token_types=token_types)
        return
    with pytest.raises(ValueError, match=rf"the batch carries {refused}: inputs of the model's vision or audio "
                                         r"towers.*--cp_size 1"):
        check_text_only(batch, token_types=token_types)


def test_a_tower_without_is_causal_on_the_backend_is_refused_as_a_tower():
    """Mllama's vision attention has no `is_causal`: loaded on sparse_cp, its image batch was refused as 'a 4D
    attention mask ... call hf_sparse_cp.patch() before building the model'; now as a layer of its vision tower."""
    hf_sparse_cp.patch()
    model = AutoModelForImageTextToText.from_config(tiny_vlm_config("mllama"), attn_implementation="sparse_cp")
    with pytest.raises(ValueError, match=r"\(MllamaVisionAttention, model type 'mllama_vision_model'\) is in the "
                                         r"model's vision tower"):
        model(**with_image(model.config, torch.randint(3, 290, (1, 64))))


def test_head_parallel_modes_check_a_vision_language_model_by_its_language_model_heads():
    """Ulysses read `num_attention_heads` off the composite config, which has none (AttributeError at CP attach):
    now its language model's heads, 4 query heads of the tiny model over at most 4 ranks."""
    from hf_sparse_cp.distributed import ContextParallelConfig

    ContextParallelConfig(cp_size=2, cp_mode="ulysses").check_model(tiny_vlm_config("qwen2_vl"))
    with pytest.raises(ValueError, match="needs at least 8 query heads, but the model has 4"):
        ContextParallelConfig(cp_size=8, cp_mode="ulysses").check_model(tiny_vlm_config("gemma3"))
