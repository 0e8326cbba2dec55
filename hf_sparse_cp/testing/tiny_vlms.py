"""Tiny vision-language models: a small config of a composite architecture (its language model `tiny_config`'s, a
vision tower of one or two layers over 16x16 or 32x32 images), and a batch that holds one image per row."""

from __future__ import annotations

import torch
from transformers import AutoConfig, PretrainedConfig

from .tiny_models import tiny_config

# The architectures `tiny_vlm_config` builds, by the language model each holds.
VLM_TEXT_TYPES = {
    "qwen2_vl": "qwen2_vl_text", "qwen2_5_vl": "qwen2_5_vl_text", "qwen3_vl": "qwen3_vl_text",
    "gemma3": "gemma3_text", "paligemma": "gemma", "llava": "llama", "llava_next": "llama", "idefics3": "llama",
    "smolvlm": "llama", "mllama": "mllama_text_model", "mistral3": "mistral",
}
# Multimodal RoPE over the tiny head_dim 32 (16 frequencies: 4 temporal, 6 height, 6 width).
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
# Where `with_image` puts a row's image tokens.
IMAGE_START = 10


def _special(vocab_size: int) -> dict[str, int]:
    """The special tokens of the tiny models: the last ids of the vocabulary."""
    names = ("image", "vision_start", "vision_end", "boi", "eoi", "video")
    return {name: vocab_size - 1 - i for i, name in enumerate(names)}


def tiny_vlm_config(model_type: str, vocab_size: int = 300) -> PretrainedConfig:
    """A small config of the vision-language `model_type` (a key of `VLM_TEXT_TYPES`), no dropout, its special
    tokens the last ids of the vocabulary (sample text below `vocab_size - 6`)."""
    ids = _special(vocab_size)
    text_type = VLM_TEXT_TYPES[model_type]
    if model_type == "mllama":  # (one self-attention layer on each side of a cross-attention one)
        text = dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1], dropout=0.0,
                    rope_theta=10000.0, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_global_layers=1,
                      attention_heads=2, image_size=16, patch_size=8, max_num_tiles=1, intermediate_layers_indices=[0],
                      vision_output_dim=64, supported_aspect_ratios=[[1, 1]])
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_index=ids["image"])
    rope = dict(_MROPE, **({"mrope_interleaved": True} if model_type == "qwen3_vl" else {}))
    text = tiny_config(text_type, vocab_size=vocab_size,
                       **({"rope_parameters": rope} if model_type.startswith("qwen") else {})).to_dict()
    siglip = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=8)
    if model_type.startswith("qwen"):
        vision = {"qwen2_vl": dict(depth=1, embed_dim=32, hidden_size=128, num_heads=2, patch_size=4, mlp_ratio=2),
                  "qwen2_5_vl": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
                                     patch_size=4, window_size=16, fullatt_block_indexes=[1]),
                  "qwen3_vl": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
                                   patch_size=4, num_position_embeddings=64, deepstack_visual_indexes=[0])}[model_type]
        return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_id=ids["image"],
                                    video_token_id=ids["video"], vision_start_token_id=ids["vision_start"],
                                    vision_end_token_id=ids["vision_end"])
    if model_type == "gemma3":
        return AutoConfig.for_model(model_type, text_config=text, vision_config=dict(siglip, image_size=32),
                                    mm_tokens_per_image=4, image_token_index=ids["image"], boi_token_index=ids["boi"],
                                    eoi_token_index=ids["eoi"])
    if model_type == "paligemma":
        return AutoConfig.for_model(model_type, text_config=text, vision_config=dict(siglip, image_size=16,
                                                                                     projection_dim=128),
                                    image_token_index=ids["image"], projection_dim=128, hidden_size=128)
    if model_type == "mistral3":  # (Pixtral: 4x4 patches of 16x16 pixels, merged 2x2)
        pixtral = dict(siglip, image_size=16, patch_size=4, head_dim=16)
        return AutoConfig.for_model(model_type, text_config=text, vision_config=pixtral, image_token_index=ids["image"],
                                    vision_feature_layer=-1)
    if model_type in ("llava", "llava_next"):
        clip = dict(siglip, model_type="clip_vision_model", num_hidden_layers=2, image_size=16, projection_dim=32)
        extra = {"image_grid_pinpoints": [[16, 16]]} if model_type == "llava_next" else {}
        return AutoConfig.for_model(model_type, text_config=text, vision_config=clip, image_token_index=ids["image"],
                                    vision_feature_layer=-1, **extra)
    vision = dict(siglip, image_size=16, patch_size=4)  # idefics3, smolvlm: 16 patches, merged 2x2
    return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_id=ids["image"],
                                scale_factor=2)


