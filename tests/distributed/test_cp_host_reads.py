"""Host reads of a sparse CP 2 training step (`testing.host_reads`), per rank: the batch's documents are read once
per step under the ring (the shard's metadata is the batch's); the other reads are pinned at their measured counts
(the ring's plan and candidate exchange read per layer and ring step), so that a new one fails here."""

import collections

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.testing.host_reads import count_host_reads
from hf_sparse_cp.testing.spawn import run_gloo
from hf_sparse_cp.testing.tiny_models import tiny_config

SEQ, BLOCK = 512, 32


def _step_reads(rank: int, world: int, cp_mode: str) -> dict:
    from hf_sparse_cp.distributed import ContextParallelConfig, ParallelDims, prepare_context_parallel_inputs

    hf_sparse_cp.patch()
    par = ParallelDims.from_config(ContextParallelConfig(cp_size=world, cp_mode=cp_mode))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97, num_hidden_layers=4, hidden_size=64,
                                                         head_dim=16))
    hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=BLOCK, min_seq_len=128, sink_tokens=4,
                                                        local_window=BLOCK, dense_first_layers=1))
    ids = torch.randint(3, 97, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with count_host_reads() as reads:
        inputs = prepare_context_parallel_inputs({"input_ids": ids, "labels": ids}, par, block_size=BLOCK)
        targets = inputs.pop("shift_labels")
        del inputs["labels"]
        F.cross_entropy(model(**inputs).logits[0], targets[0], reduction="sum").backward()
    by_function = collections.Counter()
    for (site, _), n in reads.sites.items():
        if site.startswith("hf_sparse_cp/"):
            by_function[f"{site.split(':')[0]} {site.split(' ')[1]}"] += n
    return dict(by_function)


A, R = "hf_sparse_cp/attention/", "hf_sparse_cp/distributed/ring/"
# Per rank, 4 layers (3 sparse), one step. Ring: the documents once; per layer the layout's sizes (build_layout: one
# per layer, one more per sparse layer); per sparse layer the exchanged candidates' sizes (estimation); per layer and
# ring step the plan's block lists and transfer sizes (plan, compact_sorted).
RING = {f"{A}tokens.py document_table": 1, f"{A}build.py build_layout": 7, f"{A}layout.py compact_sorted": 8,
        f"{R}estimation.py _sharded_scores": 15, f"{R}estimation.py _candidates_of_every_rank": 6,
        f"{R}plan.py blocks": 44, f"{R}plan.py read_matrix": 8, f"{R}plan.py column_tokens": 8,
        f"{R}plan.py _bar_step": 4, f"{R}plan.py slot_ops": 16}
# Ulysses: each sparse layer's gathered metadata reads its documents (one per sparse layer), and the layout's sizes.
ULYSSES = {f"{A}tokens.py document_table": 3, f"{A}build.py build_layout": 7}


def test_host_reads_of_a_cp2_step_are_pinned():
    assert run_gloo(_step_reads, 2, "ring", timeout_s=300) == [RING, RING]
    assert run_gloo(_step_reads, 2, "ulysses", timeout_s=300) == [ULYSSES, ULYSSES]
