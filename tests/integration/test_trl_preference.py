"""TRL's DPOTrainer, KTOTrainer, RewardTrainer and experimental ORPO / CPO trainers under context parallelism: each
rank's forward (the policy's and the reference's) takes its shard of every row, and the per-token log-probabilities
(a reward model's score of each row's last token; ORPO's and CPO's logits) come back whole on every rank of the CP
group (an all-gather that hands each rank the gradient of its own positions), so TRL's own loss, rewards and metrics
run on whole rows. The logged loss, rewards and metrics and the parameters after the steps are one process's."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_sparse_cp.examples.tokenizer import byte_tokenizer
from hf_sparse_cp.testing.spawn import run_gloo
from hf_sparse_cp.testing.tiny_models import tiny_config

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

# (SGD: the update is the gradient's, where Adam's normalization would hide a wrong scale and amplify the rounding of
# near-zero gradients)
DPO = dict(max_length=256, max_steps=2, per_device_train_batch_size=2, optim="sgd", learning_rate=0.05, logging_steps=1,
           report_to="none", save_strategy="no", bf16=False, gradient_checkpointing=False, seed=0, data_seed=0,
           dataset_num_proc=None, beta=0.5)
# a pattern sparse at these lengths: rows of 64 tokens or more get vertical-slash attention
PATTERN = dict(sparse_block_size=32, sparse_min_seq_len=64, sparse_vertical_topk=8, sparse_slash_topk=8,
               sparse_local_window=32, sparse_sink_tokens=4, sparse_last_q=16)
FSDP2 = {"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_version": 2,
                                                           "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
LOGGED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
          "logps/rejected", "entropy", "logits/chosen", "logits/rejected", "num_tokens")
# each trainer's own logs beside those
OWN_LOGS = {"dpo": ("mean_token_accuracy",), "kto": ("kl",)}


def _words(n: int, seed: int, low: int, high: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    words = ["sparse", "attention", "ring", "packed", "document", "token", "block", "query", "key", "value"]
    return [" ".join(words[i] for i in torch.randint(0, len(words), (k,), generator=g).tolist())
            for k in torch.randint(low, high, (n,), generator=g).tolist()]


def _pairs(n: int = 8, seed: int = 0) -> dict[str, list[str]]:
    """Prompts of 60 to 170 bytes, completions of different lengths: rows of about 100 to 250 tokens."""
    return {"prompt": _words(n, seed, 10, 25), "chosen": _words(n, seed + 1, 2, 12),
            "rejected": _words(n, seed + 2, 2, 12)}


def _unpaired(pairs: dict[str, list[str]]) -> dict[str, list]:
    """KTO's data: each pair's completions apart, labelled desirable (chosen) or not (rejected)."""
    n = len(pairs["prompt"])
    return {"prompt": pairs["prompt"] * 2, "completion": pairs["chosen"] + pairs["rejected"],
            "label": [True] * n + [False] * n}


def _train(rank: int, world: int, output_dir: str, cp: dict, dpo: dict, lora: bool = False, kind: str = "dpo",
           eval_rows: int = 3) -> dict:
    """Two steps of TRL's DPO (`kind` "dpo") or KTO ("kto") and an evaluation on `eval_rows` pairs; with `lora`, of a
    LoRA adapter, the reference being the model without it."""
    import trl

    import hf_sparse_cp

    # (the public names of the switched classes: the plugin's classes over TRL's, and its flags)
    config, trainer_class = (getattr(hf_sparse_cp, f"Sparse{kind.upper()}{part}") for part in ("Config", "Trainer"))
    assert issubclass(trainer_class, getattr(trl, f"{kind.upper()}Trainer"))
    assert "cp_size" in config.__dataclass_fields__
    data = {"dpo": _pairs, "kto": lambda *a, **k: _unpaired(_pairs(*a, **k))}[kind]
    if "parallelism_config" in cp:  # (accelerate's own CP group, as on GPUs)
        from hf_sparse_cp.testing.accelerate_cp import allow_parallelism_config_on_cpu

        allow_parallelism_config_on_cpu()

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_OFFLINE="1")
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer), hidden_size=64,
                                                         intermediate_size=128, head_dim=16))
    if lora:
        from peft import LoraConfig

        reference = {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                               lora_dropout=0.0)}
    else:
        reference = {"ref_model": AutoModelForCausalLM.from_config(model.config)}
        reference["ref_model"].load_state_dict(model.state_dict())
    args = config(output_dir=output_dir, **{**DPO, **dpo}, **PATTERN, **cp)
    trainer = trainer_class(model=model, args=args, **reference,
                                                  train_dataset=datasets.Dataset.from_dict(data()),
                                                  eval_dataset=datasets.Dataset.from_dict(data(eval_rows, seed=3)),
                                                  processing_class=tokenizer)
    lengths = []
    hook = trainer.model.get_input_embeddings().register_forward_hook(lambda m, a, out: lengths.append(out.shape[1]))
    trainer.train()
    hook.remove()
    evaluation = trainer.evaluate()  # (its prediction step also returns the logits: a plain forward's outputs)
    logs = [log for log in trainer.state.log_history if "loss" in log]
    logged = LOGGED + OWN_LOGS[kind]
    # (KTO logs the chosen or rejected metrics of a step whose batch holds such completions)
    return {"logs": [{key: log[key] for key in logged if key in log} for log in logs], "lengths": lengths,
            "eval": {key: evaluation[f"eval_{key}"] for key in logged if f"eval_{key}" in evaluation},
            "kept": [log.get("sparse/kept_fraction") for log in logs],
            "weights": {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()  # (FSDP2's)
                        for name, p in trainer.model.named_parameters()}}


def _assert_equal(run: dict, one: dict) -> None:
    for got, want in zip([*run["logs"], run["eval"]], [*one["logs"], one["eval"]], strict=True):
        # rewards are differences of sums of ~200 per-token log-probabilities (about -250): float32 rounds those
        # sums, whatever the order of the ring's additions, to about 1e-5
        rounding = 1e-6 * max(abs(want[key]) for key in ("logps/chosen", "logps/rejected") if key in want)
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=rounding), (key, got[key], want[key])
    for name, want in one["weights"].items():  # after two optimizer steps on those gradients
        assert torch.allclose(run["weights"][name], want, rtol=1e-5, atol=1e-6), name


@pytest.fixture(scope="module")
def one_dpo(tmp_path_factory) -> dict:
    """One process's DPO run with TRL's default loss, the reference of several CP runs."""
    return run_gloo(_train, 1, str(tmp_path_factory.mktemp("one")), {}, {}, False, timeout_s=300)[0]


def _accelerates_cp2() -> dict:
    from accelerate.parallelism_config import ParallelismConfig

    return {"parallelism_config": ParallelismConfig(cp_size=2)}


@pytest.mark.parametrize(("cp", "dpo", "lora"), [
    ({"cp_size": 2}, {}, False),  # the sparse ring, striped
    (None, {}, False),  # accelerate's CP group (its ParallelismConfig, as on GPUs), the plugin's ring over it
    ({"cp_size": 2, "cp_mode": "ulysses"}, {"loss_type": ["ipo"]}, True),  # normalized by completion lengths
    ({"cp_size": 2, "cp_sharding": "zigzag", **FSDP2},  # sharded parameters; the reference too (TRL's prepare_fsdp)
     {"ld_alpha": 0.5, "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}, False),  # completion_mask's cumsum
], ids=["ring-striped-sigmoid", "accelerate-cp-ring", "ulysses-ipo-lora", "fsdp2-ring-zigzag-ld_alpha-sft"])
def test_dpo_under_cp2_equals_one_process(tmp_path, request, cp, dpo, lora):
    """Losses, rewards, TRL's metrics, an evaluation's and the weights after two steps under CP 2 are one process's;
    each rank's forwards took half of every row."""
    cp = cp or _accelerates_cp2()
    one = (request.getfixturevalue("one_dpo") if not (dpo or lora)
           else run_gloo(_train, 1, str(tmp_path / "one"), {}, dpo, lora, timeout_s=300)[0])
    assert one["logs"][0]["loss"] != pytest.approx(one["logs"][1]["loss"])  # (it trained)
    assert any(0 < kept < 1 for kept in one["kept"])  # the sparse path ran
    for rank in run_gloo(_train, 2, str(tmp_path / "cp2"), cp, dpo, lora, timeout_s=300):
        _assert_equal(rank, one)
        assert all(2 * n <= m + 64 for n, m in zip(rank["lengths"], one["lengths"], strict=True)), rank["lengths"]