def with_image(config: PretrainedConfig, input_ids: torch.Tensor, generator: torch.Generator | None = None
               ) -> dict[str, torch.Tensor]:
    """The model inputs of `input_ids` [B, S] (S > 24) of the tiny `config` with one random image per row: its tokens
    from `IMAGE_START` on (Mllama's first token), and the tower's inputs (pixel_values and what the architecture
    takes beside them: image_grid_thw, image_sizes, token_type_ids, ...)."""
    model_type = config.model_type
    ids = _special(config.get_text_config().vocab_size)
    b = input_ids.shape[0]
    input_ids = input_ids.clone()
    start = IMAGE_START

    def pixels(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    if model_type.startswith("qwen"):  # 4x4 patches of 4 pixels, 2 frames, merged 2x2: 4 tokens between markers
        input_ids[:, start - 1], input_ids[:, start + 4] = ids["vision_start"], ids["vision_end"]
        input_ids[:, start:start + 4] = ids["image"]
        return {"input_ids": input_ids, "pixel_values": pixels(b * 16, 3 * 2 * 4 * 4),
                "image_grid_thw": torch.tensor([[1, 4, 4]] * b),
                "mm_token_type_ids": (input_ids == ids["image"]).long()}
    if model_type == "gemma3":
        input_ids[:, start - 1], input_ids[:, start + 4] = ids["boi"], ids["eoi"]
        input_ids[:, start:start + 4] = ids["image"]
        return {"input_ids": input_ids, "pixel_values": pixels(b, 3, 32, 32),
                "token_type_ids": (input_ids == ids["image"]).long()}
    if model_type == "paligemma":  # the image, then the prompt: a prefix of 2 * IMAGE_START tokens
        input_ids[:, :4] = ids["image"]
        token_type_ids = torch.ones_like(input_ids)
        token_type_ids[:, :2 * start] = 0
        return {"input_ids": input_ids, "pixel_values": pixels(b, 3, 16, 16), "token_type_ids": token_type_ids}
    if model_type == "mllama":
        input_ids[:, 0] = ids["image"]
        return {"input_ids": input_ids, "pixel_values": pixels(b, 1, 1, 3, 16, 16),
                "aspect_ratio_ids": torch.ones(b, 1, dtype=torch.long),
                "aspect_ratio_mask": torch.ones(b, 1, 1, dtype=torch.long),
                "cross_attention_mask": torch.ones(b, input_ids.shape[1], 1, 1, dtype=torch.long)}
    if model_type == "llava_next":  # the base image's 4 tokens, one 16x16 crop's 4 and a newline after each row of 2
        input_ids[:, start:start + 10] = ids["image"]
        return {"input_ids": input_ids, "pixel_values": pixels(b, 2, 3, 16, 16),
                "image_sizes": torch.tensor([[16, 16]] * b)}
    if model_type == "mistral3":
        input_ids[:, start:start + 4] = ids["image"]
        return {"input_ids": input_ids, "pixel_values": pixels(b, 3, 16, 16),
                "image_sizes": torch.tensor([[16, 16]] * b)}
    input_ids[:, start:start + 4] = ids["image"]  # llava: 2x2 patches; idefics3, smolvlm: 4x4 merged 2x2
    shape = (b, 3, 16, 16) if model_type == "llava" else (b, 1, 3, 16, 16)
    return {"input_ids": input_ids, "pixel_values": pixels(*shape)}
