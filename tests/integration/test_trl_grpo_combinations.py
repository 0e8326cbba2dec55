"""TRL's GRPOTrainer under context parallelism with the settings that change its generation, its rows or its loss:
a LoRA adapter (its reference model is then the adapter-disabled policy; also under FSDP2), gradient checkpointing, a
resume from a checkpoint, the entropy mask, masked truncated completions and sequence-level importance sampling,
weighted reward functions and a reward model, evaluation during training and bf16, autocast or FSDP2's (close, not
equal). Each against one process."""

import os

import pytest
import torch
from test_trl_grpo import FSDP2, GRPO, LOGGED, PATTERN, _assert_equal, _prompts, distinct
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

from hf_sparse_cp.examples.tokenizer import byte_tokenizer
from hf_sparse_cp.testing.spawn import run_gloo
from hf_sparse_cp.testing.tiny_models import tiny_config

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

# (besides test_trl_grpo's: the second reward's and the reward model's, the share of truncated completions, and the
# entropy bonus's terms)
KEYS = (*LOGGED, "rewards/short/mean", "rewards/reward/mean", "completions/clipped_ratio", "policy_loss",
        "entropy_coef")


def short(completions, **kwargs) -> list[float]:
    """A second reward: shorter completions score higher."""
    return [-len(text) / 16 for text in completions]


def _tiny(path: str, head=AutoModelForCausalLM, **config) -> str:
    torch.manual_seed(0)
    head.from_config(tiny_config("llama", vocab_size=len(byte_tokenizer()), hidden_size=64, intermediate_size=128,
                                 head_dim=16, **config)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama whose generation also stops at 24 byte tokens (some completions end, some are truncated), and a
    tiny reward model (a sequence-classification head with one label)."""
    root = tmp_path_factory.mktemp("models")
    policy = _tiny(str(root / "policy"))
    GenerationConfig(eos_token_id=[2, *range(100, 124)], pad_token_id=0).save_pretrained(policy)
    return {"policy": policy, "reward": _tiny(str(root / "reward"), AutoModelForSequenceClassification, num_labels=1,
                                               pad_token_id=0)}


def _train(rank: int, world: int, models: dict, output_dir: str, cp: dict, grpo: dict, options: dict) -> dict:
    """Train (`options`: "lora", "rewards" "weighted" or "model", "resume_from" a checkpoint's step) and evaluate."""
    from peft import LoraConfig
    from torch.distributed.fsdp import FSDPModule
    from trl import GRPOConfig, GRPOTrainer

    from hf_sparse_cp import sparse_arguments_class, sparse_trainer_class

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_OFFLINE="1")
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    rewards = {"weighted": [distinct, short], "model": [distinct, models.get("reward")]}.get(options.get("rewards"),
                                                                                          distinct)
    args = sparse_arguments_class(GRPOConfig)(output_dir=output_dir, **{**GRPO, **grpo}, **PATTERN, **cp)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                      init_lora_weights=False) if options.get("lora") else None
    trainer = sparse_trainer_class(GRPOTrainer)(
        model=models["policy"], args=args, reward_funcs=rewards, peft_config=lora,
        reward_processing_classes=[None, tokenizer] if options.get("rewards") == "model" else None,
        train_dataset=datasets.Dataset.from_dict(_prompts()),
        eval_dataset=datasets.Dataset.from_dict(_prompts(4, seed=1)), processing_class=tokenizer)
    resume = options.get("resume_from")
    trainer.train(resume_from_checkpoint=f"{output_dir}/checkpoint-{resume}" if resume else None)
    evaluation = trainer.evaluate()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    return {"logs": [{key: log[key] for key in KEYS if key in log} for log in logs],
            "sharded": isinstance(trainer.model_wrapped, FSDPModule),
            "evals": [log for log in trainer.state.log_history if "eval_loss" in log],
            "eval": {key: value for key, value in evaluation.items() if key.removeprefix("eval_") in KEYS},
            "weights": {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()  # (FSDP2's)
                        for name, p in trainer.model.named_parameters()},
            # (the completions --log_completions prints: the generation batch's, on the rank that generated them)
            "completions": {key: list(trainer._logs[key]) for key in ("prompt", "completion", "advantages")}
            | {f"rewards/{key}": list(value) for key, value in trainer._logs["rewards"].items()}}


