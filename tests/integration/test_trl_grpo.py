"""TRL's GRPOTrainer under context parallelism: each CP group's first rank generates and scores the step's rows
(GRPO's own code seen data-parallel: its reward groups, slices and gathers over the data-parallel ranks) and shares
them with its group; the loss's forwards take each rank's shard of every row and gather the per-token
log-probabilities back into whole rows. The logged loss, rewards, KL, clip ratios and the weights after the steps
are one process's, also under FSDP2 (where every rank of a CP group generates in step, taking its first rank's)."""

import os

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from hf_sparse_cp.examples.tokenizer import byte_tokenizer
from hf_sparse_cp.testing.spawn import run_gloo
from hf_sparse_cp.testing.tiny_models import tiny_config

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

# (SGD: the update is the gradient's; 3 steps of 4 rows each: 2 prompts x 2 completions)
GRPO = dict(max_steps=3, per_device_train_batch_size=4, num_generations=2, max_completion_length=12, optim="sgd",
            learning_rate=0.5, logging_steps=1, report_to="none", save_strategy="no", bf16=False, seed=0,
            data_seed=0, gradient_checkpointing=False, temperature=1.0)
# a pattern sparse at these lengths: rows of 64 tokens or more get vertical-slash attention
PATTERN = dict(sparse_block_size=32, sparse_min_seq_len=64, sparse_vertical_topk=8, sparse_slash_topk=8,
               sparse_local_window=32, sparse_sink_tokens=4, sparse_last_q=16)
FSDP2 = {"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_version": 2,
                                                           "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
LOGGED = ("loss", "grad_norm", "reward", "reward_std", "rewards/distinct/mean", "frac_reward_zero_std", "kl", "entropy",
          "completions/mean_length", "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max",
          "num_tokens")


def distinct(completions, **kwargs) -> list[float]:
    """A reward that differs between completions: their share of distinct characters."""
    return [len(set(text)) / max(len(text), 1) for text in completions]


def _prompts(n: int = 12, seed: int = 0) -> dict[str, list[str]]:
    """Prompts of 70 to 200 bytes: rows of about 80 to 210 tokens with their completions."""
    g = torch.Generator().manual_seed(seed)
    words = ["sparse", "attention", "ring", "packed", "document", "token", "block", "query", "key", "value"]
    return {"prompt": [" ".join(words[i] for i in torch.randint(0, len(words), (k,), generator=g).tolist())
                       for k in torch.randint(10, 30, (n,), generator=g).tolist()]}


def unreachable(completions, **kwargs) -> list[float]:
    """A reward whose server is down."""
    raise ConnectionError("the reward server is down")


def _train(rank: int, world: int, model: str, output_dir: str, cp: dict, grpo: dict, reward=distinct,
           trainer: str = "GRPO") -> dict:
    """Train TRL's `<trainer>Trainer` (GRPO or RLOO: they take the same arguments and log the same metrics)."""
    from torch.distributed.fsdp import FSDPModule

    from hf_sparse_cp import sparse_arguments_class, sparse_trainer_class

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_OFFLINE="1")
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    config, trainer_class = getattr(trl, f"{trainer}Config"), getattr(trl, f"{trainer}Trainer")
    args = sparse_arguments_class(config)(output_dir=output_dir, **{**GRPO, **grpo}, **PATTERN, **cp)
    trainer = sparse_trainer_class(trainer_class)(model=model, args=args, reward_funcs=reward,
                                                  train_dataset=datasets.Dataset.from_dict(_prompts()),
                                                  eval_dataset=datasets.Dataset.from_dict(_prompts(4, seed=1)),
                                                  processing_class=tokenizer)
    trainer.train()
    evaluation = trainer.evaluate()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    return {"logs": [{key: log[key] for key in LOGGED if key in log} for log in logs],
            "sharded": isinstance(trainer.model_wrapped, FSDPModule),
            "eval": {key: value for key, value in evaluation.items() if key.removeprefix("eval_") in LOGGED},
            "kept": [log.get("sparse/kept_fraction") for log in logs],
            "weights": {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()  # (FSDP2's)
                        for name, p in trainer.model.named_parameters()}}


