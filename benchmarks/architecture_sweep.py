"""The plugin's rule for every transformers causal-LM type, checked on tiny random models: a model either trains
with sparse_cp as with sdpa (or eager, where it has no sdpa), every block kept, and runs a sparse pattern, or it is
refused at set-up (`hf_sparse_cp.configure`) with an error that names the fix. Any third outcome is a defect.

Each type runs in a subprocess of its own with a timeout (some builds hang or are huge), N at a time. Per type, in
float64 (`hf_sparse_cp.testing.tiny_models.tiny_config`, vocabulary 97; --overrides gives fields per type, e.g. a
sliding window shorter than the rows):
* the reference (sdpa, else eager) and a copy switched by `configure` with every block kept: logits, loss and
  gradients on one row of 48 tokens and on a right-padded batch of two; a difference beyond float64 rounding is set
  against eager's own difference from the reference (eager computes its softmax or sinks in float32), or float32's
  rounding where eager is the reference, before it is called a defect;
* the same weights loaded with attn_implementation='sparse_cp' and no `configure`: equal, or refused naming the fix;
* a sparse pattern (vertical-slash, 2 + 2 blocks of 16) on a row of 160: finite, fewer blocks kept;
* the CP check (`check_model_supports_context_parallel`): passes, or names its cause (information only).

Outcomes: ok; refused (the refusal names a fix); tiny_refused / build_fail / ref_fail (tiny_config or transformers
builds or runs no such model: give overrides); timeout; DEFECT_* (a silent wrong result, a crash without a fix, a
refusal without one, a sparse pattern that fails).

    python benchmarks/architecture_sweep.py                          # every causal-LM type outside the table
    python benchmarks/architecture_sweep.py --types gemma2,olmo3 --overrides '{"olmo3": {"sliding_window": 24}}'
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
import traceback

VOCAB = 97
# Words of a refusal that names a fix (a flag, an implementation, an override, another type).
FIX_WORDS = ("--sparse_attention false", "attn_implementation", "--tiny_model_type", "--cp_size", "Upgrade", "give ",
             "Give ", "Set it", "set ", "use ", "fix it")


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:600]}"


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def check_type(model_type: str, overrides: dict, result: dict) -> str:
    """Check `model_type` (its tiny model with `overrides`), filling `result`; returns the outcome."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig
    from hf_sparse_cp.integration.models import check_model_supports_context_parallel
    from hf_sparse_cp.integration.stats import pop_kept_fractions
    from hf_sparse_cp.testing.tiny_models import tiny_config

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    names_fix = lambda message: any(word in message for word in FIX_WORDS)  # noqa: E731
    try:
        config = tiny_config(model_type, vocab_size=VOCAB, **overrides)
    except ValueError as e:
        result["msg"] = str(e)[:800]
        return "tiny_refused"
    mapping = AutoModelForCausalLM._model_mapping
    if type(config) not in mapping:
        result["msg"] = f"no causal LM for {type(config).__name__}"
        return "build_fail"
    model_class = mapping[type(config)]
    ref_impl = "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
    result["ref"] = ref_impl

    def build(impl=None):
        kwargs = {"attn_implementation": impl} if impl else {}
        config = tiny_config(model_type, vocab_size=VOCAB, **overrides)
        try:  # (eager experts: torch's grouped matmul takes no float64)
            return AutoModelForCausalLM.from_config(config, experts_implementation="eager", **kwargs)
        except TypeError:
            return AutoModelForCausalLM.from_config(config, **kwargs)

    torch.manual_seed(0)
    try:
        ref = build(ref_impl).double().eval()
    except Exception as e:
        result["msg"] = _short(e)
        return "build_fail"
    ids = torch.randint(3, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 35:] = 0
    batches = [{"input_ids": ids[:1], "labels": ids[:1]},
               {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}]

    def run(model, batch):
        model.zero_grad(set_to_none=True)
        out = model(**batch, use_cache=False)
        loss = out.loss if out.loss is not None else out.logits.float().mean()
        loss.backward()
        return out.logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    def compare(refs, got):
        """The largest relative difference of logits (real tokens) and loss, and of any gradient (to its own norm,
        or a millionth of the whole where it is zero but for rounding)."""
        worst_logits, worst_grad = 0.0, 0.0
        for (ref_logits, ref_loss, ref_grads), (logits, loss, grads), batch in zip(refs, got, batches):
            real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
            worst_logits = max(worst_logits, _rel(logits[real], ref_logits[real]),
                               abs(float(loss - ref_loss)) / max(abs(float(ref_loss)), 1e-30))
            floor = 1e-6 * torch.stack([g.norm() for g in ref_grads.values() if g is not None]).norm()
            for name, grad in grads.items():
                if (grad is None) != (ref_grads[name] is None):
                    return worst_logits, float("inf")
                if grad is not None:
                    worst_grad = max(worst_grad, float((grad - ref_grads[name]).norm()
                                                       / torch.maximum(ref_grads[name].norm(), floor)))
        return worst_logits, worst_grad

    try:
        refs = [run(ref, batch) for batch in batches]
    except Exception as e:
        result["msg"] = _short(e)
        return "ref_fail"
    ours = build().double()
    ours.load_state_dict(ref.state_dict())
    ours.eval()
    hf_sparse_cp.patch()
    every_block = SparseAttentionConfig(block_size=16, min_seq_len=0, vertical_topk=10**4, slash_topk=10**4,
                                        dense_first_layers=0)
    try:
        hf_sparse_cp.configure(ours, every_block)
    except ValueError as e:
        result["msg"] = str(e)[:800]
        direct = _direct_load(build, ref, batches[1], refs[1][0], mask, result, names_fix)
        if direct:
            return direct
        return "refused" if names_fix(str(e)) else "DEFECT_refused_without_fix"
    except Exception as e:
        result.update(msg=_short(e), tb="".join(traceback.format_exception(e)[-4:])[-1500:])
        return "DEFECT_configure_crash"
    try:
        got = [run(ours, batch) for batch in batches]
    except ValueError as e:  # (refused at its first call: a window only its mask holds, which no set-up check saw)
        result["msg"] = str(e)[:800]
        return "refused_at_first_call" if names_fix(str(e)) else "DEFECT_refused_without_fix"
    except Exception as e:
        result.update(msg=_short(e), tb="".join(traceback.format_exception(e)[-4:])[-1500:])
        return "DEFECT_forward_crash"
    result["kept"] = pop_kept_fractions(ours)
    result["logits_rel"], result["grad_rel"] = compare(refs, got)
    if not result["kept"]:
        return "DEFECT_silent_dense"  # (no attention call took the sparse path)
    if result["logits_rel"] > 1e-9 or result["grad_rel"] > 1e-7:  # beyond float64 rounding: eager's own noise?
        other = "eager" if ref_impl == "sdpa" else "sdpa"
        try:
            alt = build(other).double().eval()
            alt.load_state_dict(ref.state_dict())
            noise = compare(refs, [run(alt, batch) for batch in batches])
        except Exception:  # (eager alone, which computes in float32 where its family says so: float32's rounding)
            noise = (1e-7, 1e-6)
        result["noise"] = {other: noise}
        if result["logits_rel"] > 10 * noise[0] + 1e-12 or result["grad_rel"] > 10 * noise[1] + 1e-10:
            return "DEFECT_differs"
    direct = _direct_load(build, ref, batches[1], refs[1][0], mask, result, names_fix)
    if direct:
        return direct
    try:  # a sparse pattern: it runs, finite, on fewer blocks
        hf_sparse_cp.configure(ours, SparseAttentionConfig(block_size=16, min_seq_len=0, vertical_topk=2, slash_topk=2,
                                                           local_window=16, sink_tokens=0, dense_first_layers=0))
        row = torch.randint(3, VOCAB, (1, 160), generator=torch.Generator().manual_seed(2))
        logits, _, grads = run(ours, {"input_ids": row, "labels": row})
        result["sparse_kept"] = pop_kept_fractions(ours)
        if not (torch.isfinite(logits).all() and all(g is None or torch.isfinite(g).all() for g in grads.values())):
            return "DEFECT_sparse_nonfinite"
    except Exception as e:
        result.update(msg=_short(e), tb="".join(traceback.format_exception(e)[-4:])[-1500:])
        return "DEFECT_sparse_crash"
    try:
        check_model_supports_context_parallel(ours)
        result["cp_check"] = "pass"
    except ValueError as e:
        result["cp_check"] = f"refused: {str(e)[:300]}"
    return "ok"


