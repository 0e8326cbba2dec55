"""The inputs of a whole-row forward under CP (TRL DPO's, KTO's, ORPO's..., `trainer/whole_rows.py`): the CP input
preparation takes the sequence inputs (positional ones by their parameter's name), the other keywords pass as given,
and what it cannot shard is refused naming the input."""

import pytest
import torch

from hf_sparse_cp.distributed import ParallelDims, prepare_context_parallel_inputs
from hf_sparse_cp.trainer.whole_rows import _by_name, _sharded_inputs


def _prepare(batch):
    return prepare_context_parallel_inputs(batch, ParallelDims.single(), block_size=16)


def _rows():
    ids = torch.arange(2 * 40).reshape(2, 40) % 50 + 3
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.masked_fill(ids < 20, -100)}


def test_a_fused_forward_gets_the_shard_s_shifted_targets_and_its_own_keywords():
    rows = _rows()
    inputs = _sharded_inputs("M", {**rows, "fused_lm_head": True, "use_cache": False}, _prepare)
    assert inputs["use_cache"] is False and inputs["fused_lm_head"] is True
    assert "labels" not in inputs and "attention_mask" not in inputs  # (the mask is the CPShard's)
    assert torch.equal(inputs["shift_labels"][:, :39], rows["labels"][:, 1:])  # shifted before sharding
    assert inputs["cp_shard"].plan.seq_len == 40


@pytest.mark.parametrize(("kwargs", "refusal"), [
    ({"fused_lm_head": True, "token_type_ids": torch.zeros(2, 40, dtype=torch.long)},
     r"got `token_type_ids` of shape \(2, 40\), an input per token that the plugin does not shard"),
    ({}, r"got labels without TRL's fused LM head \(fused_lm_head=True\): the model's own loss would be each rank's"),
])
def test_what_the_preparation_cannot_shard_is_refused_naming_it(kwargs, refusal):
    with pytest.raises(ValueError, match=refusal):
        _sharded_inputs("M", {**_rows(), **kwargs}, _prepare)


def test_positional_inputs_are_named_by_the_forwards_signature_and_refused_where_it_names_none():
    """TRL's ORPO and CPO trainers call `model(input_ids, attention_mask=...)`: the input is sharded as input_ids; a
    forward taking `*args` names none, and is refused naming the fix."""

    class Named(torch.nn.Module):
        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            return input_ids

    class Anonymous(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return args

    rows = _rows()
    named = _by_name(Named(), (rows["input_ids"],), {"attention_mask": rows["attention_mask"], "use_cache": False})
    assert named.keys() == {"input_ids", "attention_mask", "use_cache"} and named["input_ids"] is rows["input_ids"]
    assert _by_name(Named(), (), rows) is rows
    with pytest.raises(ValueError, match=r"got 1 positional inputs that its signature does not name.*pass them by "
                                         "name"):
        _by_name(Anonymous(), (rows["input_ids"],), {})


def test_a_peft_model_s_positional_inputs_are_named_by_its_base_model_s_forward():
    """A LoRA adapter without a task type (TRL's ORPO given `LoraConfig(...)`) is a `PeftModel`, whose forward takes
    `*args` and hands them to its base model: its input_ids, passed positionally, are named by the base model's
    forward (they were refused, naming a fix the trainer's caller cannot apply)."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.testing.tiny_models import tiny_config

    base = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                                        head_dim=16))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert type(model) is peft.PeftModel  # (its forward: *args, **kwargs)
    rows = _rows()
    named = _by_name(model, (rows["input_ids"], rows["attention_mask"]), {"use_cache": False})
    assert named.keys() == {"input_ids", "attention_mask", "use_cache"}
    assert named["input_ids"] is rows["input_ids"] and named["attention_mask"] is rows["attention_mask"]