def test_the_switched_dpo_trainer_takes_its_arguments_and_reference_by_name(tmp_path):
    """DPOTrainer's second parameter is `ref_model`: the plugin's class handed it the arguments there (a TypeError
    beside ref_model=...; without one, the arguments became the reference model)."""
    from trl import DPOConfig, DPOTrainer

    from hf_sparse_cp import sparse_arguments_class, sparse_trainer_class

    tokenizer = byte_tokenizer()
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer))).save_pretrained(tmp_path / "m")
    args = sparse_arguments_class(DPOConfig)(output_dir=str(tmp_path), **DPO, **PATTERN)
    data = datasets.Dataset.from_dict(_pairs(2))
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    for reference in ({"ref_model": ref_model}, {}):  # (without one, TRL loads it from the model's folder)
        trainer = sparse_trainer_class(DPOTrainer)(model=str(tmp_path / "m"), args=args, train_dataset=data,
                                                   processing_class=tokenizer, **reference)
        assert trainer.args is args and trainer.beta == DPO["beta"]
        assert isinstance(trainer.ref_model, type(ref_model)) and (not reference or trainer.ref_model is ref_model)


def test_dpo_with_a_moe_load_balancing_loss_is_refused_under_cp_naming_the_flag(tmp_path):
    """A MoE's load-balancing loss multiplies means over all the batch's tokens, which no CP rank's shard gives: DPO
    with it (TRL's router_aux_loss_coef) is refused at start, naming the flag; without it, DPO passes."""
    from trl import DPOConfig, DPOTrainer

    from hf_sparse_cp.trainer.cp_checks import check_loss

    tokenizer = byte_tokenizer()
    model = AutoModelForCausalLM.from_config(tiny_config("mixtral", vocab_size=len(tokenizer)))
    data = datasets.Dataset.from_dict(_pairs(2))
    for coef in (0.01, 0.0):  # (and the model config's output_router_logits, which TRL's fused head reads)
        args = DPOConfig(output_dir=str(tmp_path), **DPO, router_aux_loss_coef=coef, use_cpu=True)
        trainer = DPOTrainer(model=model, ref_model=AutoModelForCausalLM.from_config(model.config), args=args,
                             train_dataset=data, processing_class=tokenizer)
        if coef:
            refusal = (r"DPOTrainer with a MoE's load-balancing loss \(router_aux_loss_coef 0.01, output_router_logits "
                       r"False\) under context parallelism \(CP 2\).*--router_aux_loss_coef 0")
            with pytest.raises(ValueError, match=refusal):
                check_loss(trainer, 2)
        else:
            check_loss(trainer, 2)


