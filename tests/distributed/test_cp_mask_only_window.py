"""A sliding window that only the attention mask carries (PhiMoE) under CP 2: packed documents that fit in it give
one process's logits, and a document longer than it is refused by every rank alike (each decides from the whole
batch's documents, so none is left waiting in a collective)."""

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.testing.spawn import run_gloo
from hf_sparse_cp.testing.tiny_models import tiny_config

from oracle import rel_rms

BLOCK, WINDOW = 16, 24
PATTERN = SparseAttentionConfig(block_size=BLOCK, dense_first_layers=0)


def _under_cp2(rank: int, world: int) -> dict:
    from hf_sparse_cp.distributed import ContextParallelConfig, ParallelDims, prepare_context_parallel_inputs

    hf_sparse_cp.patch()
    torch.manual_seed(0)
    config = tiny_config("phimoe", vocab_size=97, sliding_window=WINDOW)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager").double().eval()
    hf_sparse_cp.configure(model, PATTERN)
    par = ParallelDims.from_config(ContextParallelConfig(cp_size=world))
    ids = torch.randint(3, 97, (1, 4 * WINDOW), generator=torch.Generator().manual_seed(1))
    results = {}
    for name, lengths in (("fit", (WINDOW, 10, WINDOW - 3, WINDOW, 17)),
                          ("longer", (WINDOW + 1, 3 * WINDOW - 1))):
        packed = {"input_ids": ids, "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
                  "use_cache": False}
        inputs = prepare_context_parallel_inputs(packed, par, block_size=BLOCK)
        try:
            local = model(**inputs).logits.contiguous()
        except ValueError as e:
            results[name] = str(e)
            continue
        shards = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(shards, local)
        full = inputs["cp_shard"].plan.unshard(shards)[:, :ids.shape[1]]
        results[name] = rel_rms(full, model(**packed).logits)
    return results


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_gloo(_under_cp2, 2, timeout_s=900)


def test_documents_within_the_window_give_one_process_logits(results):
    for rank in results:
        assert rank["fit"] <= 1e-10


def test_a_document_longer_than_the_window_is_refused_on_every_rank(results):
    for rank in results:
        assert isinstance(rank["longer"], str) and f"a document of {3 * WINDOW - 1} tokens" in rank["longer"]
