"""The loss's allocations: the lean loss (chunked PyTorch or liger-kernel's), which computes its gradients in
forward, or the stock forward's [tokens, vocab] logits and their backward."""

from __future__ import annotations

import math

from .architecture import Architecture
from .settings import StepSettings
from .tape import Tape


def loss_forward(tape: Tape, arch: Architecture, s: StepSettings, t: int, a: int, w: int, r: int) -> list[int]:
    """The loss's forward; returns the tensors kept for backward. The lean loss computes the gradients (the hidden
    states' first, in their dtype: `r` bytes); the stock forward (`arch.lean_loss` off) the LM head's logits in the
    compute dtype, their fp32 copy and its log-softmax, which it keeps (the caller drops the model's output, and with
    it the logits)."""
    sh = arch.shape
    h, v = sh.hidden, sh.vocab
    vh = v * h
    if not arch.lean_loss:  # (fp32 logits are their own fp32 copy)
        logits = tape.alloc("loss: logits", per_token=a * v)
        copy = tape.alloc("loss: logits", per_token=4 * v * (a < 4))
        kept = tape.alloc("loss: logits", per_token=4 * v)
        tape.free(logits, copy)
        return [kept]
    trained = s.lora is None  # (LoRA freezes the LM head: both losses skip its weight's gradient)
    if s.loss_backend == "liger":
        # liger-kernel 0.8.5: chunks of next_pow2(ceil(T / ceil(V / H))) tokens; logits in the input dtype;
        # weight-gradient accumulator in the weight's dtype; the input's gradient; an fp32 loss per token
        chunk = min(t, 2 ** math.ceil(math.log2(max(1, math.ceil(t / math.ceil(v / h))))))
        grad_h = tape.alloc("loss: hidden gradient", per_token=r * h + 4)
        grad_w = tape.alloc("loss: weight-gradient buffers", const=vh * w * trained)
        tape.transient("loss: logits chunk", const=chunk * v * a)
        return [grad_h, grad_w]
    chunk = max(1, min(t, (256 * 2**20) // (4 * v)))  # hf_sparse_cp.loss.chunked.default_chunk_size
    grad_h = tape.alloc("loss: hidden gradient", per_token=r * h + 9)  # + the valid flags and targets
    acc = tape.alloc("loss: weight-gradient buffers", const=vh * 4 * trained)
    # A chunk: fp32 logits, and logsumexp's (logits - max); the previous chunk's gradient (in the input dtype;
    # fp32: the previous logits buffer) is released only when the loop rebinds it, after this chunk's logits.
    previous = chunk * v * min(a, 4) if t > chunk else 0
    tape.transient("loss: logits chunk", const=previous + chunk * v * 8)
    if a < 4:  # the chunk's gradient in the input dtype, and grad.T @ h before its fp32 add (on a CPU the add
        # first copies it to fp32)
        tape.transient("loss: logits chunk",
                       const=chunk * v * a + vh * (a + (4 if s.device == "cpu" else 0)) * trained)
    kept = tape.alloc("loss: weight-gradient buffers", const=vh * w * trained)  # saved for backward in the weight dtype
    tape.free(acc)
    return [grad_h, kept]


def stock_loss_backward(tape: Tape, arch: Architecture, s: StepSettings, saved: list[int], hidden: int, a: int,
                         w: int, r: int) -> int:
    """The stock loss's backward: the NLL's and the log-softmax's fp32 [tokens, vocab] gradients beside the saved
    log-softmax, the logits' gradient in the input dtype, then the LM head's (its weight's gradient, the hidden
    states'); returns the hidden states' gradient."""
    v = arch.shape.vocab
    nll, log_softmax = tape.alloc("loss: logits", per_token=4 * v), tape.alloc("loss: logits", per_token=4 * v)
    tape.free(nll, *saved)
    logits = tape.alloc("loss: logits", per_token=a * v * (a < 4))  # (fp32 logits: the log-softmax's gradient)
    tape.free(log_softmax)
    tape.alloc("gradients", const=0 if s.lora else arch.embedding_params * w / s.fsdp)
    grad = tape.alloc("hidden-state gradients", per_token=r * arch.shape.hidden)
    tape.free(logits, hidden)
    return grad