def _assert_equal(run: dict, one: dict, absolute: dict[str, float] | None = None) -> None:
    """`run`'s logs, evaluation and weights are `one`'s (`absolute`: a logged value's absolute tolerance, 1e-6 unless
    given)."""
    assert len(run["logs"]) == len(one["logs"]) == GRPO["max_steps"]
    for got, want in zip(run["logs"], one["logs"], strict=True):
        assert got.keys() == want.keys()
        for key in want:
            tolerance = (absolute or {}).get(key, 1e-6)
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=tolerance), (key, got[key], want[key])
    assert run["eval"].keys() == one["eval"].keys() and "eval_reward" in one["eval"]
    for key, want in one["eval"].items():
        assert run["eval"][key] == pytest.approx(want, rel=1e-5, abs=1e-6), (key, run["eval"][key], want)
    for name, want in one["weights"].items():
        assert torch.allclose(run["weights"][name], want, rtol=1e-5, atol=1e-6), name


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A tiny Llama's folder (GRPO loads its reference model from the policy's path)."""
    path = str(tmp_path_factory.mktemp("tiny"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(byte_tokenizer()), hidden_size=64,
                                                 intermediate_size=128, head_dim=16)).save_pretrained(path)
    return path


@pytest.mark.parametrize(("cp", "grpo"), [
    ({}, {"beta": 0.1}),  # GRPO's default loss (dapo), a KL to the reference model
    ({"cp_sharding": "zigzag"}, {"loss_type": "grpo", "num_iterations": 2, "beta": 0.0}),  # old log-probs: clipped
    ({"cp_mode": "ulysses"},
     # (a generation batch of 8 prompts at 4 per device: 2 steps a generation, as on one process)
     {"loss_type": "dr_grpo", "scale_rewards": "batch", "generation_batch_size": 8, "gradient_accumulation_steps": 2}),
], ids=["ring-striped-dapo-kl", "ring-zigzag-grpo-iterations", "ulysses-dr_grpo-accumulated"])
def test_grpo_under_cp2_equals_one_process(tmp_path, tiny, cp, grpo):
    """Losses, rewards, KL, clip ratios, entropy and the weights after three steps under CP 2, and an evaluation's
    loss and rewards after them, are one process's."""
    one = run_gloo(_train, 1, tiny, str(tmp_path / "one"), {}, grpo, timeout_s=400)[0]
    # (it trained, on completions whose rewards differ within a group: advantages that are not all 0)
    # (a step that reuses its generation, num_iterations 2, logs no rewards)
    assert all(log["grad_norm"] > 0 and log.get("reward_std", 1) > 0 for log in one["logs"]), one["logs"]
    assert any(kept is not None and 0 < kept < 1 for kept in one["kept"]), one["kept"]  # the sparse path ran
    for rank in run_gloo(_train, 2, tiny, str(tmp_path / "cp2"), {"cp_size": 2, **cp}, grpo, timeout_s=400):
        _assert_equal(rank, one)


@pytest.mark.parametrize("trainer", ["GRPO", "RLOO"])
def test_grpo_and_rloo_under_cp2_with_fsdp2_equal_one_process(tmp_path, tiny, trainer):
    """FSDP2 (sharded parameters; the reference model too, TRL's prepare_fsdp): every rank of the CP group runs the
    generation batch, whose forwards gather the parameters from every rank, in step with the others (transformers'
    synced_gpus), and takes its first rank's rows; the losses, rewards, KL and the weights after three steps, and an
    evaluation's loss and rewards, are one process's."""
    grpo = {"beta": 0.1}
    one = run_gloo(_train, 1, tiny, str(tmp_path / "one"), {}, grpo, distinct, trainer, timeout_s=300)[0]
    assert all(log["grad_norm"] > 0 for log in one["logs"]), one["logs"]  # (it trained)
    for rank in run_gloo(_train, 2, tiny, str(tmp_path / "cp2"), {"cp_size": 2, **FSDP2}, grpo, distinct, trainer,
                         timeout_s=300):
        assert rank["sharded"]
        _assert_equal(rank, one)