def test_kto_under_cp2_equals_one_process(tmp_path):
    """TRL's KTOTrainer (unpaired completions; a KL estimate from mismatched prompt-completion pairs, two more forwards
    of the model and its reference) under CP 2, ring striped: as one process."""
    one = run_gloo(_train, 1, str(tmp_path / "one"), {}, {}, False, "kto", timeout_s=300)[0]
    assert one["logs"][0]["loss"] != pytest.approx(one["logs"][1]["loss"]) and one["logs"][1]["kl"] > 0
    for rank in run_gloo(_train, 2, str(tmp_path / "cp2"), {"cp_size": 2}, {}, False, "kto", timeout_s=300):
        _assert_equal(rank, one)


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_dp2_x_cp2_equals_the_whole_batch_without_cp(tmp_path, kind):
    """Four processes, DP 2 x CP 2: each CP group trains on its half of every batch, each rank's forwards on half of
    each of its rows. DPO's losses, rewards, metrics, evaluation and weights after two steps are one process's on the
    whole batch (4 rows a step). KTO's are DP 2's without CP: TRL pairs its KL completions within each process's batch
    and averages the processes' KL estimates, which no one process reproduces."""
    # 4 pairs evaluated in batches of 2 a process: DP 2 pads a shorter set with repeated rows on a rank, which TRL's
    # loss and metrics (means over each process's batch) count, and one process does not
    batches = {"per_device_train_batch_size": 2, "per_device_eval_batch_size": 2}
    if kind == "dpo":  # one process takes the DP groups' batches together
        reference = run_gloo(_train, 1, str(tmp_path / "one"), {}, {key: 2 * n for key, n in batches.items()}, False,
                             kind, 4, timeout_s=300)
    else:
        reference = run_gloo(_train, 2, str(tmp_path / "dp2"), {}, batches, False, kind, 4, timeout_s=300)
    assert reference[0]["logs"][0]["loss"] != pytest.approx(reference[0]["logs"][1]["loss"])  # (it trained)
    # the reference's forwards' lengths, the longest over its processes: the whole batch's padded rows
    longest = [max(lengths) for lengths in zip(*(rank["lengths"] for rank in reference), strict=True)]
    for rank in run_gloo(_train, 4, str(tmp_path / "dp2cp2"), {"cp_size": 2}, batches, False, kind, 4, timeout_s=300):
        _assert_equal(rank, reference[0])
        assert all(2 * n <= m + 64 for n, m in zip(rank["lengths"], longest, strict=True)), rank["lengths"]
        assert any(0 < kept < 1 for kept in rank["kept"])  # the sparse path ran on the shards


