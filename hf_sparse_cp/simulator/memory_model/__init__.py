"""How much memory one training step of a decoder holds at its peak, term by term.

`step.predict_step_memory(arch, seq_len, settings)` replays one step as a sequence of allocations and
frees, in the order the code runs them: the forward (gradient checkpointing: each layer without
autograd, its input kept), the loss (the lean loss, which computes its gradients in forward, or
the stock forward's logits where the lean loss does not replace it), the backward
(each layer recomputed, then differentiated, last layer first) and the optimizer step. Every
allocation is sized from the shapes (bytes per token x tokens + constant bytes) and named by the
term it belongs to; the live bytes are tracked op by op, and each phase's peak is reported with the
live bytes of every term at that moment. The byte counts come from reading the code that runs:
transformers' Qwen2/Llama layers (a config's layers: what they save measured on its model,
`measurements.layer_saved`), the `sparse_cp` backend (estimation, layout, the Triton kernels'
launchers or the PyTorch reference), the chunked loss or liger-kernel 0.8.5's, torch's AdamW, the
ring's buffers; `benchmarks/memory_model.py` compares the sum with peaks measured on a CPU.

What it does not count: the CUDA context and the caching allocator's fragmentation (what a GPU
reserves beyond the live tensors: keep a margin, e.g. 10%), NCCL buffers, and kernels' own scratch
below a few MiB.

Terms (`tape.TERMS`): constant ones (weights, gradients, optimizer state, the loss's weight-gradient
buffers, ...) and ones that grow with the tokens of the rank (saved layer inputs, the recomputed
layer's saved activations, the MLP intermediate, RMSNorm's fp32 copies, attention tensors and
layouts, estimation buffers, CP ring buffers, ...).

The modules, in import order:

* `settings.py`: how the step runs (`StepSettings`, `with_savers`), the busiest rank's tokens (`rank_tokens`);
* `architecture.py`: a decoder as its memory depends on it (`Architecture`, from any transformers config);
  `presets.py`: the size presets `--model` names (`PRESETS`);
* `measurements.py`: what a model's layers save and its experts allocate, measured on the meta device;
* `tape.py`: the live allocations by term and each phase's peak (`Tape`, `TERMS`), and the prediction it gives
  (`MemoryEstimate`);
* `attention_geometry.py`: the sizes of one attention call's layout and of the buffers built around it;
* `loss.py` and `optimizer.py`: the loss's and the optimizer's allocations;
* `layer_modules.py`: a decoder layer's modules (norms, attention, MLP, LoRA adapters) replayed on the tape;
  `layer.py`: a whole layer, forward, recomputed and backward (`recomputed_layer_bytes`);
* `step.py`: the whole step (`predict_step_memory`); `search.py`: the longest length that fits
  (`longest_fitting_length`).
"""
