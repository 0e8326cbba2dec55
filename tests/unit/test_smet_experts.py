"""SMET on an MoE's fused experts (transformers 5: `experts.gate_up_proj` / `experts.down_proj`, [experts, ., .]):
every expert's matrix is sparse as a 2-D nn.Linear weight is, in the layout its family stores it."""

import logging

import pytest
import torch

from hf_sparse_cp.smet import SMETAdam, SMETConfig, create_smet_optimizer

from smet_common import assert_resumes_exactly, fit, markov_tokens, tiny_moe

pytestmark = pytest.mark.usefixtures("single_thread")

# Where each expert's inputs run, read off transformers 5.24's eager experts: Mixtral, Qwen3-MoE and JetMoE's parallel
# experts apply `F.linear(x, W[e])` ([experts, out, in]), GPT-OSS `x @ W[e]` and Llama 4 `torch.bmm(x, W)` ([experts,
# in, out]). Mixtral's, Qwen's and GPT-OSS's experts say so (`is_transposed`); JetMoE's give their `input_size` and
# `output_size`, Llama 4's neither: its layout is read off which side of a stack is the hidden size (64).
INPUT_DIM = {"mixtral": 2, "qwen3_moe": 2, "gpt_oss": 1, "llama4_text": 1, "jetmoe": 2}
# Model fields (every stack's inputs a whole number of 16-blocks, 2 or more, and no square expert matrix) and targets
# (JetMoE's experts are modules of their own, `input_linear` / `output_linear`, in its MLP and its attention).
SETUP = {"llama4_text": (dict(intermediate_size=96, intermediate_size_mlp=64), {}),
         "jetmoe": (dict(intermediate_size=96), dict(target_modules=["input_linear", "output_linear", "kv_proj"]))}
STACKS = ("gate_up_proj", "down_proj")


def _moe(arch, seed=0, dtype=torch.float32):
    return tiny_moe(arch, seed, dtype, **SETUP.get(arch, ({}, {}))[0])


def _config(arch, **fields):
    return SMETConfig(**fields, **SETUP.get(arch, ({}, {}))[1])


def _experts(model):
    return {n: p for n, p in model.named_parameters() if p.dim() == 3}


def _per_expert_matrices(arch, stack):
    """The stack's experts as [experts, out, in]."""
    return stack if INPUT_DIM[arch] == 2 else stack.transpose(1, 2)


