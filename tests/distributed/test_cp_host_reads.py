"""Host reads of a sparse CP 2 training step (`tests/host_reads.py`), per rank and site: the batch's documents once per
step, and per layer what only the device knows (the sizes of data-dependent layouts, what the ring plans its
transfers from), so that a new read fails here."""

import collections

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.testing.spawn import run_gloo_each
from hf_sparse_cp.testing.tiny_models import tiny_config

from host_reads import count_host_reads

SEQ, BLOCK = 512, 32


def _step_reads(rank: int, world: int, cp_mode: str, fsdp_bf16: bool = False) -> dict:
    from hf_sparse_cp.distributed import ContextParallelConfig, ParallelDims, prepare_context_parallel_inputs

    hf_sparse_cp.patch()
    par = ParallelDims.from_config(ContextParallelConfig(cp_size=world, cp_mode=cp_mode))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97, num_hidden_layers=4, hidden_size=64,
                                                         head_dim=16))
    hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=BLOCK, min_seq_len=128, sink_tokens=4,
                                                        local_window=BLOCK, dense_first_layers=1))
    if fsdp_bf16:  # FSDP2 with bf16 parameters: its pre-forward hooks cast the inputs of the model and of each layer
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    ids = torch.randint(3, 97, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with count_host_reads() as reads:
        inputs = prepare_context_parallel_inputs({"input_ids": ids, "labels": ids}, par, block_size=BLOCK)
        targets = inputs.pop("shift_labels")
        del inputs["labels"]
        F.cross_entropy(model(**inputs).logits[0].float(), targets[0], reduction="sum").backward()
    by_function = collections.Counter()
    for (site, _), n in reads.sites.items():
        if site.startswith("hf_sparse_cp/"):
            by_function[f"{site.split(':')[0]} {site.split(' ')[1]}"] += n
    return dict(by_function)


A = "hf_sparse_cp/attention/"
# Per rank, 4 layers (3 sparse), one step. Ring: the documents once; per layer the layout's widths (build_layout; a
# sparse layer one more: the widest window of kept columns), one copy of what the ring plans from (the read matrix,
# its columns, its rows' readers: RingPlan) and per ring step the width of that step's blocks (compact_sorted).
RING = {f"{A}tokens.py document_table": 1, f"{A}build.py build_layout": 7, f"{A}layout.py compact_sorted": 8,
        "hf_sparse_cp/distributed/ring/plan.py __init__": 4}
# Ulysses: the documents once, and the layout's sizes.
ULYSSES = {f"{A}tokens.py document_table": 1, f"{A}build.py build_layout": 7}


def test_host_reads_of_a_cp2_step_are_pinned():
    """Under FSDP2 with bf16 parameters too: its input cast rebuilt the CP shard (then a dataclass) at every layer it
    wraps, and each copy read the documents back again (document_table 3 times in this step, 7 with 8 layers)."""
    calls = {mode: (_step_reads, (mode,)) for mode in ("ring", "ulysses")}
    reads = run_gloo_each({**calls, "ring-fsdp2-bf16": (_step_reads, ("ring", True))}, 2, timeout_s=600)
    assert reads == {"ring": [RING, RING], "ulysses": [ULYSSES, ULYSSES], "ring-fsdp2-bf16": [RING, RING]}