def _with_schedule(rank: int, world: int, output_dir: str) -> None:
    _train(rank, world, output_dir, {"cp_schedule": "0:256:1,1:256:2"}, {})


def test_dpo_with_a_cp_schedule_is_refused_at_start_naming_cp_size(tmp_path):
    """A --cp_schedule crops each sample's input_ids to its stage's length, and DPO's samples are a prompt and two
    completions: refused before training, naming --cp_size."""
    with pytest.raises(Exception, match=r"a cp_schedule with SparseDPOTrainer: a stage crops each sample's input_ids"
                                        r".*with --cp_size"):
        run_gloo(_with_schedule, 2, str(tmp_path), timeout_s=120)


def _train_odds(rank: int, world: int, output_dir: str, name: str, cp: dict, lora: bool = False) -> dict:
    """Two steps of TRL's experimental ORPO (`name` "orpo") or CPO ("cpo") trainer and an evaluation on 3 pairs; with
    `lora`, of a LoRA adapter without a task type (a `PeftModel`, whose forward takes `*args`)."""
    import importlib

    from hf_sparse_cp import sparse_arguments_class, sparse_trainer_class

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_OFFLINE="1")
    module = importlib.import_module(f"trl.experimental.{name}")
    config, trainer_class = (getattr(module, f"{name.upper()}{kind}") for kind in ("Config", "Trainer"))
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer), hidden_size=64,
                                                         intermediate_size=128, head_dim=16))
    settings = {key: DPO[key] for key in ("max_steps", "per_device_train_batch_size", "optim", "learning_rate",
                                          "logging_steps", "report_to", "save_strategy", "bf16",
                                          "gradient_checkpointing", "seed", "data_seed")}
    args = sparse_arguments_class(config)(output_dir=output_dir, max_length=256, **settings, **PATTERN, **cp)
    peft = {}
    if lora:
        from peft import LoraConfig

        peft = {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)}
    trainer = sparse_trainer_class(trainer_class)(
        model=model, args=args, train_dataset=datasets.Dataset.from_dict(_pairs()),
        eval_dataset=datasets.Dataset.from_dict(_pairs(3, seed=3)), processing_class=tokenizer, **peft)
    trainer.train()
    evaluation = trainer.evaluate()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    # (what a step measured, not computed: its speed, its memory)
    measured = ("tokens_per_second", "peak_memory_gib", "eval_runtime", "eval_samples_per_second",
                "eval_steps_per_second")
    return {"logs": [{key: value for key, value in log.items() if key not in measured} for log in logs],
            "eval": {key: value for key, value in evaluation.items() if key not in measured},
            "weights": {n: p.detach().clone() for n, p in trainer.model.named_parameters()}}