def _direct_load(build, ref, batch, ref_logits, mask, result: dict, names_fix) -> str | None:
    """The model loaded with attn_implementation='sparse_cp', no `configure`, on the padded batch: None where it
    equals the reference (to float32's rounding where eager is the reference) or is refused naming the fix, else the
    defect."""
    import torch

    try:
        model = build("sparse_cp").double().eval()
        model.load_state_dict(ref.state_dict())
        with torch.no_grad():
            logits = model(**batch, use_cache=False).logits
        result["direct_rel"] = _rel(logits[mask.bool()], ref_logits[mask.bool()])
        bound = 1e-6 if result["ref"] == "eager" else 1e-8
        return "DEFECT_direct_load_differs" if result["direct_rel"] > bound else None
    except ValueError as e:
        result["direct"] = str(e)[:300]
        return None if names_fix(str(e)) else "DEFECT_direct_load_refused_without_fix"
    except Exception as e:
        result["direct"] = _short(e)
        return "DEFECT_direct_load_crash"


def _one(model_type: str, overrides: dict) -> None:
    result = {"type": model_type}
    try:
        result["outcome"] = check_type(model_type, overrides, result)
    except Exception as e:  # (the harness's own failure: reported, not a verdict)
        result.update(outcome="harness_error", msg=_short(e))
    print("RESULT " + json.dumps(result, default=str), flush=True)
    os._exit(0)  # (threads of a model's build can hold the exit)


