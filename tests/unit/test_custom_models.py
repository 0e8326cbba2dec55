"""A user's own model, outside transformers, whose attention calls `ALL_ATTENTION_FUNCTIONS` as Llama's does: with
`attn_implementation='sparse_cp'` it computes what eager attention computes (fp64, values narrower than queries and
keys, GQA, qk-norm, its own scale, learned sinks), and an attention module that lacks what the backend reads to give it
its layer's pattern (`config`, `layer_idx`) is refused naming the fix, where it ran another pattern silently (#50)."""

import pytest
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.integration.stats import pop_kept_fractions

pytestmark = pytest.mark.usefixtures("patched")

# Sparse from the first token, small budgets, layer 1 overridden dense: the layers run different patterns.
PATTERN = SparseAttentionConfig(min_seq_len=0, block_size=16, budget={"mode": "topk", "vertical_topk": 2,
                                                                      "slash_topk": 2},
                                sink_tokens=1, local_window=4, last_q=16, dense_first_layers=0,
                                layer_overrides={"1": {"pattern": "dense"}})


class CustomConfig(PretrainedConfig):
    model_type = "hf_sparse_cp_test_custom"

    def __init__(self, v_dim=16, num_key_value_heads=2, scaling=0.3, sinks=True, drop=None, **kwargs):
        self.vocab_size, self.hidden_size, self.num_hidden_layers, self.num_attention_heads = 61, 48, 3, 4
        self.num_key_value_heads, self.head_dim, self.v_dim = num_key_value_heads, 12, v_dim
        self.scaling, self.sinks, self.drop = scaling, sinks, drop  # drop: an attribute its attention layers lack
        super().__init__(**kwargs)


def _eager(module, q, k, v, attention_mask, dropout=0.0, scaling=None, s_aux=None, **kwargs):
    """Causal attention of the model's own making: GQA by repetition, learned sinks as an extra logit column."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    logits = (q @ k.transpose(-1, -2) * scaling).masked_fill(
        ~torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(), float("-inf"))
    if s_aux is not None:
        logits = torch.cat([logits, s_aux.reshape(1, -1, 1, 1).expand(*logits.shape[:3], 1)], -1)
    probs = logits.softmax(-1)[..., : k.shape[2]]
    return (probs @ v).transpose(1, 2), probs


class CustomAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, True
        heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q, self.k = nn.Linear(config.hidden_size, heads * d), nn.Linear(config.hidden_size, kv * d)
        self.v, self.o = nn.Linear(config.hidden_size, kv * config.v_dim), nn.Linear(heads * config.v_dim,
                                                                                     config.hidden_size)
        self.q_norm, self.k_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.sinks = nn.Parameter(torch.randn(heads)) if config.sinks else None
        if config.drop == "config":  # (kept under another name)
            self._config = self.__dict__.pop("config")
        elif config.drop == "layer_idx":
            del self.layer_idx

    def forward(self, x, attention_mask=None, **kwargs):
        b, s, _ = x.shape
        q = self.q_norm(self.q(x).view(b, s, -1, self.q_norm.normalized_shape[0])).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, s, -1, self.k_norm.normalized_shape[0])).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.o.in_features // q.shape[1]).transpose(1, 2)
        model_config = self.__dict__.get("config") or self._config  # (the `config`-less variant keeps it elsewhere)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(model_config._attn_implementation, _eager)
        extra = {} if self.sinks is None else {"s_aux": self.sinks}
        out, _ = attend(self, q, k, v, attention_mask, dropout=0.0, scaling=model_config.scaling, **extra, **kwargs)
        return self.o(out.reshape(b, s, -1))


class CustomForCausalLM(PreTrainedModel):
    config_class = CustomConfig
    _supports_sdpa = _supports_attention_backend = True

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(CustomAttention(config, i) for i in range(config.num_hidden_layers))
        self.head = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        x = self.embed(input_ids)
        mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=attention_mask, cache=None,
                                  position_ids=position_ids)
        for layer in self.layers:
            x = x + layer(x, attention_mask=mask, **kwargs)
        return self.head(x)


def _model(**overrides) -> CustomForCausalLM:
    torch.manual_seed(0)
    model = CustomForCausalLM(CustomConfig(**overrides)).double()
    model.set_attn_implementation("eager")  # (its own `_eager`)
    return model


@pytest.mark.parametrize("overrides", [{}, dict(v_dim=20, num_key_value_heads=4, sinks=False)],
                         ids=["narrow-values-gqa-sinks", "wide-values"])
def test_a_custom_model_equals_its_eager_attention(overrides):
    """Dense in every layer, the backend's output is eager's; sparse, its layers keep the patterns the config gives
    them (layer 1 dense by its override)."""
    ids = torch.randint(0, 61, (2, 96), generator=torch.Generator().manual_seed(1))
    model = _model(**overrides)
    want = model(input_ids=ids)
    hf_sparse_cp.configure(model, SparseAttentionConfig(pattern="dense", min_seq_len=0))
    assert (model(input_ids=ids) - want).abs().max() < 1e-12
    hf_sparse_cp.configure(model, PATTERN)
    model(input_ids=ids)
    kept = pop_kept_fractions(model)
    assert kept[1] == 1.0 and kept[0] < 1.0 and kept[2] < 1.0


def test_an_attention_layer_without_config_or_layer_idx_is_refused():
    """Without `config` the layers read no stored pattern and ran the default one (dense below 8192 tokens: the
    configured budget ignored); without `layer_idx` every layer ran the base pattern (layer 1's dense override
    ignored). Either is refused naming the fix; a pattern that is one for every layer runs without `layer_idx`."""
    ids = torch.randint(0, 61, (1, 96), generator=torch.Generator().manual_seed(1))
    model = _model(drop="config")
    with pytest.raises(ValueError, match=r"CustomAttention\) has no `config`.*would run the default pattern.*"
                                         r"self.config = config"):
        hf_sparse_cp.configure(model, PATTERN)
    model = _model(drop="layer_idx")
    hf_sparse_cp.configure(model, PATTERN)
    with pytest.raises(ValueError, match=r"CustomAttention\) has no `layer_idx`.*layer_overrides=\{'1'.*Set "
                                         r"self.layer_idx"):
        model(input_ids=ids)
    hf_sparse_cp.configure(model, PATTERN.replace(layer_overrides=None))
    model(input_ids=ids)
    assert list(pop_kept_fractions(model).values())[0] < 1.0