@pytest.mark.parametrize(("name", "lora"), [("orpo", False), ("cpo", False), ("orpo", True)],
                         ids=["orpo", "cpo", "orpo-lora"])
def test_orpo_and_cpo_under_cp2_equal_one_process(tmp_path, name, lora):
    """TRL's experimental ORPO and CPO trainers batch `chosen_input_ids` and `rejected_input_ids`, no `input_ids`: the
    plugin's tokens/s count raised 'context-parallel inputs need `input_ids`' at the first step of a run without CP.
    They train with sparse attention, and under CP 2 (where they were refused at start) as one process: their forward
    passes input_ids positionally (sharded by the forward's parameter name), and its logits come back whole on every
    rank, so TRL's odds-ratio (ORPO) or contrastive (CPO) loss, its NLL term, rewards and metrics of two steps and of an
    evaluation, and the weights after two SGD steps are one process's. So with a LoRA adapter without a task type
    (a `PeftModel`, whose forward takes `*args`: its input_ids are named by its base model's forward; they were
    refused)."""
    one = run_gloo(_train_odds, 1, str(tmp_path / "one"), name, {}, lora, timeout_s=300)[0]
    assert one["logs"][0]["loss"] != pytest.approx(one["logs"][1]["loss"])  # (it trained)
    assert any(0 < log.get("sparse/kept_fraction", 1) < 1 for log in one["logs"])  # the sparse path ran
    assert "nll_loss" in one["logs"][0] and "eval_rewards/margins" in one["eval"]
    for rank in run_gloo(_train_odds, 2, str(tmp_path / "cp2"), name, {"cp_size": 2}, lora, timeout_s=300):
        _assert_one_process(rank, one, abs_tol=1e-5)


def _assert_one_process(run: dict, one: dict, abs_tol: float) -> None:
    """`run`'s logs and evaluation are `one`'s (each value within 1e-5 relative, or `abs_tol`), and so are its
    weights (1e-5 relative, 1e-6 absolute)."""
    for got, want in zip([*run["logs"], run["eval"]], [*one["logs"], one["eval"]], strict=True):
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=abs_tol), (key, got[key], want[key])
    for name, want in one["weights"].items():
        assert torch.allclose(run["weights"][name], want, rtol=1e-5, atol=1e-6), name

REWARD_LOGGED = ("loss", "grad_norm", "min_reward", "mean_reward", "max_reward", "accuracy", "margin", "num_tokens")


def _train_reward(rank: int, world: int, output_dir: str, cp: dict, settings: dict, lora: bool = False,
                  eval_rows: int = 3) -> dict:
    """Two steps of TRL's RewardTrainer (a sequence-classification head scoring each row's last token, the pairwise
    loss of chosen against rejected) and an evaluation on `eval_rows` pairs, on pairs with a margin; with `lora`, of a
    LoRA adapter (the score head trained beside it)."""
    from transformers import AutoModelForSequenceClassification

    from hf_sparse_cp import SparseRewardConfig, SparseRewardTrainer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_OFFLINE="1")
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    model = AutoModelForSequenceClassification.from_config(tiny_config(
        "llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, head_dim=16, num_labels=1,
        pad_token_id=tokenizer.pad_token_id))

    def pairs(n: int, seed: int) -> dict[str, list]:
        rows = _pairs(n, seed)
        return {"chosen": [f"{p} {c}" for p, c in zip(rows["prompt"], rows["chosen"])],
                "rejected": [f"{p} {r}" for p, r in zip(rows["prompt"], rows["rejected"])],
                "margin": torch.linspace(0, 1, n).tolist()}

    peft = {}
    if lora:
        from peft import LoraConfig

        peft = {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                          task_type="SEQ_CLS")}
    reward = {key: DPO[key] for key in ("max_steps", "per_device_train_batch_size", "optim", "learning_rate",
                                        "logging_steps", "report_to", "save_strategy", "bf16", "gradient_checkpointing",
                                        "seed", "data_seed", "dataset_num_proc")}
    args = SparseRewardConfig(output_dir=output_dir, max_length=256, **{**reward, **settings}, **PATTERN, **cp)
    trainer = SparseRewardTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict(pairs(8, 0)),
                                  eval_dataset=datasets.Dataset.from_dict(pairs(eval_rows, 3)),
                                  processing_class=tokenizer, **peft)
    lengths = []
    hook = trainer.model.get_input_embeddings().register_forward_hook(lambda m, a, out: lengths.append(out.shape[1]))
    trainer.train()
    hook.remove()
    evaluation = trainer.evaluate()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    return {"logs": [{key: log[key] for key in REWARD_LOGGED} for log in logs], "lengths": lengths,
            "eval": {key: evaluation[f"eval_{key}"] for key in REWARD_LOGGED if f"eval_{key}" in evaluation},
            "kept": [log.get("sparse/kept_fraction") for log in logs],
            "weights": {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                        for name, p in trainer.model.named_parameters() if p.requires_grad}}


