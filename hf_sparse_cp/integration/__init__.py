"""What transformers calls, and the one table of the private members the plugin uses (`compat.py`), with the
calls through them (`upstream.py`).

* `backend.py`: `sparse_cp_attention_forward`, the function transformers calls per layer, with what it reads:
  `call_context.py` (a probe or the CP shard of the forward in progress), `layer_settings.py` (each layer's
  pattern, parsed once), `forward_positions.py` (the forward's position_ids passed on to its calls) and
  `call_refusals.py` (what a call asks that sparse_cp does not compute);
* `call_tokens.py`: `sparse_cp_mask`, the mask function registered with it, and the token metadata a forward's
  layers share;
* `interfaces.py`: `patch`, `unpatch` (the backend registered with transformers); `registration.py`: `configure`;
* `lean_loss.py`: `enable_lean_loss` / `disable_lean_loss` (causal-LM loss without full logits);
* `models.py`: which models context parallelism supports; `architectures.py`: the architectures the plugin knows,
  one table by `model_type` (the lean loss's classes, the token tiles' modules, the families CP was tested exact on);
* `compiled.py`: the `sparse_cp` call inside a graph torch.compile traces (two opaque custom ops, no graph break);
* `memory_savers.py`: the memory savers (token tiles, host offload) applied to a model's modules, reversibly;
  `fused_ops.py`: the decoder layers' work around attention fused (`--sparse_fused_ops`), reversibly;
* `positions.py`: the position tables of decoders that count positions from their input's length (the BART family)
  fed the CP shard's positions; `planner_weights.py`: the document planner's weight of a token's linear work;
* `heads.py`: the head a model has, and the hook that gives a sequence-classification or question-answering head the
  batch's outputs under context parallelism;
* `composite.py`: the backend selected for a composite model's language model, its towers keeping their attention;
* `kv_sharing.py`: Gemma 4's KV-shared layers handed their inputs whole under sparse_cp (not sliced as 4D-masked);
* `kernel_routing.py`: modules routing functions through the Hub's `kernels` package skip it while none is
  kernelized (a compiled, activation-checkpointed layer then traces whole);
* `stats.py`: the per-layer kept fraction the backend records;
* `adapters.py`: whether a model trains a PEFT adapter, however it was added (what the checkpoint checks count as one);
* `given.py`: the public entry points' first argument checked for its type (a TypeError naming what to pass);
* `patching.py`: `PatchSet`, the recorder every change to someone else's object goes through;
* `compat.py`: every private transformers / accelerate / torch / Triton member we use, and every
  replacement we make, with why, the tested versions and the undo; `compat_checks.py`: that table read against what
  is installed (each member present as used, the entry that allows a change); `upstream.py`: the calls that use those
  members, each checked first; `trainer_losses.py`: the Trainer and TRL losses CP reproduces, by how;
  `fsdp_class_names.py`: a model's class past FSDP2's renaming, for upstream checks by class name.

The Trainer glue lives in `hf_sparse_cp.trainer`, reporting in `hf_sparse_cp.reporting`; the public
names are exported by `hf_sparse_cp` itself.
"""
