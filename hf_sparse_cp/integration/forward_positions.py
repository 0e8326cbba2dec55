"""A configured model forward's `position_ids`, passed on to its attention calls (`pass_positions_on`) and read there
where a layer hands the call none (`with_forward_positions`): where they pack documents, every call attends within
them."""

from __future__ import annotations

import torch

from ..attention.tokens import packing_positions
from ..distributed.shard import CP_SHARD_KWARG
from .call_tokens import PerForward

# The keyword under which a configured model's forward passes its `position_ids` on to the attention calls
# (`pass_positions_on`), as `cp_shard` reaches them: through the decoder layers' keyword arguments.
POSITIONS_KWARG = "sparse_cp_position_ids"


def pass_positions_on(module: torch.nn.Module, args, kwargs):
    """Forward pre-hook (with kwargs) of a configured model: its `position_ids` (given without an attention mask, where
    they pack documents) go on to the attention calls under `POSITIONS_KWARG` too. Some decoder layers keep
    `position_ids` from their attention call (Llama 4's: only its mask packs documents by them), which would then
    attend across the documents. Keyword arguments reach the layers' gradient-checkpoint recomputation as well."""
    positions = kwargs.get("position_ids")
    if (positions is None or kwargs.get("attention_mask") is not None or kwargs.get(POSITIONS_KWARG) is not None
            or kwargs.get(CP_SHARD_KWARG) is not None):
        return None
    return args, {**kwargs, POSITIONS_KWARG: positions}


_TEXT_ROWS = PerForward()


def with_forward_positions(kwargs: dict, seq_len: int) -> dict:
    """An attention call's keyword arguments, with the model forward's `position_ids` (`pass_positions_on`) where the
    call got neither them nor `cu_seq_lens_k` and they are one per token ([B or 1, seq_len] or [seq_len]). A call
    that carries `position_ids=None` is left as it is: its layer was told there are none, and so was the model's mask
    (Qwen2-VL's text model hands its layers and `create_causal_mask` the text row of [4, B, S] positions only, None
    for 2D ones, which it expands to its three RoPE rows: transformers does not pack documents by those). A call
    that carries multimodal RoPE rows [R, B, S] takes the documents of the forward's [R', B, S] ones
    (`tokens.packing_positions`): GLM-4V's text model hands its mask the text row of [4, B, S] positions and its
    layers the three rows after it."""
    positions, call = kwargs.get(POSITIONS_KWARG), kwargs.get("position_ids")
    if positions is None or kwargs.get("cu_seq_lens_k") is not None or positions.shape[-1] != seq_len:
        return kwargs
    if call is not None and call.dim() > 2 and positions.dim() > 2:  # (one text row object per forward: its
        # documents are then read back once, `batch_token_meta`)
        return {**kwargs, "position_ids": _TEXT_ROWS.get((), (positions,), lambda: packing_positions(positions))}
    if "position_ids" in kwargs or positions.dim() > 2:
        return kwargs
    return {**kwargs, "position_ids": positions if positions.dim() == 2 else positions[None]}