@pytest.mark.parametrize(("cp", "settings", "lora", "world"), [
    ({"cp_size": 2}, {"center_rewards_coefficient": 0.01, "gradient_checkpointing": True}, False, 2),  # ring, striped
    ({"cp_size": 2, "cp_mode": "ulysses"}, {}, True, 2),
    ({"cp_size": 2, "cp_sharding": "zigzag", **FSDP2}, {}, False, 2),  # sharded parameters
    ({"cp_size": 2}, {}, False, 4),  # DP 2 x CP 2: each CP group half of every batch
], ids=["ring-striped-centered", "ulysses-lora", "fsdp2-ring-zigzag", "dp2-x-cp2"])
def test_reward_under_cp_equals_one_process(tmp_path, cp, settings, lora, world):
    """TRL's RewardTrainer under CP: each forward takes its shard of every row, and the head's score of each row's
    last token, taken on the rank holding it, comes back to every rank of the CP group (`heads.pool_over_cp_group`),
    so TRL's pairwise loss (a margin per pair; centered rewards), its metrics, an evaluation's and the trained weights
    after two SGD steps are one process's (under DP 2 x CP 2, one process's on the whole batch). Before, it was
    refused at start."""
    dp = world // 2
    whole = {"per_device_train_batch_size": 2 * dp}
    # (DP 2 pads an evaluation set it cannot split evenly with repeated rows, which TRL's means count: 4 pairs)
    eval_rows = 3 if dp == 1 else 4
    one = run_gloo(_train_reward, 1, str(tmp_path / "one"), {}, {**settings, **whole}, lora, eval_rows,
                   timeout_s=300)[0]
    assert one["logs"][0]["loss"] != pytest.approx(one["logs"][1]["loss"])  # (it trained)
    assert any(0 < kept < 1 for kept in one["kept"])  # the sparse path ran
    for rank in run_gloo(_train_reward, world, str(tmp_path / "cp"), cp, settings, lora, eval_rows, timeout_s=300):
        _assert_one_process(rank, one, abs_tol=1e-6)
        # (each rank's forward took half of each of its rows: a DP group's longest row is at most the batch's)
        assert all(2 * n <= m + 64 for n, m in zip(rank["lengths"][:2], one["lengths"][:2])), rank["lengths"]


