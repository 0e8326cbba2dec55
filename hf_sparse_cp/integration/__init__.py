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
* `models.py`: which models context parallelism supports;
* `heads.py`: the head a model has, and the hook that gives a sequence-classification or question-answering head the
  batch's outputs under context parallelism;
* `composite.py`: the backend selected for a composite model's language model, its towers keeping their attention;
* `kv_sharing.py`: Gemma 4's KV-shared layers handed their inputs whole under sparse_cp (not sliced as 4D-masked);
* `stats.py`: the per-layer kept fraction the backend records;
* `given.py`: the public entry points' first argument checked for its type (a TypeError naming what to pass);
* `patching.py`: `PatchSet`, the recorder every change to someone else's object goes through;
* `compat.py`: every private transformers / accelerate / torch / Triton member we use, and every
  replacement we make, with why, the tested versions and the undo; `upstream.py`: the calls that use those members,
  each checked first; `trainer_losses.py`: the Trainer and TRL losses CP reproduces, by how;
  `fsdp_class_names.py`: a model's class past FSDP2's renaming, for upstream checks by class name.

The Trainer glue lives in `hf_sparse_cp.trainer`, reporting in `hf_sparse_cp.reporting`; the public
names are exported by `hf_sparse_cp` itself.
"""
