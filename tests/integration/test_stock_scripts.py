"""Stock-shaped scripts, unchanged, with the plugin (issue #42): a run_clm-shaped script, a TRL sft-shaped script and
a script that builds its TrainingArguments in code (tests/integration/stock_scripts/, written for these tests) run
under `python -m hf_sparse_cp.run` in one process, under torchrun and under accelerate launch with CP 2, and the
CP runs equal the one-process run: the loss of every step, the kept fraction, TRL's token count and the saved
weights. The saved models load without the plugin, and a script run without the launcher is stock."""

import ast
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_sparse_cp.examples.tokenizer import byte_tokenizer
from hf_sparse_cp.testing.spawn import CLI, accelerate_cpu_launch, launch_env
from hf_sparse_cp.testing.tiny_models import tiny_config

pytest.importorskip("trl")

SCRIPTS = Path(__file__).resolve().parent / "stock_scripts"
# A pattern sparse at these lengths (blocks of 32, documents of 64 or 128 tokens and more sparse).
PATTERN = ["--sparse_block_size", "32", "--sparse_vertical_topk", "8", "--sparse_slash_topk", "8",
           "--sparse_local_window", "32", "--sparse_sink_tokens", "4", "--sparse_last_q", "16"]
TRAIN = ["--max_steps", "3", "--per_device_train_batch_size", "1", "--learning_rate", "1e-3", "--logging_steps", "1",
         "--report_to", "none", "--save_strategy", "no", "--seed", "0"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
RUN = ["-m", "hf_sparse_cp.run"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """What the scripts read: a tiny model and its tokenizer saved to a folder, a text file, a JSON-lines dataset."""
    work = tmp_path_factory.mktemp("stock_scripts")
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer)))
    model.save_pretrained(work / "tiny")
    tokenizer.save_pretrained(work / "tiny")
    g = torch.Generator().manual_seed(0)
    words = ["sparse", "attention", "ring", "packed", "document", "token", "block", "query", "key", "value"]
    texts = [" ".join(words[i] for i in torch.randint(0, len(words), (n // 4,), generator=g).tolist())[:n]
             for n in torch.randint(40, 300, (24,), generator=g).tolist()]
    (work / "corpus.txt").write_text("\n".join(texts) + "\n")
    (work / "sft_data").mkdir()
    (work / "sft_data" / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (work / "sft_data" / "test.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:4]))
    return work


def _env(workdir: Path) -> dict[str, str]:
    return launch_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(workdir / "datasets_cache"),
                      HF_HUB_DISABLE_TELEMETRY="1")


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _stop_leftover_launches():
    """A test that failed before waiting for all of its launches stops the rest (and their workers)."""
    yield
    while _STARTED:
        process = _STARTED.pop()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _start(command: list[str], cwd: Path | None = None, env: dict[str, str] | None = None,
           timeout: float = 900) -> Callable[[], subprocess.CompletedProcess]:
    """Start `command` now and return the call that waits for it (its CompletedProcess): a test starts its launches
    together, since each spends seconds on one core (a fresh interpreter's imports, a one-process run) where the
    machine has more."""
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
    _STARTED.append(process)

    def wait() -> subprocess.CompletedProcess:
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(command, process.returncode, out.read(), err.read())

    return wait


def _start_script(workdir: Path, launcher: list[str], script: str, args: list[str], before: list[str] = (),
                  cwd: Path | None = None) -> Callable[[], dict]:
    """Start `script` unchanged under `launcher` in `cwd` (default `workdir`, whose data it reads); the returned call
    waits for its trainer_state.json's log per step."""
    cwd = workdir if cwd is None else cwd
    wait = _start([*launcher, *before, str(SCRIPTS / script), *args], cwd, _env(workdir))

    def result() -> dict:
        done = wait()
        assert done.returncode == 0, f"{' '.join(done.args)}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        output = cwd / _output_dir(args)
        logs = json.loads((output / "trainer_state.json").read_text())["log_history"]
        return {"steps": [log for log in logs if "loss" in log], "evals": [log for log in logs if "eval_loss" in log],
                "output": output, "stderr": done.stderr}

    return result


def _run(workdir: Path, launcher: list[str], script: str, args: list[str], before: list[str] = ()) -> dict:
    """Run `script` unchanged under `launcher` in `workdir`; its trainer_state.json's log per step."""
    return _start_script(workdir, launcher, script, args, before)()


def _output_dir(args: list[str]) -> str:
    return args[args.index("--output_dir") + 1] if "--output_dir" in args else "out_in_code"


def _assert_equal_runs(run: dict, one: dict, keys=("loss", "sparse/kept_fraction"), atol: float = 1e-5) -> None:
    assert len(run["steps"]) == len(one["steps"]) == 3
    for got, want in zip(run["steps"], one["steps"]):
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=1e-4), (key, run["steps"], one["steps"])
    assert any(step["sparse/kept_fraction"] < 0.95 for step in one["steps"])  # the sparse path ran
    weights, reference = load_file(run["output"] / "model.safetensors"), load_file(one["output"] / "model.safetensors")
    for name, tensor in reference.items():  # after three optimizer steps on those gradients
        assert torch.allclose(weights[name], tensor, rtol=1e-4, atol=atol), name


def _clm_args(out: str) -> list[str]:
    return ["--model_type", "llama", "--config_overrides", "vocab_size=259,hidden_size=64,intermediate_size=128,"
            "num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2", "--tokenizer_name", "tiny",
            "--train_file", "corpus.txt", "--block_size", "256", "--output_dir", out, *TRAIN]


def _sft_args(out: str) -> list[str]:
    return ["--model_name_or_path", "tiny", "--dataset_name", "sft_data", "--output_dir", out, "--max_length", "256",
            "--packing", "--padding_free", "true", "--bf16", "false", "--gradient_checkpointing", "false", *TRAIN]


@pytest.fixture(scope="module")
def clm(workdir):
    """The run_clm-shaped script in one process and under torchrun with CP 2, both with run_clm.py's --do_eval
    (compute_metrics: the accuracy of preprocess_logits_for_metrics' argmax; the last of the validation blocks alone in
    its batch of 2), and under accelerate launch with CP 2 (training only)."""
    plugin = [*PATTERN, "--sparse_min_seq_len", "128"]
    evaluation = ["--validation_file", "validation.txt", "--do_train", "--do_eval", "--per_device_eval_batch_size", "2"]
    (workdir / "validation.txt").write_text((workdir / "corpus.txt").read_text()[:1400])
    runs = {"one": _start_script(workdir, [sys.executable, *RUN], "run_clm_shaped.py",
                                 [*_clm_args("clm_one"), *plugin, *evaluation]),
            "torchrun": _start_script(workdir, [*TORCHRUN, *RUN], "run_clm_shaped.py",
                                      [*_clm_args("clm_torchrun"), *plugin, *evaluation, "--cp_size", "2"]),
            "accelerate": _start_script(workdir, [*accelerate_cpu_launch(), *RUN], "run_clm_shaped.py",
                                        [*_clm_args("clm_accelerate"), *plugin, "--cp_size", "2"])}
    return {name: result() for name, result in runs.items()}


def test_run_clm_shaped_script_unchanged_one_process_torchrun_and_accelerate_cp2(workdir, clm):
    for run in (clm["torchrun"], clm["accelerate"]):
        _assert_equal_runs(run, clm["one"])
    assert "CP 2 x DP 1" in (clm["torchrun"]["output"] / "README.md").read_text()
    loads = _start_loading_without_the_plugin(clm["torchrun"]["output"])
    stock = _run(workdir, [sys.executable], "run_clm_shaped.py", _clm_args("clm_stock"))  # no launcher: stock
    assert "sparse_attention" not in json.loads((stock["output"] / "config.json").read_text())
    assert not any(key.startswith("sparse/") for step in stock["steps"] for key in step)
    assert "hf-sparse-cp" not in (stock["output"] / "README.md").read_text()
    loads()


def test_run_clm_shaped_script_evaluates_with_compute_metrics_under_cp2_as_one_process(clm):
    """run_clm.py's --do_eval under torchrun with CP 2 reports one process's metrics (the `clm` runs)."""
    _assert_equal_runs(clm["torchrun"], clm["one"])
    want, got = (json.loads((clm[run]["output"] / "eval_results.json").read_text()) for run in ("one", "torchrun"))
    assert want["eval_samples"] % 2 == 1 and 0 < want["eval_accuracy"] < 1
    assert got["eval_samples"] == want["eval_samples"]
    assert got["eval_accuracy"] == want["eval_accuracy"]
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)


def test_trl_sft_shaped_script_unchanged_one_process_torchrun_and_accelerate_cp2(workdir):
    plugin = [*PATTERN, "--sparse_min_seq_len", "64", "--eval_strategy", "steps", "--eval_steps", "3"]
    runs = (_start_script(workdir, [sys.executable, *RUN], "sft_shaped.py", [*_sft_args("sft_one"), *plugin]),
            _start_script(workdir, [*TORCHRUN, *RUN], "sft_shaped.py", [*_sft_args("sft_torchrun"), *plugin,
                                                                        "--cp_size", "2"]),
            _start_script(workdir, [*accelerate_cpu_launch(), *RUN], "sft_shaped.py",
                          [*_sft_args("sft_accelerate"), *plugin, "--cp_size", "2"]))
    one, torchrun, accelerate = (result() for result in runs)
    loads = _start_loading_without_the_plugin(accelerate["output"])
    for run in (torchrun, accelerate):
        # TRL's num_tokens counts what one process counts (not the padding that splits the rows over the ranks); its
        # entropy and token accuracy are the batch's (they logged the first CP rank's shard: accuracy 0.016 for 0.008)
        _assert_equal_runs(run, one, keys=("loss", "sparse/kept_fraction", "num_tokens", "entropy",
                                           "mean_token_accuracy"))
        # and so are the evaluation's (eval_num_tokens, the training tokens so far, logged 768 padded for 701)
        assert len(run["evals"]) == len(one["evals"]) == 1
        for key in ("eval_loss", "eval_num_tokens", "eval_entropy", "eval_mean_token_accuracy"):
            assert run["evals"][0][key] == pytest.approx(one["evals"][0][key], rel=1e-4), (key, run["evals"])
    loads()


def test_script_building_its_arguments_in_code_unchanged_one_process_torchrun_and_accelerate_cp2(workdir):
    plugin = [*PATTERN, "--sparse_min_seq_len", "128"]
    hf_sparse_cp = [*CLI, "launch"]
    # the script writes to out_in_code in its working directory: the runs that start together each get their own
    folders = [workdir / "in_code" / name for name in ("one", "accelerate", "refused")]
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
    runs = (_start_script(workdir, hf_sparse_cp, "trainer_in_code.py", [], before=plugin, cwd=folders[0]),
            _start_script(workdir, [*hf_sparse_cp, "--nproc", "2"], "trainer_in_code.py", [],
                          before=[*plugin, "--cp_size", "2"]),
            _start_script(workdir, [*accelerate_cpu_launch(), *RUN], "trainer_in_code.py", [],
                          before=[*plugin, "--cp_size", "2"], cwd=folders[1]),
            # plugin flags the script would never read
            _start_script(workdir, [sys.executable, *RUN], "trainer_in_code.py", ["--cp_size", "2"], cwd=folders[2]))
    one, torchrun, accelerate = (result() for result in runs[:3])
    for run in (torchrun, accelerate):
        # (AdamW at 1e-3: a weight whose gradient is near zero moves by up to the learning rate on the float32
        # rounding of that gradient; one moved 1.5e-5 apart, the losses 1e-7 apart)
        _assert_equal_runs(run, one, atol=1e-4)
        assert [step["own_subclass_steps"] for step in run["steps"]] == [1, 2, 3]  # the script's own Trainer class
    record = json.loads((torchrun["output"] / "run_record.json").read_text())
    script = str(SCRIPTS / "trainer_in_code.py")
    assert record == {"name": "__main__", "file": script, "argv": [script], "path0": str(SCRIPTS),
                      "cwd": str(workdir)}  # as `python trainer_in_code.py` run in workdir sees itself
    with pytest.raises(AssertionError, match="--cp_size reaches the script, .* never reads it:"):
        runs[3]()


def test_trls_own_sft_script_unchanged_under_cp2_equals_one_process(workdir):
    """TRL's installed `trl.scripts.sft` itself (`-m`), through the `hf-sparse-cp launch` shorthand, and under CP 2
    through `hf-sparse-cp train` (which runs a script it is given as `launch` does: it ended in the example's
    'unrecognized arguments'): the weights after three steps under CP 2 are those of one process."""
    plugin = [*PATTERN, "--sparse_min_seq_len", "64"]
    runs = {name: _start([*CLI, command, *extra, "-m", "trl.scripts.sft", *_sft_args(name), *plugin, *cp], workdir,
                         _env(workdir))
            for name, command, extra, cp in (("trl_one", "launch", [], []),
                                             ("trl_cp2", "train", ["--nproc", "2"], ["--cp_size", "2"]))}
    outputs = []
    for name, result in runs.items():
        done = result()
        assert done.returncode == 0, done.stderr[-6000:]
        assert "sparse_cp: 1 of 2 layers vertical-slash" in done.stderr + done.stdout
        outputs.append(load_file(workdir / name / "model.safetensors"))
    for name, tensor in outputs[0].items():
        assert torch.allclose(outputs[1][name], tensor, rtol=1e-4, atol=1e-5), name
    assert any(not torch.equal(outputs[0][name], tensor) for name, tensor in load_file(
        workdir / "tiny" / "model.safetensors").items())  # (it trained)
    _assert_loads_without_the_plugin(workdir / "trl_cp2")


def _trl_script(workdir: Path, name: str, script: str, data: list[dict], args: list[str],
                cp: list[str], test: list[dict] | None = None) -> Callable[[], subprocess.CompletedProcess]:
    """Start TRL's installed `trl/scripts/<script>.py`, unchanged, through `hf-sparse-cp launch` on `data` (JSON
    lines; `test`: the evaluation split's); the returned call waits for it."""
    (workdir / f"{name}_data").mkdir(exist_ok=True)
    for split, rows in (("train", data), ("test", test)):
        if rows is not None:
            (workdir / f"{name}_data" / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    command = [*CLI, "launch", *cp, "-m", f"trl.scripts.{script}",
               "--model_name_or_path", "tiny", "--dataset_name", f"{name}_data", "--output_dir", name, *TRAIN,
               "--bf16", "false", "--gradient_checkpointing", "false", *PATTERN, "--sparse_min_seq_len", "64", *args]
    return _start(command, workdir, _env(workdir), timeout=600)


def _words(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    words = ["sparse", "attention", "ring", "packed", "document", "token", "block", "query", "key", "value"]
    return [" ".join(words[i] for i in torch.randint(0, len(words), (k,), generator=g).tolist())
            for k in torch.randint(10, 40, (n,), generator=g).tolist()]


def test_trls_dpo_script_under_cp2_equals_one_process(workdir):
    """TRL's dpo.py trains with sparse attention, its reference model attending as the policy does (it logged rewards
    of 0.024 at step 1 with a stock reference), and under CP 2, where it was refused at start (before that it crashed
    mid-step on a shard's log-probs against the whole batch's masks), as one process does: the loss, rewards and
    log-probs of every step and the saved weights (SGD: the update is the gradient's)."""
    prompts, chosen, rejected = _words(8, 0), _words(8, 1), _words(8, 2)
    data = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in zip(prompts, chosen, rejected)]
    sgd = ["--optim", "sgd", "--learning_rate", "0.05"]
    one, cp2 = (_trl_script(workdir, f"dpo_{name}", "dpo", data, sgd, cp)
                for name, cp in (("one", []), ("cp2", ["--nproc", "2", "--cp_size", "2"])))
    logs, reference = _assert_cp2_trains_as_one_process(workdir, "dpo", one(), cp2(), (
        "loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"))
    first = reference[0]  # the reference model attends as the policy does: at step 1 they are one model
    assert (first["rewards/chosen"], first["rewards/rejected"], first["loss"]) == ("0", "0", "0.6931"), first
    assert logs[0]["loss"] != logs[2]["loss"]


# An accelerate launch config of FSDP2 on 2 processes (on CPU processes the plugin runs its FSDP2 over gloo)
FSDP2_CONFIG = ("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
                "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_state_dict_type: FULL_STATE_DICT\n"
                "mixed_precision: 'no'\nnum_machines: 1\nnum_processes: 2\nmachine_rank: 0\nrdzv_backend: static\n"
                "same_network: true\nuse_cpu: false\nmain_process_port: {port}\n")


@pytest.mark.parametrize(("script", "fsdp"), [("grpo", False), ("rloo", False), ("grpo", True)],
                         ids=["grpo", "rloo", "grpo-accelerate-fsdp2"])
def test_trls_generating_script_under_cp2_equals_one_process(workdir, script, fsdp):
    """TRL's grpo.py and rloo.py (their Trainer completes the prompts it gets and computes its own loss) train with
    sparse attention, and under CP 2, where they were refused at start, as one process does: each CP group's first
    rank generates and scores the step's completions and shares them with its group, the loss's forwards take half of
    every row; also under an accelerate FSDP2 config (`--config_file`: every rank generates in step, its checkpoint
    the plugin's sharded state). The loss, rewards and entropy of every step and the saved weights (SGD: the update is
    the gradient's; RLOO's default beta 0.05: a KL penalty to the reference model in its rewards)."""
    data = [{"prompt": p} for p in _words(8, 0)]
    # the reward: a function the script imports from the working directory (`module.function`)
    (workdir / "length_reward.py").write_text("def reward(completions, **kwargs):\n"
                                              "    return [float(len(c)) for c in completions]\n")
    args = ["--reward_funcs", "length_reward.reward", "--num_generations", "2", "--max_completion_length", "8",
            "--per_device_train_batch_size", "2", "--optim", "sgd", "--learning_rate", "0.05"]
    launcher = ["--nproc", "2"]
    if fsdp:
        with socket.socket() as s:  # (a free port: accelerate's default, 29500, may be another test's)
            s.bind(("127.0.0.1", 0))
            (workdir / "fsdp2.yaml").write_text(FSDP2_CONFIG.format(port=s.getsockname()[1]))
        launcher = ["--config_file", str(workdir / "fsdp2.yaml")]
        args += ["--save_strategy", "steps", "--save_steps", "3"]
    one, cp2 = (_trl_script(workdir, f"{script}_{name}", script, data, args, cp)
                for name, cp in (("one", []), ("cp2", [*launcher, "--cp_size", "2"])))
    _, reference = _assert_cp2_trains_as_one_process(workdir, script, one(), cp2(), (
        "loss", "grad_norm", "reward", "reward_std", "entropy", "completions/mean_length", "num_tokens"))
    assert any(float(log["reward_std"]) > 0 for log in reference)
    # (FSDP2 ran: its checkpoint holds each rank's shard of the parameters)
    assert (workdir / f"{script}_cp2" / "checkpoint-3" / "hf_sparse_cp_sharded_state").exists() == fsdp


def test_trls_dpo_script_with_precomputed_reference_log_probs_under_fsdp2_cp2_equals_one_process(workdir):
    """dpo.py with --precompute_ref_log_probs under an accelerate FSDP2 config: TRL loads a reference from the model's
    path and runs it in DPOTrainer's `__init__`, before `train`, where the plugin switches a reference to the trained
    model's pattern: its log-probs were the stock attention's, the rewards at step 1 away from 0 (0.004 and 0.021,
    the loss 0.7015 for log 2, with or without CP). Under CP 2 it trains as one process, the two one model at step 1."""
    prompts, chosen, rejected = _words(8, 0), _words(8, 1), _words(8, 2)
    data = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in zip(prompts, chosen, rejected)]
    with socket.socket() as s:  # (a free port: accelerate's default, 29500, may be another test's)
        s.bind(("127.0.0.1", 0))
        (workdir / "fsdp2_dpo.yaml").write_text(FSDP2_CONFIG.format(port=s.getsockname()[1]))
    args = ["--optim", "sgd", "--learning_rate", "0.05", "--precompute_ref_log_probs", "true"]
    one, cp2 = (_trl_script(workdir, f"dpo_pre_{name}", "dpo", data, args, cp) for name, cp in (
        ("one", []), ("cp2", ["--config_file", str(workdir / "fsdp2_dpo.yaml"), "--cp_size", "2"])))
    _, reference = _assert_cp2_trains_as_one_process(workdir, "dpo_pre", one(), cp2(), (
        "loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"))
    assert (reference[0]["rewards/chosen"], reference[0]["loss"]) == ("0", "0.6931"), reference[0]


def test_trls_reward_script_under_cp2_equals_one_process(workdir):
    """TRL's reward.py (a sequence-classification head scoring each row's last token, its own pairwise loss) trains
    with sparse attention, and under CP 2, where it was refused at start, as one process does: its batches are kept
    whole, each forward sharded and the head's score of each row's last token taken on the rank holding it
    (`whole_rows.py`, `heads.pool_over_cp_group`): the loss, grad_norm, rewards, accuracy and margin of every step and
    of an evaluation, and the saved weights (SGD: the update is the gradient's)."""
    prompts, chosen, rejected = _words(8, 0), _words(8, 1), _words(8, 2)
    data = [{"chosen": f"{p} {c}", "rejected": f"{p} {r}"} for p, c, r in zip(prompts, chosen, rejected)]
    args = ["--optim", "sgd", "--learning_rate", "0.05", "--per_device_train_batch_size", "2", "--eval_strategy",
            "steps", "--eval_steps", "3", "--per_device_eval_batch_size", "2"]
    one, cp2 = (_trl_script(workdir, f"reward_{name}", "reward", data, args, cp, test=data[:3])
                for name, cp in (("one", []), ("cp2", ["--nproc", "2", "--cp_size", "2"])))
    one, cp2 = one(), cp2()
    logs, reference = _assert_cp2_trains_as_one_process(workdir, "reward", one, cp2, (
        "loss", "grad_norm", "min_reward", "mean_reward", "max_reward", "accuracy", "margin", "num_tokens"))
    assert logs[0]["loss"] != logs[2]["loss"], (logs, reference)
    assert any(float(log["sparse/kept_fraction"]) < 0.95 for log in reference), reference
    evaluated, reference = _eval_logs(cp2.stdout), _eval_logs(one.stdout)
    assert len(evaluated) == len(reference) == 1, (evaluated, reference)
    for key in ("eval_loss", "eval_mean_reward", "eval_accuracy", "eval_margin"):
        assert float(evaluated[0][key]) == pytest.approx(float(reference[0][key]), rel=1e-3, abs=1e-4), key


def test_trls_kto_script_under_cp2_equals_one_process(workdir):
    """TRL's kto.py (unpaired completions labelled desirable or not; a KL estimate from the batch's mismatched
    prompt-completion pairs, two more forwards of the trained and reference models) trains with sparse attention, and
    under CP 2 as one process does (its forwards' outputs gathered into whole rows, as DPO's: `whole_rows.py`): the
    loss, KL estimate, rewards, log-probs and logits of every step and the saved weights (SGD: the update is the
    gradient's; at 0.2 the KL estimate, clamped at 0, is positive by step 3)."""
    prompts, chosen, rejected = _words(8, 0), _words(8, 1), _words(8, 2)
    data = [{"prompt": p, "completion": (c, r)[i % 2], "label": i % 2 == 0}
            for i, (p, c, r) in enumerate(zip(prompts, chosen, rejected))]
    args = ["--optim", "sgd", "--learning_rate", "0.2", "--per_device_train_batch_size", "2"]
    one, cp2 = (_trl_script(workdir, f"kto_{name}", "kto", data, args, cp)
                for name, cp in (("one", []), ("cp2", ["--nproc", "2", "--cp_size", "2"])))
    logs, reference = _assert_cp2_trains_as_one_process(workdir, "kto", one(), cp2(), (
        "loss", "grad_norm", "kl", "entropy", "num_tokens", "rewards/chosen", "rewards/rejected", "logps/chosen",
        "logps/rejected", "logits/chosen", "logits/rejected"))
    assert reference[0]["loss"] == "0.5" and any(float(log["kl"]) > 0 for log in reference), reference


def test_trls_distillation_script_trains_without_cp_and_is_refused_once_under_cp2(workdir):
    """TRL's distillation.py (the student completes each prompt; its loss, TRL's own, is a divergence from a teacher
    model's token distributions: a local tiny teacher) trains with sparse attention on one process, and under CP 2,
    where each rank's outputs would be its shard's, `hf-sparse-cp launch` refuses it before starting any process: exit
    status 2, one error line naming the cause and the fix, no traceback."""
    data = [{"prompt": p} for p in _words(8, 0)]
    args = ["--teacher_model_name_or_path", "tiny", "--max_completion_length", "8", "--per_device_train_batch_size",
            "2", "--optim", "sgd", "--learning_rate", "0.05"]
    one, cp2 = (_trl_script(workdir, f"distillation_{name}", "distillation", data, args, cp)
                for name, cp in (("one", []), ("cp2", ["--nproc", "2", "--cp_size", "2"])))
    one, cp2 = one(), cp2()
    assert one.returncode == 0, one.stderr[-6000:]
    assert "Training completed" in one.stdout and "context parallelism: off" in one.stderr + one.stdout
    logs = _logs(one.stdout)
    assert len(logs) == 3 and all(float(log["loss"]) > 0 for log in logs), logs
    assert any(float(log["sparse/kept_fraction"]) < 1 for log in logs), logs  # (the sparse path ran)
    trained, base = (load_file(workdir / folder / "model.safetensors") for folder in ("distillation_one", "tiny"))
    assert any(not torch.equal(trained[name], base[name]) for name in base)  # (it trained)
    assert cp2.returncode == 2 and "Traceback" not in cp2.stderr and not cp2.stdout, cp2.stderr
    errors = [line for line in cp2.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "DistillationTrainer under context parallelism (CP 2) is not supported" in errors[0] \
        and "Fix: run without CP" in errors[0], cp2.stderr
    assert not (workdir / "distillation_cp2").exists()  # (no process started)


def _assert_cp2_trains_as_one_process(workdir: Path, name: str, one: subprocess.CompletedProcess,
                                      cp2: subprocess.CompletedProcess, keys: tuple[str, ...]) -> tuple[list, list]:
    """TRL's `name` script ran on one process (`one`, into `<name>_one`) and under CP 2 (`cp2`, `<name>_cp2`), and
    they trained alike: the logged `keys` of every step (as TRL prints them: 4 significant digits) and the saved
    weights (SGD) equal, which moved. Returns the CP 2 and the one-process logs."""
    assert one.returncode == 0, one.stderr[-6000:]
    assert "Training completed" in one.stdout and "context parallelism: off" in one.stderr + one.stdout
    assert cp2.returncode == 0, cp2.stderr[-6000:]
    assert "context parallelism: CP 2 x DP 1" in cp2.stderr + cp2.stdout
    logs, reference = _logs(cp2.stdout), _logs(one.stdout)
    assert len(logs) == len(reference) == 3, (logs, reference)
    for got, want in zip(logs, reference):
        for key in keys:
            assert float(got[key]) == pytest.approx(float(want[key]), rel=1e-3, abs=1e-4), (key, logs, reference)
    weights, trained, base = (load_file(workdir / folder / "model.safetensors")
                              for folder in (f"{name}_cp2", f"{name}_one", "tiny"))
    for key, tensor in trained.items():
        assert torch.allclose(weights[key], tensor, rtol=1e-5, atol=1e-6), key
    assert any(not torch.equal(trained[key], base[key]) for key in base if key in trained)  # (it trained)
    return logs, reference


def _logs(stdout: str) -> list[dict]:
    """The training logs a TRL script printed (their values as TRL prints them: text, 4 significant digits)."""
    return [ast.literal_eval(log) for log in re.findall(r"\{'loss': [^{}]*\}", stdout)]


def _eval_logs(stdout: str) -> list[dict]:
    """The evaluation logs a TRL script printed."""
    return [ast.literal_eval(log) for log in re.findall(r"\{'eval_loss': [^{}]*\}", stdout)]


def _assert_loads_without_the_plugin(*folders: Path) -> None:
    """The models the runs saved load and run in a process that never imports the plugin."""
    _start_loading_without_the_plugin(*folders)()


def _start_loading_without_the_plugin(*folders: Path) -> Callable[[], None]:
    """Start `_assert_loads_without_the_plugin`'s process; the returned call waits for it and asserts."""
    code = ("import sys, torch; from transformers import AutoModelForCausalLM\n"
            f"for folder in {[str(f) for f in folders]!r}:\n"
            "    model = AutoModelForCausalLM.from_pretrained(folder)\n"
            "    assert torch.isfinite(model(torch.tensor([[5, 6, 7, 8]])).logits).all(), folder\n"
            "assert not any(name.startswith('hf_sparse_cp') for name in sys.modules), 'the plugin was imported'\n")
    wait = _start([sys.executable, "-c", code], env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)

    def check() -> None:
        done = wait()
        assert done.returncode == 0, done.stderr[-3000:]

    return check
