"""NEFTune under CP (`context_parallel.py`): the noise one process adds to the input embeddings, drawn over the whole
sequence and sharded as its tokens are (`neftune_over_cp_group`, `NEFTuneNoise`)."""

from __future__ import annotations

import torch
from transformers import Trainer

from ..integration.call_context import cp_forward_shard
from ..integration.heads import base_model


def neftune_over_cp_group(trainer: Trainer, patches) -> NEFTuneNoise | None:
    """Make NEFTune (`--neftune_noise_alpha`) under CP add one process's noise, to the bit.

    transformers' NEFTune hook adds to the embeddings uniform noise of magnitude alpha / sqrt(L x d), L the length of
    the tensor the embedding layer returns, drawn in that tensor's shape: under CP a rank's shard, so the noise was
    sqrt(CP) times one process's, and once scaled, still other draws than one process's (the run equalled one process
    in distribution only). The Trainer's hook is kept off (its `neftune_noise_alpha` unset on this trainer), and the
    plugin's (`NEFTuneNoise`, on in training steps) draws the noise of the whole batch [B, S, d] as one process does
    and adds its rank's shard of it: the ranks of a CP group, seeded alike, draw what one process draws. None
    without NEFTune."""
    alpha = trainer.neftune_noise_alpha
    if alpha is None:
        return None
    model = trainer.model
    embeddings = base_model(model).get_input_embeddings()
    noise = NEFTuneNoise(alpha)
    patches.set_attr(trainer, "neftune_noise_alpha", None)  # (the Trainer then never adds its hook)
    patches.on_undo(embeddings.register_forward_hook(noise).remove)
    return noise


class NEFTuneNoise:
    """NEFTune's noise on the input embeddings' output (transformers' `neftune_post_forward_hook`) while `on` (in a
    training step) and the layer trains, drawn over the whole sequence of a CP forward and sharded as its tokens are
    (`neftune_over_cp_group`). A picklable object: the hook stays on the trained model, which must pickle."""

    def __init__(self, alpha: float):
        self.alpha, self.on = alpha, False

    def __call__(self, module: torch.nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        if not (self.on and module.training):
            return output
        shard = cp_forward_shard()
        length = output.size(1) if shard is None else shard.plan.seq_len
        # (transformers' magnitude, in its dtype: alpha over a float32 square root)
        magnitude = self.alpha / torch.sqrt(torch.tensor(length * output.size(2)))
        noise = output.new_zeros(output.size(0), length, *output.shape[2:]).uniform_(-magnitude, magnitude)
        return output + (noise if shard is None else shard.plan.shard(noise, shard.rank, pad_value=0.0))