def _spawn(model_type: str, overrides: dict, timeout: int) -> dict:
    start = time.time()
    try:
        done = subprocess.run([sys.executable, __file__, "--one", model_type, "--overrides", json.dumps(overrides)],
                              capture_output=True, text=True, timeout=timeout)
        line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
        result = json.loads(line[7:]) if line else {"type": model_type, "outcome": "DEFECT_no_result",
                                                    "msg": done.stderr[-1500:]}
    except subprocess.TimeoutExpired:
        result = {"type": model_type, "outcome": "timeout"}
    result["seconds"] = round(time.time() - start, 1)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="", help="comma-separated model types (default: every transformers "
                        "causal-LM type outside the architecture table; 'all': every one)")
    parser.add_argument("--overrides", default="{}", help="JSON: {model_type: {field: value}} for tiny_config")
    parser.add_argument("--jobs", type=int, default=2, help="types checked at once")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per type")
    parser.add_argument("--out", default="", help="a JSON-lines file to append each type's result to")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    overrides = json.loads(args.overrides)
    if args.one:
        _one(args.one, overrides)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from hf_sparse_cp.integration.architectures import ARCHITECTURES

    if args.types in ("", "all"):
        types = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - (set() if args.types else set(ARCHITECTURES)))
    else:
        types = args.types.split(",")
    results = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for result in pool.map(lambda t: _spawn(t, overrides.get(t, {}), args.timeout), types):
            results.append(result)
            detail = result.get("msg") or (f"logits {result.get('logits_rel', 0):.1e}, grads "
                                           f"{result.get('grad_rel', 0):.1e}; CP check: {result.get('cp_check')}")
            print(f"{result['type']:<28} {result['outcome']:<24} {detail[:160]}", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(result, default=str) + "\n")
    outcomes = {}
    for result in results:
        outcomes.setdefault(result["outcome"], []).append(result["type"])
    for outcome, names in sorted(outcomes.items()):
        print(f"{outcome}: {len(names)}: {', '.join(names)}")


if __name__ == "__main__":
    main()