def _precomputed(tmp_path, weights: dict, sparse: dict | None, as_path: bool = False, data=None, kind: str = "dpo",
                 **dpo) -> torch.Tensor:
    """The reference log-probs of the chosen completions a DPOTrainer (`kind` "dpo"; a KTOTrainer's of its completions,
    "kto") precomputes in its `__init__`: stock (`sparse` None) or with the plugin's flags `sparse`; the model given by
    its folder (`as_path`, as a Hub id: TRL loads it) or as a model; over `data` (four pairs in memory when None, apart
    for KTO); `dpo`: the trainer's settings over `DPO`."""
    import trl

    from hf_sparse_cp import sparse_arguments_class, sparse_trainer_class

    arguments_class, trainer_class = (getattr(trl, f"{kind.upper()}{part}") for part in ("Config", "Trainer"))

    tokenizer = byte_tokenizer()
    config = tiny_config("llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, head_dim=16)
    models = [AutoModelForCausalLM.from_config(config) for _ in "mr"]
    for model in models:
        model.load_state_dict(weights)
    if as_path:
        models[0].save_pretrained(tmp_path / "m")
    settings = dict(output_dir=str(tmp_path), **{**DPO, **dpo}, precompute_ref_log_probs=True)
    args = (sparse_arguments_class(arguments_class)(**settings, **sparse) if sparse is not None
            else arguments_class(**settings))
    pairs = _pairs(4) if kind == "dpo" else _unpaired(_pairs(4))
    trainer = (sparse_trainer_class(trainer_class) if sparse is not None else trainer_class)(
        model=str(tmp_path / "m") if as_path else models[0], ref_model=models[1], args=args,
        train_dataset=datasets.Dataset.from_dict(pairs) if data is None else data, processing_class=tokenizer)
    return torch.tensor(trainer.train_dataset["ref_chosen_logps" if kind == "dpo" else "ref_logps"])


def _tiny_weights() -> dict:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(byte_tokenizer()), hidden_size=64,
                                                        intermediate_size=128, head_dim=16)).state_dict()


def test_precomputed_reference_log_probs_of_a_model_given_by_its_hub_id_are_the_patterns(tmp_path):
    """A model given by its Hub id (here its folder) is loaded in TRL's own `__init__`, which precomputes the reference
    log-probs before it returns: the plugin set the model up only after that, so the pass ran the stock attention (a
    bias in every reward). It is set up before the pass: the log-probs are those of the model given as a model."""
    weights = _tiny_weights()
    given = _precomputed(tmp_path / "given", weights, PATTERN)
    loaded = _precomputed(tmp_path / "loaded", weights, PATTERN, as_path=True)
    assert torch.allclose(loaded, given, rtol=1e-6, atol=1e-5), (loaded, given)
    assert not torch.allclose(_precomputed(tmp_path / "stock", weights, None), given)  # (the pattern drops blocks)


@pytest.mark.parametrize("kind, in_flags", [("dpo", False), ("dpo", True), ("kto", False), ("kto", True)],
                         ids=["sparse_config-file-changed", "flags-truncation-keep_end",
                              "kto-sparse_config-file-changed", "kto-flags-no-max_length"])
def test_precomputed_reference_log_probs_are_cached_per_pattern(tmp_path, kind, in_flags):
    """TRL caches the reference log-probs it precomputes beside a dataset stored in files, keyed by the processed
    data's fingerprint and the reference's weights. The fingerprint carries the Trainer's arguments only through the
    filter of over-long prompts (truncation_mode keep_start, with a max_length), and then a --sparse_config file's path,
    not what it holds: a run whose pattern file had changed, or under keep_end one of other pattern flags (the stock
    attention's too), read the log-probs of the earlier pattern. The key carries the pattern used: another pattern
    computes (and caches) its own, the same pattern reads them. The same for KTO's, whose filter (keep_start
    always) carries the arguments unless max_length is None."""
    import json

    datasets.Dataset.from_dict(_pairs(4) if kind == "dpo" else _unpaired(_pairs(4))).save_to_disk(tmp_path / "data")
    weights, pattern_file = _tiny_weights(), tmp_path / "pattern.yaml"

    def precomputed(vertical_slash: int) -> tuple[torch.Tensor, set[str]]:
        data = datasets.load_from_disk(tmp_path / "data")
        if in_flags:
            logps = _precomputed(tmp_path, weights, {**PATTERN, "sparse_vertical_topk": vertical_slash,
                                                     "sparse_slash_topk": vertical_slash},
                                 data=data, kind=kind, **({"truncation_mode": "keep_end"} if kind == "dpo" else
                                                          {"max_length": None}))
        else:
            pattern_file.write_text(json.dumps({
                "block_size": 32, "min_seq_len": 64, "local_window": 32, "sink_tokens": 4, "scoring": {"last_q": 16},
                "budget": {"mode": "topk", "vertical_topk": vertical_slash, "slash_topk": vertical_slash}}))
            logps = _precomputed(tmp_path, weights, {"sparse_config": str(pattern_file)}, data=data, kind=kind)
        # (the cache files of precomputed log-probs, beside those of the data's processing)
        return logps, {path.name for path in (tmp_path / "data").glob("cache-*.arrow")
                       if all(name.startswith("ref_") for name in datasets.Dataset.from_file(str(path)).column_names)}

    first, cached = precomputed(8)
    other, after_other = precomputed(2)
    assert cached and after_other > cached, (cached, after_other)  # (it computed and cached its own)
    assert not torch.equal(other, first), other
    again, after_again = precomputed(8)
    assert after_again == after_other  # (read from the first run's cache)
    assert torch.equal(again, first)