def test_grpo_under_dp2_x_cp2_with_fsdp2_equals_data_parallel(tmp_path, tiny):
    """DP 2 x CP 2 with FSDP2 trains as DP 2 without CP or FSDP: the DP ranks complete different prompts, whose
    completions end at different lengths (the policy also stops at 24 byte tokens), and every rank's generate keeps
    forwarding, its parameters gathered from all 4 ranks, until all of them end."""
    from transformers import GenerationConfig

    ending = str(tmp_path / "ending")
    AutoModelForCausalLM.from_pretrained(tiny).save_pretrained(ending)
    GenerationConfig(eos_token_id=[2, *range(100, 124)], pad_token_id=0).save_pretrained(ending)
    grpo = {"per_device_train_batch_size": 1, "beta": 0.1}
    dp = run_gloo(_train, 2, ending, str(tmp_path / "dp2"), {}, grpo, timeout_s=300)
    assert any(log["completions/mean_length"] < GRPO["max_completion_length"] for log in dp[0]["logs"]), dp[0]["logs"]
    for rank, run in enumerate(run_gloo(_train, 4, ending, str(tmp_path / "dp2cp2"), {"cp_size": 2, **FSDP2}, grpo,
                                        timeout_s=300)):
        assert run["sharded"]
        _assert_equal(run, dp[rank // 2])


def test_grpo_under_dp2_x_cp2_equals_data_parallel(tmp_path, tiny):
    """DP 2 x CP 2 (4 processes) trains as DP 2 without CP: GRPO's reward groups, its slices by process index and
    its gathers run over the data-parallel ranks (its groups of 2 completions span them: one prompt per rank and
    step), and each rank draws the completions of the DP run's process of its DP rank."""
    grpo = {"per_device_train_batch_size": 1, "beta": 0.1}
    dp = run_gloo(_train, 2, tiny, str(tmp_path / "dp2"), {}, grpo, timeout_s=400)
    assert all(log["grad_norm"] > 0 for log in dp[0]["logs"]), dp[0]["logs"]
    for rank, run in enumerate(run_gloo(_train, 4, tiny, str(tmp_path / "dp2cp2"), {"cp_size": 2}, grpo,
                                        timeout_s=400)):
        _assert_equal(run, dp[rank // 2])


def unreachable_from_the_last_rank(completions, **kwargs) -> list[float]:
    """A reward whose server only the last rank cannot reach."""
    if dist.get_rank() == dist.get_world_size() - 1:
        raise ConnectionError("the reward server is down")
    return distinct(completions)


def _failing(rank: int, world: int, model: str, output_dir: str, cp: dict | None = None, reward=unreachable) -> str:
    try:
        _train(rank, world, model, output_dir, {"cp_size": 2, **(cp or {})}, {}, reward)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "trained"


def test_a_failure_generating_the_rows_ends_every_rank_of_the_group_naming_it(tmp_path, tiny):
    """The group's first rank generates and scores its rows alone: its failure (a reward function's) is raised there,
    and by the others, which waited for its rows, naming it, rather than waiting until the process group's timeout."""
    first, other = run_gloo(_failing, 2, tiny, str(tmp_path), timeout_s=300)
    assert first == "ConnectionError: the reward server is down"
    assert other.startswith("RuntimeError: SparseGRPOTrainer: rank 0, which generates and scores the rows of its CP "
                            "group, failed (ConnectionError: the reward server is down)"), other


def test_under_fsdp2_a_failure_of_one_rank_generating_the_rows_ends_every_rank_of_the_group_naming_it(tmp_path, tiny):
    """Under FSDP2 every rank of the group computes the generation batch; one that fails there (the last: a reward
    server only it cannot reach) raises, and the others, which would wait in the loss's forwards for its parameters
    until the process group's timeout, raise too, naming it."""
    first, last = run_gloo(_failing, 2, tiny, str(tmp_path), FSDP2, unreachable_from_the_last_rank, timeout_s=300)
    assert last == "ConnectionError: the reward server is down"
    assert first.startswith("RuntimeError: SparseGRPOTrainer: rank 1 of its CP group failed computing the group's "
                            "generation batch (ConnectionError: the reward server is down)"), first


def test_the_loss_check_of_a_generating_trainer_counts_the_data_parallel_ranks_of_a_layout_that_divides(tmp_path,
                                                                                                      tiny):
    """`check_loss` checks a GRPO trainer's generation batch at the data-parallel degree of its layout: on one process
    at CP 2 there is none, and the check says so, naming the fix (#50: it divided the processes by the CP degree,
    a DP degree of 0, whose generation batch of 0 prompts every --num_generations divides: passed silently)."""
    from hf_sparse_cp.trainer.cp_checks import check_loss

    args = trl.GRPOConfig(output_dir=str(tmp_path), **GRPO, use_cpu=True)
    built = trl.GRPOTrainer(model=tiny, args=args, reward_funcs=distinct, processing_class=byte_tokenizer(),
                            train_dataset=datasets.Dataset.from_dict(_prompts(2)))
    args.per_device_train_batch_size = 1  # (refused at any DP degree above 0: 1 prompt, groups of 2)
    with pytest.raises(ValueError, match=r"cp_size=2 does not divide the world size 1"):
        check_loss(built, 2)


@pytest.mark.parametrize(("setting", "refusal"), [
    ({"use_vllm": True}, r"with --use_vllm under context parallelism \(CP 2\) is not supported.*Fix: drop --use_vllm"),
    ({"use_transformers_continuous_batching": True},
     r"with --use_transformers_continuous_batching .*Fix: drop --use_transformers_continuous_batching"),
    # (as on 2 processes under CP 2: GRPO's config counts 1 prompt per process, 2 in all, a CP group holds 1: no
    # whole group of 2 completions)
    ({"per_device_train_batch_size": 1}, r"the generation batch, per_device_train_batch_size 1 x DP 1 x "
                                         r"steps_per_generation 1, is not a multiple of --num_generations 2"),
], ids=["vllm", "continuous-batching", "generation-batch"])
@pytest.mark.parametrize("trainer", ["GRPO", "RLOO"])
def test_a_setting_cp_does_not_run_as_data_parallel_is_refused_naming_the_fix(tmp_path, tiny, setting, refusal,
                                                                              trainer):
    """A GRPO or RLOO setting: vLLM's and continuous batching's generation exchange prompts and completions over all
    processes, and a generation batch of one data-parallel rank's prompts must hold whole groups: refused at start,
    naming the fix."""
    from hf_sparse_cp.trainer.generated_rows import check_generating_trainer

    args = getattr(trl, f"{trainer}Config")(output_dir=str(tmp_path), **GRPO, use_cpu=True)
    built = getattr(trl, f"{trainer}Trainer")(model=tiny, args=args, reward_funcs=distinct,
                                              processing_class=byte_tokenizer(),
                                              train_dataset=datasets.Dataset.from_dict(_prompts(2)))
    check_generating_trainer(built, 2, 1)  # (its settings run under CP)
    for name, value in setting.items():  # (set after the Trainer's start: vLLM is not installed here)
        setattr(args, name, value)
    with pytest.raises(ValueError, match=refusal):
        check_generating_trainer(built, 2, 1)


def test_a_cp_schedule_with_a_generating_trainer_is_refused_before_its_settings_are_checked(tmp_path, tiny):
    """A cp_schedule cannot run a GRPO trainer (its rows are kept whole): that refusal comes first, not after a
    refusal of its settings (its data-parallel degree, its generation batch) whose fix would only meet it next (#50:
    check_loss ran first)."""
    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig
    from hf_sparse_cp.trainer.schedule import parse_schedule
    from hf_sparse_cp.trainer.stage_plan import build_schedule

    args = trl.GRPOConfig(output_dir=str(tmp_path), **GRPO, use_cpu=True)
    built = trl.GRPOTrainer(model=tiny, args=args, reward_funcs=distinct, processing_class=byte_tokenizer(),
                            train_dataset=datasets.Dataset.from_dict(_prompts(2)))
    # (a schedule for 2 processes on this one: check_loss would refuse its CP 2 stage's data-parallel degree)
    schedule = build_schedule(parse_schedule("0:256:1,1:256:2"), world_size=2, max_steps=args.max_steps,
                              sparse_config=SparseAttentionConfig(block_size=64, min_seq_len=128))
    with pytest.raises(ValueError, match=r"a cp_schedule with GRPOTrainer: .*instead of --cp_schedule"):
        hf_sparse_cp.enable_curriculum(built, schedule)
