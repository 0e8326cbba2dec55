"""Shared helpers of the SMET tests (tiny Llama and mixture of experts, learnable token data); no tests here."""

from __future__ import annotations

import dataclasses
import io
import types

import torch
from transformers import AutoModelForCausalLM

from hf_sparse_cp.smet import SMETConfig
from hf_sparse_cp.testing.tiny_models import tiny_config

VOCAB = 64


class TokenRows(torch.utils.data.Dataset):
    """Rows of a token tensor as causal-LM samples (labels = inputs) for the Trainer."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    """Llama with hidden 64, 2 layers, untied embeddings, random init from `seed`."""
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", **fields))
    return _norms_in_float64(model.to(dtype))


def _norms_in_float64(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 model whose RMS norms compute in float64. transformers' norms compute in float32 whatever the input
    (`hidden_states.to(torch.float32)`): a float64 model then rounds its activations to float32 at every norm, and
    two runs whose weights differ by float64 rounding (sharded sums) can round an activation to neighbouring float32
    values, differences of ~1e-8 that training compounds (seen: 2e-9 in the weights after 10 steps, 7e-15 with the
    norms in float64). Each norm's replacement (weight, if any, times x / rms(x)) is checked against its own forward
    first. Routers' float32 softmax stays."""
    if next(model.parameters()).dtype != torch.float64:
        return model
    for module in model.modules():
        if not type(module).__name__.endswith(("RMSNorm", "L2Norm")):
            continue
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))

        def forward(self, hidden_states, eps=eps):
            normed = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + eps)
            weight = getattr(self, "weight", None)
            return normed if weight is None else weight * normed

        width = module.weight.shape[-1] if getattr(module, "weight", None) is not None else 16
        sample = torch.randn(2, 3, width, dtype=torch.float64)
        with torch.no_grad():
            torch.testing.assert_close(forward(module, sample), module(sample), rtol=1e-6, atol=1e-6,
                                       msg=f"{type(module).__name__} is not weight * x / rms(x)")
        module.forward = types.MethodType(forward, module)
    return model


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in the model's dtype (transformers' loss upcasts only to float32)."""
    logits = model(input_ids=tokens).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def naive(config: SMETConfig) -> SMETConfig:
    """`config` with every cold-start cure off: plain dynamic sparse Adam on the same topology schedule, the baseline
    the SMET tests compare with (a user sets the three fields, or flags, themselves)."""
    return dataclasses.replace(config, local_bias_correction=False, regrow_warmup_steps=0, density_lr_scaling=False)


def fit(model: torch.nn.Module, opt: torch.optim.Optimizer, batches) -> list[float]:
    """One clipped optimizer step per batch of token ids (causal-LM loss); the loss of each step."""
    losses = []
    for tokens in batches:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def assert_resumes_exactly(build, config, batches, split: int, saved_check=None) -> None:
    """Training `build()` (a fresh model of seed 0; `build(seed=1)` another init) with SMET on `batches` in one go
    equals stopping after `split` batches, saving model and optimizer, and resuming a model of another init from the
    save: the same losses and bit-identical weights. `saved_check(model, optimizer, saved)` inspects the save."""
    from hf_sparse_cp.smet import create_smet_optimizer

    model = build()
    uninterrupted = fit(model, create_smet_optimizer(model, torch.optim.AdamW, config, lr=5e-3), batches)
    first = build()
    opt1 = create_smet_optimizer(first, torch.optim.AdamW, config, lr=5e-3)
    head = fit(first, opt1, batches[:split])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": opt1.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    if saved_check is not None:
        saved_check(first, opt1, saved)
    resumed = build(seed=1)  # (a different init: everything must come from the save)
    resumed.load_state_dict(saved["model"])
    opt2 = create_smet_optimizer(resumed, torch.optim.AdamW, config, lr=5e-3, attach=False)
    opt2.load_state_dict(saved["optimizer"])
    opt2.attach()
    assert head + fit(resumed, opt2, batches[split:]) == uninterrupted
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def markov_tokens(num: int, length: int = 32, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    """`[num, length]` token ids from a fixed random first-order Markov chain (3 successors per token,
    probabilities 0.6 / 0.3 / 0.1): learnable structure with a known entropy floor of 0.90 nats."""
    chain = torch.Generator().manual_seed(1234)
    successors = torch.stack([torch.randperm(vocab, generator=chain)[:3] for _ in range(vocab)])
    probs = torch.tensor([0.6, 0.3, 0.1])
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.empty(num, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (num,), generator=gen)
    for t in range(1, length):
        choice = torch.multinomial(probs.expand(num, 3), 1, generator=gen).squeeze(1)
        tokens[:, t] = successors[tokens[:, t - 1], choice]
    return tokens


def fsdp2_smet(model: torch.nn.Module, config, world: int, *, lr: float, attach: bool = True):
    """SMET AdamW built like the Trainer under FSDP2: optimizer first, then shard every layer and the
    model over `world` ranks and swap the parameters in, then attach (the Trainer callback attaches
    at train begin, after a checkpoint is loaded). Returns the optimizer; `model` is sharded in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_sparse_cp.smet import create_smet_optimizer

    opt = create_smet_optimizer(model, torch.optim.AdamW, config, lr=lr, attach=False)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = dict(model.named_parameters())
    for group in opt.param_groups:
        group["params"] = [params[name] for name in group["param_names"]]
    if attach:
        opt.attach()
    return opt


def tiny_moe(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    """A mixture of experts of transformers model type `arch` (Mixtral, Qwen3-MoE, GPT-OSS) sized as `tiny_llama`,
    one layer of 4 experts (`TINY_EXPERTS`, each 2 a token) of width 64 by default, eager experts (torch's grouped
    matmul takes no float64), random init from `seed`."""
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1,
                  max_position_embeddings=64, tie_word_embeddings=False, experts_implementation="eager")
    fields.update(overrides)
    config = tiny_config(arch, **fields)
    torch.manual_seed(seed)
    return _norms_in_float64(AutoModelForCausalLM.from_config(config).to(dtype))
