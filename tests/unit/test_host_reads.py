"""Reads of tensor data back to the host in a training step (`tests/host_reads.py`): on a GPU each one stalls the
host until the device's queue drains. A sparse one-process step reads the batch's documents once per forward and
two layout sizes per sparse layer; a regression (a read per layer where one per batch does) fails here."""

import collections

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention import dense
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.integration.stats import pop_kept_fractions
from hf_sparse_cp.testing.tiny_models import tiny_config

from host_reads import count_host_reads

LAYERS, SEQ = 4, 512


def test_the_counter_sees_each_kind_of_read_and_restores_torch():
    x = torch.arange(6.0)
    item, getitem = torch.Tensor.item, torch.Tensor.__getitem__
    own = set(vars(torch.Tensor))
    with count_host_reads() as reads:
        x.sum().item()
        x[x > 2].sum()
        torch.repeat_interleave(x, torch.tensor([1, 0, 2, 1, 1, 1]))
        torch.repeat_interleave(x, torch.tensor([1, 0, 2, 1, 1, 1]), output_size=6)  # sized: no read
        bool(x.any())
        host = x.cpu()  # one copy, one read; what is computed from it on the host reads nothing
        host.numpy(), host[host > 2].tolist(), int(host.nonzero().max()), torch.arange(3).tolist()
        x[1:3] + x.nonzero().float().sum()
    kinds = collections.Counter(kind for _, kind in reads.sites.elements())
    assert kinds == {"item": 1, "bool-mask index": 1, "repeat_interleave": 1, "bool": 1, "cpu": 1, "nonzero": 1}
    assert all(site.startswith("tests/unit/test_host_reads.py:") for site, _ in reads.sites)
    assert torch.Tensor.item is item and torch.Tensor.__getitem__ is getitem
    # restored as found: an inherited method left on the class made every tensor a sequence (a list of 0-d tensors
    # then failed in torch.tensor, as Qwen2-VL's rope index does, in every later test of the process)
    assert set(vars(torch.Tensor)) == own
    assert torch.tensor([torch.tensor(-2), torch.tensor(3)]).tolist() == [-2, 3]


def _reads_by_function(mode: str, attention_mask: bool) -> collections.Counter:
    hf_sparse_cp.patch()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97, num_hidden_layers=LAYERS,
                                                         hidden_size=64, head_dim=16))
    budget = {"mass": dict(mass_target=0.3), "topk": dict(vertical_topk=6, slash_topk=6)}[mode]
    hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=16, min_seq_len=64, budget_mode=mode, sink_tokens=2,
                                                        local_window=8, last_q=16, dense_first_layers=1, **budget))
    ids = torch.randint(3, 97, (1, SEQ), generator=torch.Generator().manual_seed(1))
    left_padded = torch.arange(SEQ).ge(5).long().unsqueeze(0)  # (an all-ones mask reaches no layer)
    mask = {"attention_mask": left_padded} if attention_mask else {}
    with count_host_reads() as reads:
        out = model(input_ids=ids, **mask)
        F.cross_entropy(out.logits[0, :-1], ids[0, 1:]).backward()
    # The top-k budget skips blocks here (a random model's near-uniform attention takes nearly every block to reach
    # a mass target): the counts are those of the sparse path either way.
    assert mode != "topk" or min(pop_kept_fractions(model).values()) < 0.5
    by_function = collections.Counter()
    for (site, _), n in reads.sites.items():
        if site.startswith("hf_sparse_cp/"):
            path, function = site.split(" ")
            by_function[f"{path.split(':')[0]} {function}"] += n
    return by_function


def test_a_sparse_step_reads_the_documents_once_and_two_sizes_per_sparse_layer():
    for mode in ("mass", "topk"):
        assert _reads_by_function(mode, attention_mask=False) == {
            "hf_sparse_cp/attention/tokens.py document_table": 1,  # the batch's documents, once per forward
            # per sparse layer the widest window of kept key columns (only a vertical-slash estimate has columns: the
            # sparse path ran); per layer the layout's widths
            "hf_sparse_cp/attention/build.py build_layout": (LAYERS - 1) + LAYERS,
        }, mode


def test_a_padding_mask_adds_one_read_per_forward():
    assert _reads_by_function("mass", attention_mask=True) == {
        "hf_sparse_cp/attention/tokens.py document_table": 1,
        "hf_sparse_cp/attention/tokens.py padding_between_tokens": 1,  # once per mask (`padding_between_tokens_once`)
        "hf_sparse_cp/attention/build.py build_layout": (LAYERS - 1) + LAYERS,
    }


def test_dense_layers_read_nothing_past_the_batchs_documents():
    """The flash-attn and SDPA paths of a dense layer (CUDA only) find their documents from `TokenMeta.documents`:
    the batch's one read, then none per layer."""
    meta = TokenMeta.from_segments(torch.tensor([[0] * 5 + [1] * 4 + [-1] * 3, [-1] * 2 + [0] * 4 + [1] * 6]))
    with count_host_reads() as reads:
        for _ in range(LAYERS):
            keep, cu_seqlens, longest = dense.varlen_documents(meta)
            assert not dense.plain_causal_rows(meta, None)
    (site, kind), = reads.sites.elements()  # one read in all
    assert kind == "cpu" and site.startswith("hf_sparse_cp/attention/tokens.py:") and "document_table" in site
    assert keep.tolist() == [*range(9), *range(14, 24)] and cu_seqlens.tolist() == [0, 5, 9, 13, 19] and longest == 6