def _precompute_on_ranks(rank: int, world: int, output_dir: str, in_files: bool,
                         plugin: bool = True, eval_in_memory: bool = False) -> tuple[str, list[float] | str]:
    """A DPOTrainer's `__init__` with --precompute_ref_log_probs on each rank, over pairs held in memory or stored in
    files (`in_files`; evaluated on pairs held in memory with `eval_in_memory`), the plugin's (`plugin`) or TRL's own:
    the log-probs it precomputed, or the error it raised."""
    from trl import DPOConfig, DPOTrainer

    from hf_sparse_cp import SparseDPOConfig, SparseDPOTrainer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    data = datasets.Dataset.from_dict(_pairs(4))
    if in_files:
        if rank == 0:
            data.save_to_disk(os.path.join(output_dir, "data"))
        torch.distributed.barrier()
        data = datasets.load_from_disk(os.path.join(output_dir, "data"))
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer), hidden_size=64,
                                                         intermediate_size=128, head_dim=16))
    settings = dict(output_dir=output_dir, **DPO, precompute_ref_log_probs=True)
    # (TRL's own runs CPU processes as one each unless told use_cpu; the plugin runs them together)
    args = SparseDPOConfig(**settings, **PATTERN) if plugin else DPOConfig(**settings, use_cpu=True)
    try:
        trainer = (SparseDPOTrainer if plugin else DPOTrainer)(
            model=model, args=args, train_dataset=data, processing_class=tokenizer,
            eval_dataset=datasets.Dataset.from_dict(_pairs(2)) if eval_in_memory else None)
    except (ValueError, FileNotFoundError) as e:
        return type(e).__name__, str(e)
    return "ok", list(trainer.train_dataset["ref_chosen_logps"])


def test_precomputed_reference_log_probs_under_two_processes_need_a_dataset_in_files(tmp_path):
    """TRL's --precompute_ref_log_probs under several processes caches the log-probs in a file the main process writes
    and every process reads, named after the dataset's cache files: a dataset held in memory has none, so each process
    named a random file of its own temporary folder and rank 1 failed with FileNotFoundError after the whole pass (so
    does TRL 1.16 without the plugin: when it no longer does, the refusal goes). Refused on every rank before the pass,
    naming the fix, which works."""
    stock = run_gloo(_precompute_on_ranks, 2, str(tmp_path / "stock"), False, False, timeout_s=120)
    assert [kind for kind, _ in stock] == ["ok", "FileNotFoundError"], stock
    refused = run_gloo(_precompute_on_ranks, 2, str(tmp_path / "memory"), False, timeout_s=120)
    for kind, message in refused:
        assert kind == "ValueError" and "files: the 'train' dataset is held in memory" in message, message
        assert "load_from_disk" in message and "--precompute_ref_log_probs false" in message
    (kind, logps), other = run_gloo(_precompute_on_ranks, 2, str(tmp_path / "files"), True, timeout_s=120)
    assert kind == "ok" and other == (kind, logps), other
    # (an eval dataset held in memory, whose pass TRL runs after the train dataset's: refused before that one)
    for kind, message in run_gloo(_precompute_on_ranks, 2, str(tmp_path / "eval"), True, True, True, timeout_s=120):
        assert kind == "ValueError" and "the 'eval' dataset is held in memory" in message, (kind, message)