@pytest.mark.parametrize(("cp", "grpo", "options"), [
    # (the adapter's weights random: its reference, the policy without it, differs from the first step)
    ({}, {"beta": 0.1, "gradient_checkpointing": True}, {"lora": True}),
    # (FSDP2: the adapter's parameters sharded with the base model's; the reference forwards with it disabled)
    (FSDP2, {"beta": 0.1}, {"lora": True}),
    # (a checkpoint at step 2, resumed on the processes' random states, and the entropy bonus's state)
    ({"cp_mode": "ulysses"},
     {"top_entropy_quantile": 0.5, "mask_truncated_completions": True, "importance_sampling_level": "sequence",
      "num_iterations": 2, "reward_weights": [1.0, 0.5], "use_adaptive_entropy": True, "entropy_coef": 0.01,
      "entropy_target": 5.545, "pad_to_multiple_of": 16, "save_strategy": "steps", "save_steps": 2},
     {"rewards": "weighted", "resume_from": 2}),
    ({"cp_sharding": "zigzag"},
     {"beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5,
      "eval_strategy": "steps", "eval_steps": 2, "log_completions": True, "num_generations_eval": 4,
      "per_device_eval_batch_size": 4}, {"rewards": "model"}),
], ids=["lora-checkpointing", "lora-fsdp2", "entropy-mask-truncated-sequence-weighted-resumed",
        "reward-model-eval-log"])
def test_grpo_settings_under_cp2_equal_one_process(tmp_path, models, cp, grpo, options):
    """The logged losses, rewards (each function's), entropy terms and completions, the evaluations during and after
    training and the weights after three steps under CP 2 are one process's; a run resumed from a checkpoint is the
    uninterrupted one."""
    resume = options.pop("resume_from", None)
    one = run_gloo(_train, 1, models, str(tmp_path / "one"), {}, grpo, options, timeout_s=400)[0]
    assert all(log["grad_norm"] > 0 for log in one["logs"][::2]), one["logs"]  # (it trained)
    runs = run_gloo(_train, 2, models, str(tmp_path / "cp2"), {"cp_size": 2, **cp}, grpo, options, timeout_s=400)
    if resume:
        assert 0 < one["logs"][0]["completions/clipped_ratio"] < 1, one["logs"]  # (some completions truncated)
        runs += run_gloo(_train, 2, models, str(tmp_path / "cp2"), {"cp_size": 2, **cp}, grpo,
                         {**options, "resume_from": resume}, timeout_s=400)
    for run in runs:
        assert run["sharded"] == ("fsdp" in cp)
        _assert_equal(run, one)
        assert [log["eval_loss"] for log in run["evals"]] == pytest.approx([log["eval_loss"] for log in one["evals"]])
    assert runs[0]["completions"] == one["completions"] and one["completions"]["completion"]


@pytest.mark.parametrize("fsdp", [{}, FSDP2], ids=["autocast", "fsdp2"])
def test_grpo_under_cp2_in_bf16_is_close_to_one_process(tmp_path, models, fsdp):
    """bf16 autocast, or FSDP2's bf16 parameters (its mixed precision, which casts a forward's floating inputs, the
    CP shard's too, into copies): the sharded forwards round differently from the whole rows', so the losses, KL
    and weights after three steps are close to one process's in autocast, not equal; the first step's completions,
    generated unsharded in the same precision, are one process's."""
    grpo = {"bf16": True, "beta": 0.1}
    one = run_gloo(_train, 1, models, str(tmp_path / "one"), {}, grpo, {}, timeout_s=400)[0]
    for run in run_gloo(_train, 2, models, str(tmp_path / "cp2"), {"cp_size": 2, **fsdp}, grpo, {}, timeout_s=400):
        assert run["sharded"] == bool(fsdp)
        assert run["logs"][0]["reward"] == one["logs"][0]["reward"]
        for got, want in zip(run["logs"], one["logs"], strict=True):
            for key in ("loss", "grad_norm", "kl", "entropy"):
                assert got[key] == pytest.approx(want[key], rel=1e-2, abs=1e-3), (key, got[key], want[key])
        for name, want in one["weights"].items():
            # (FSDP2 leaves its root module's own parameters, embeddings and final norm, unsharded after the last
            # forward: in bf16)
            assert torch.allclose(run["weights"][name].float(), want, rtol=1e-2, atol=1e-3), name