@pytest.mark.parametrize("arch", list(INPUT_DIM))
def test_fused_experts_train_sparse_at_the_density_asked_in_every_expert_row(arch):
    """The experts (70-85% of an MoE's parameters) were trained dense with AdamW's whole state, only a warning at
    set-up; now every output row of every expert keeps density x blocks of consecutive inputs, the others stay zero
    through steps and topology updates, and the optimizer state holds the active weights only."""
    block, density = 16, 0.5
    model = _moe(arch)
    opt = create_smet_optimizer(model, torch.optim.AdamW, _config(arch, density=density, block_size=block,
                                                                  update_interval=2), lr=1e-2)
    stacks = _experts(model)
    assert len(stacks) == (4 if arch == "jetmoe" else 2)
    sparse = {n for g in opt.param_groups if g["smet"] for n in g["param_names"]}
    assert set(stacks) <= sparse
    first = {n: opt.state[p]["block_index"].clone() for n, p in stacks.items()}
    # (7 steps: the blocks regrown at the third topology update, step 6, hold zeros until they train)
    fit(model, opt, [markov_tokens(4, 16, seed=s) for s in range(7)])
    assert opt.topology_updates == 3
    moved = 0
    for name, stack in stacks.items():
        matrices = _per_expert_matrices(arch, stack.detach())
        experts, rows, cols = matrices.shape
        kept = matrices.reshape(experts, rows, cols // block, block).abs().sum(-1) != 0
        # every row of every expert: exactly half its blocks, the rest exactly zero
        assert (kept.sum(-1) == int(density * cols // block)).all(), name
        state = opt.state[stack]
        active = state["exp_avg"].numel()
        assert active == state["exp_avg_sq"].numel() == int(density * stack.numel()) == int(stack.count_nonzero())
        moved += int((state["block_index"] != first[name]).sum())
    assert moved > 0  # (the topology moved in the experts too)
    assert opt.trained_density() == density
    # smet/density counts the experts: here they are all the sparse weights
    # (stacks of 4 blocks a row: Llama 4's down_proj has 6; its shared expert's down_proj is an nn.Linear)
    targets = {"jetmoe": ["input_linear"], "llama4_text": ["gate_up_proj"]}.get(arch, ["up_proj", "down_proj"])
    only = create_smet_optimizer(_moe(arch), config=SMETConfig(density=0.25, block_size=16, target_modules=targets))
    assert [n for g in only.param_groups if g["smet"] for n in g["param_names"]] == [
        n for n in stacks if any(t in n for t in targets)]
    assert only.trained_density() == 0.25


@pytest.mark.parametrize("arch, mode", [("mixtral", "sparse_weights"), ("qwen3_moe", "sparse_update"),
                                        ("gpt_oss", "sparse_weights"), ("llama4_text", "sparse_update"),
                                        ("jetmoe", "sparse_weights")])
def test_fused_experts_resume_bit_identically_from_a_state_dict_saved_by_expert(arch, mode):
    config = _config(arch, mode=mode, density=0.5, block_size=16, update_interval=3, regrowth="gradient",
                        regrow_warmup_steps=4, prune_decay_steps=20)
    batches = [markov_tokens(4, 16, seed=s) for s in range(10)]

    def saved_by_expert(first, opt1, saved):
        # saved expert by expert (as FSDP2 shards the stack): [experts, rows of an expert, active blocks]
        positions = {n: i for g in opt1.state_dict()["param_groups"] for i, n in zip(g["params"], g["param_names"])}
        for name, stack in _experts(first).items():
            index = saved["optimizer"]["state"][positions[name]]["block_index"]
            experts, rows, cols = _per_expert_matrices(arch, stack).shape
            assert index.shape == (experts, rows, cols // 16 // 2), name

    assert_resumes_exactly(lambda seed=0: _moe(arch, seed=seed), config, batches, 5, saved_by_expert)


def test_expert_stacks_whose_layout_their_shape_leaves_open_stay_dense_with_a_warning_saying_why(caplog):
    """Llama 4's and JetMoE's experts do not say how they are stored: a stack whose shape fits both layouts (Llama 4's
    gate_up_proj [experts, 64, 2 x 32] of hidden size 64; JetMoE's output_linear of input_size = output_size) stays
    dense and set-up says so, naming it and why; the stacks of the same models that their shapes do tell are sparse.
    Mixtral's and GPT-OSS's say their layout: nothing said."""
    from hf_sparse_cp.smet import factory

    def warnings(model, **fields):
        factory._warn_dense.cache_clear()  # (said once per set-up: another test may have built this one)
        with caplog.at_level(logging.WARNING, logger="hf_sparse_cp.smet"):
            caplog.clear()
            opt = create_smet_optimizer(model, config=SMETConfig(block_size=16, **fields))
        return [r.getMessage() for r in caplog.records if "dense" in r.getMessage()], {
            n for g in opt.param_groups if g["smet"] for n in g["param_names"] if n in _experts(model)}

    said, sparse = warnings(tiny_moe("llama4_text", intermediate_size=32, intermediate_size_mlp=64))
    assert sparse == {"model.layers.0.feed_forward.experts.down_proj"}
    assert len(said) == 1 and said[0].startswith(
        "SMET trains 1 matrices that target_modules names dense, with AdamW's whole optimizer state "
        "(model.layers.0.feed_forward.experts.gate_up_proj, ...: "), said
    assert ("is a stack of expert matrices (4, 64, 64) whose module does not say how they are stored (transformers' "
            "`is_transposed`), and the hidden size 64 that it reads and the intermediate size 32 fit both [experts, "
            "out, in] and [experts, in, out]") in said[0]
    assert said[0].endswith("--smet_target_modules down_proj,gate_proj,k_proj,o_proj,q_proj,v_proj."), said
    # the hidden size on one side is not enough: the other must be the intermediate size (or, fused, two of them)
    odd = _moe("llama4_text")
    experts = odd.model.layers[0].feed_forward.experts
    experts.intermediate_size = experts.expert_dim = 80
    said, sparse = warnings(odd, density=0.5)
    assert sparse == set() and "reads and the intermediate size 80 fit neither" in said[0], said
    said, sparse = warnings(tiny_moe("jetmoe"), target_modules=["input_linear", "output_linear"])
    assert sparse == {"model.layers.0.mlp.input_linear.weight", "model.layers.0.self_attention.experts.input_linear"
                      ".weight", "model.layers.0.self_attention.experts.output_linear.weight"}
    assert len(said) == 1 and "(model.layers.0.mlp.output_linear.weight, ...: " in said[0], said
    assert "its module's input_size=64 and output_size=64 fit both [experts, out, in] and [experts, in, out]" in (
        said[0])
    assert warnings(tiny_moe("mixtral"))[0] == warnings(tiny_moe("gpt_oss"))[0] == []
    # targeting only such stacks: refused, naming them and why (not "no module matches" alone)
    with pytest.raises(ValueError, match=r"It names model\.layers\.0\.feed_forward\.experts\.gate_up_proj \(1 in "
                                         r"all\), which SMET cannot cut into blocks: a stack of expert matrices "
                                         r"\(4, 64, 64\) .* the hidden size 64 that it reads and the intermediate "
                                         r"size 32 fit both"):
        create_smet_optimizer(tiny_moe("llama4_text", intermediate_size=32, intermediate_size_mlp=64),
                              config=SMETConfig(block_size=16, target_modules=["gate_up_proj"]))


def test_a_stack_in_a_group_that_does_not_say_its_layout_is_refused():
    """SMETAdam built by hand cannot know whether a 3-D weight's matrices are [out, in] or [in, out]: it asks."""
    stack = torch.nn.Parameter(torch.randn(2, 8, 16))
    with pytest.raises(ValueError, match=r"stored \[out, in\] or \[in, out\]: say which in its parameter group's "
                                         r"'transposed' list"):
        SMETAdam([{"params": [stack], "smet": True}], config=SMETConfig(block_size=8)).attach()
    opt = SMETAdam([{"params": [stack], "smet": True, "transposed": [True]}],
                   config=SMETConfig(block_size=4, density=0.5)).attach()
    assert opt.state[stack]["block_index"].shape == (2 * 16, 1)  # (16 outputs an expert, 2 of 4 input blocks)


def test_a_checkpoint_of_other_expert_targets_is_refused_naming_the_targets_it_was_saved_with():
    """The refusal named a stack's module (`--smet_target_modules experts`, which reaches nothing), not the stack."""
    saved = create_smet_optimizer(tiny_moe("mixtral"), config=SMETConfig(block_size=16, target_modules=["down_proj"]))
    other = create_smet_optimizer(tiny_moe("mixtral"), config=SMETConfig(block_size=16, target_modules=["up_proj"]),
                                  attach=False)
    with pytest.raises(ValueError, match=r"saved for model\.layers\.0\.mlp\.experts\.down_proj where this run has "
                                         r"model\.layers\.0\.mlp\.experts\.gate_up_proj .* --smet_target_modules "
                                         r"down_proj, or"):
        other.load_state_dict(saved.state_dict())
