"""A CP mode of a user's own, registered with `register_cp_mode`, is selectable by `ContextParallelConfig(cp_mode=...)`
and runs its own attention under CP 2 (gloo), equal to one process: the config refused every name but the built-in
ones, and a mode whose head groups are one rank ran the built-in ring in its place (#50)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.distributed.modes.ring import RingMode
from hf_sparse_cp.testing.spawn import run_gloo
from hf_sparse_cp.testing.tiny_models import tiny_config

from oracle import rel_rms

SEQ = 135
PATTERN = SparseAttentionConfig(block_size=16, min_seq_len=64, vertical_topk=6, slash_topk=6, sink_tokens=2,
                                local_window=8, last_q=16, dense_first_layers=0)


class CountedRing(RingMode):
    """The ring, counting the attention calls it computes (a plug-in that wraps a built-in mode)."""

    name = "counted_ring"
    help = "the sparse ring, its calls counted"
    calls = 0

    def attention(self, *args, **kwargs):
        type(self).calls += 1
        return super().attention(*args, **kwargs)


COUNTED_RING = CountedRing()


def _plugin_mode_under_cp2(rank: int, world: int) -> tuple[float, int, str]:
    from hf_sparse_cp.distributed import (
        ContextParallelConfig,
        ParallelDims,
        prepare_context_parallel_inputs,
        register_cp_mode,
    )

    hf_sparse_cp.patch()
    register_cp_mode(COUNTED_RING)  # (in each spawned process: the test's own registry stays the built-in one)
    parallel = ParallelDims.from_config(ContextParallelConfig(cp_size=world, cp_mode="counted_ring"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97)).double().eval()
    hf_sparse_cp.configure(model, PATTERN)
    ids = torch.randint(3, 97, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        inputs = prepare_context_parallel_inputs({"input_ids": ids}, parallel, block_size=16, sparse_config=PATTERN)
        local = model(**inputs).logits
    plan = inputs["cp_shard"].plan
    lengths = [plan.local_len_of(r) for r in range(world)]
    local = F.pad(local, (0, 0, 0, max(lengths) - local.shape[1]))
    shards = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(shards, local.contiguous())
    full = plan.unshard([shard[:, :n] for shard, n in zip(shards, lengths)])[:, :SEQ]
    return rel_rms(full, ref), CountedRing.calls, parallel.mode.name


def test_a_registered_cp_mode_runs_its_own_attention_under_cp2():
    for error, calls, mode in run_gloo(_plugin_mode_under_cp2, 2, timeout_s=300):
        assert mode == "counted_ring"
        assert calls == 2  # one call per attention layer of the tiny model: the plug-in's, not the built-in ring's
        assert error < 1e-12
