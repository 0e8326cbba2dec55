"""How a launched run ends on a refusal (`hf_sparse_cp/launch/refusals.py`): the message once, exit status 2, a
launcher that only repeats it quiet, anything else left as it was."""

import logging

import pytest
import torch.distributed as dist

from hf_sparse_cp.launch.refusals import (
    REFUSED,
    REPORTS_ENV,
    counted_first,
    drops_refused_failure,
    end_refused,
    exit_refused,
    first_to_report,
    refused_run,
)
from hf_sparse_cp.run import script_name


def test_each_message_is_reported_by_the_first_rank_to_count_it():
    store = dist.HashStore()  # (what the ranks share: the default process group's store)
    assert counted_first(store, "a compute_loss_func under CP")
    assert not counted_first(store, "a compute_loss_func under CP")  # another rank, the same refusal: silent
    assert counted_first(store, "row 3 pads between its tokens")  # a refusal of other data: printed too
    assert not counted_first(store, "row 3 pads between its tokens")


def test_a_process_without_a_process_group_reports_its_refusal():
    assert not dist.is_initialized()
    assert first_to_report("anything")


def test_before_a_process_group_each_message_is_reported_once_per_launch_folder(tmp_path, monkeypatch, capsys):
    """A script's parser refuses a flag in every launched process alike, before any process group: the first of
    them to mark the message in the launcher's folder prints it."""
    monkeypatch.setenv(REPORTS_ENV, str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")  # (what the launcher sets in each: `launch_env`)
    for rank in range(2):  # (two processes of the launch, one after the other)
        with pytest.raises(SystemExit) as ended:
            exit_refused("usage: train.py [FLAGS]\ntrain.py: error: argument --cp_mode: invalid choice: 'foo'\n")
        assert ended.value.code == REFUSED
        assert capsys.readouterr().err == ("" if rank else "usage: train.py [FLAGS]\ntrain.py: error: argument "
                                           "--cp_mode: invalid choice: 'foo'\n")
    assert first_to_report("another message")  # (each different message once)
    monkeypatch.setenv(REPORTS_ENV, str(tmp_path / "gone"))
    assert first_to_report("another message") and first_to_report("another message")  # no folder: every time
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv(REPORTS_ENV, str(tmp_path))
    assert first_to_report("another message")  # a process alone reports whatever was marked


def test_a_refusal_ends_with_its_message_and_status_2(capsys):
    with pytest.raises(SystemExit) as ended:
        end_refused("train.py", ValueError("--cp_size 2 with DeepSpeed: shard with FSDP2 instead."))
    assert ended.value.code == REFUSED == 2
    assert capsys.readouterr().err == "train.py: error: --cp_size 2 with DeepSpeed: shard with FSDP2 instead.\n"


@pytest.mark.parametrize("exit_codes, marked, refused", [
    ([2], False, True),
    ([2, 2], False, True),  # every rank refused
    ([2, -15], False, True),  # one refused, the launcher stopped the other (SIGTERM)
    ([1], False, False),  # a crash
    ([2, 1], False, False),  # a refusal beside a crash: the crash's report stays
    ([-9], False, False),  # killed (out of memory): nothing refused
    ([-15, -15], False, False),
    # a rank refused and marked it, then aborted in its process group's teardown; the launcher stopped the other (seen
    # under load: the run ended with torchrun's traceback after the message)
    ([-15, -6], True, True),
    ([-15, 1], True, False),  # a crash beside it keeps its report
])
def test_a_run_ended_by_a_refusal_is_told_from_a_failure(exit_codes, marked, refused):
    assert refused_run(exit_codes, marked) is refused


def test_a_refusing_process_marks_it_in_the_launchers_folder_before_its_teardown(monkeypatch, tmp_path, capsys):
    from hf_sparse_cp.launch import refusals

    monkeypatch.setenv(refusals.REPORTS_ENV, str(tmp_path))
    with pytest.raises(SystemExit):
        end_refused("train.py", ValueError("refused, naming the fix"))
    assert (tmp_path / refusals.REFUSED_MARKER).is_file()


def test_a_script_goes_by_its_files_name_as_its_own_parser_names_it():
    assert script_name("/some/where/train.py", False) == "train.py"
    assert script_name("hf_sparse_cp.examples.train_long_context", True) == "train_long_context.py"


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
@pytest.mark.parametrize("status, ends_with", [(REFUSED, REFUSED), (1, None), (-9, None)])
def test_a_launcher_of_one_process_ends_a_refused_run_quietly(monkeypatch, launcher, status, ends_with):
    """accelerate launch runs a config of one process (`simple_launcher`) as a plain child and raises
    CalledProcessError on its exit status: a refusal (status 2) ends quietly with it, any other status keeps the
    launcher's exception."""
    import subprocess
    import types

    from hf_sparse_cp.launch import refusals

    def child_failed():
        raise subprocess.CalledProcessError(returncode=status, cmd=["python", "-m", "hf_sparse_cp.run", "train.py"])

    monkeypatch.setitem(refusals.LAUNCHERS, launcher, "fake_launcher")
    monkeypatch.setitem(__import__("sys").modules, "fake_launcher", types.SimpleNamespace(main=child_failed))
    monkeypatch.setattr("sys.argv", ["refusals.py"])
    if ends_with is None:
        with pytest.raises(subprocess.CalledProcessError):
            refusals.main([launcher, "--config_file", "one.yaml"])
    else:
        with pytest.raises(SystemExit) as ended:
            refusals.main([launcher, "--config_file", "one.yaml"])
        assert ended.value.code == ends_with


@pytest.mark.parametrize("error, marked", [
    (ValueError("a RoPE type whose frequencies depend on the longest position"), True),  # a refusal naming the fix
    (TypeError("forward() got an unexpected keyword argument 'cache_position'"), False),  # a bug: keeps its traceback
    (OSError("disk full"), False),
])
def test_only_the_refusals_of_cps_model_checks_are_the_users(monkeypatch, error, marked):
    """CP's start checks the model with a probe forward of the user's architecture: their refusals are ValueErrors
    naming the fix (a launched script ends with the message alone); a TypeError or OSError raised in there is a bug
    of the model's code or of the probe, which must keep its traceback (`hf_sparse_cp.run` ends marked errors only)."""
    import types

    from hf_sparse_cp.distributed import ParallelDims
    from hf_sparse_cp.trainer import context_parallel
    from hf_sparse_cp.trainer.arguments import is_flag_error

    def probe(model, **kwargs):
        raise error

    monkeypatch.setattr(ParallelDims, "from_accelerator", classmethod(lambda cls, *a, **k: types.SimpleNamespace(
        cp_size=2, world_size=2)))
    monkeypatch.setattr(context_parallel, "check_model_supports_context_parallel", probe)
    from transformers import Trainer

    trainer = Trainer.__new__(Trainer)  # (a Trainer as far as the entry point's type check goes; nothing else is read)
    trainer.accelerator, trainer.model = None, object()
    with pytest.raises(type(error)) as raised:
        context_parallel.enable_trainer_context_parallel(trainer)
    assert raised.value is error and is_flag_error(raised.value) is marked


@pytest.mark.parametrize("overrides, message", [
    (dict(model_type="gemma2", attn_logit_softcapping=50.0), "soft-caps attention logits"),
    (dict(model_type="llama", attention_dropout=0.1), "attention dropout"),
])
def test_a_model_the_kernels_cannot_compute_is_refused_as_the_users(overrides, message):
    """A model whose attention the sparse kernels do not compute (soft-capped logits, attention dropout) is refused
    when the plugin attaches, naming the fix, marked as the user's (a launched script ends with the message alone,
    not a traceback from every rank), and nothing of the switch stays on the model."""
    from transformers import AutoModelForCausalLM, TrainingArguments

    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.arguments import SparseCPArguments, is_flag_error
    from hf_sparse_cp.trainer.attach import enable_sparse_attention

    model_type = overrides.pop("model_type")
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=message) as raised:
        enable_sparse_attention(model, SparseCPArguments(sparse_attention=True), training_args=TrainingArguments("out"))
    assert is_flag_error(raised.value)
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("context_parallel", [False, True])
def test_an_encoder_is_refused_for_its_attention_with_a_fix_that_runs(context_parallel):
    """run_mlm.py's BERT (attention dropout 0.1, bidirectional) was refused for its dropout first, naming a fix (build
    it with dropout 0) after which it was refused again for its bidirectional attention; under CP every refusal named
    --sparse_attention false, which CP refuses in turn. The cause no setting fixes comes first, and under CP the fix
    drops --cp_size."""
    from transformers import BertConfig, BertForMaskedLM

    from hf_sparse_cp.integration.models import (
        check_model_supports_context_parallel,
        check_model_supports_sparse_attention,
    )

    model = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=32))
    fix = r"train it without context parallelism \(drop --cp_size\) and with its own attention: --sparse_attention " \
        if context_parallel else r"train it with its own attention: --sparse_attention false"
    check = check_model_supports_context_parallel if context_parallel else check_model_supports_sparse_attention
    with pytest.raises(ValueError, match=r"BertForMaskedLM has bidirectional attention layers.*" + fix):
        check(model)
    # (as the plugin's Trainer switches the model, before CP's own checks: `--cp_size 2` given)
    from hf_sparse_cp import SparseCPArguments, SparseTrainingArguments
    from hf_sparse_cp.trainer.attach import enable_sparse_attention

    args = SparseTrainingArguments("out", use_cpu=True, report_to=[], cp_size=2 if context_parallel else 1)
    with pytest.raises(ValueError, match=r"BertForMaskedLM has bidirectional attention layers.*" + fix):
        enable_sparse_attention(model, SparseCPArguments(), training_args=args)


def test_a_fix_named_under_cp_runs_under_cp():
    """Under CP, a soft-capping or attention-dropout refusal's dense fix says it runs without --cp_size (CP's ring
    needs the sparse backend: --sparse_attention false under CP is refused)."""
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.integration.models import check_model_supports_context_parallel
    from hf_sparse_cp.testing.tiny_models import tiny_config

    for overrides, message in ((dict(model_type="gemma2", attn_logit_softcapping=50.0), "soft-caps"),
                               (dict(model_type="llama", attention_dropout=0.1), "attention dropout")):
        model = AutoModelForCausalLM.from_config(tiny_config(overrides.pop("model_type"), **overrides))
        with pytest.raises(ValueError, match=message + r".*--sparse_attention false, without --cp_size"):
            check_model_supports_context_parallel(model)


def test_torchruns_line_on_a_refused_worker_is_dropped_and_any_other_kept():
    def record(msg, *args):
        return logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.ERROR, __file__, 1, msg,
                                 args, None)

    failed = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
    assert not drops_refused_failure(record(failed, 2, 0, 123, "python"))
    assert drops_refused_failure(record(failed, 1, 0, 123, "python"))  # a crash: its line stays
    assert drops_refused_failure(record("Sending process %s closing signal %s", 2, "SIGTERM"))


@pytest.mark.parametrize("use_cpu, fix", [
    (False, "pass --use_cpu"),
    (True, "Build the TrainingArguments inside that function"),
])
def test_processes_the_trainer_does_not_see_are_refused_naming_the_fix_that_applies(monkeypatch, use_cpu, fix):
    """accelerate's notebook_launcher forks processes from the notebook's: TrainingArguments built there, before the
    launch (as a notebook does in a cell of its own), set accelerate's state up for one process, which each forked
    process keeps, its Trainer seeing 1 of 2 processes. The check's message said 'pass --use_cpu', which the
    arguments already had (SparseTrainingArguments sets it on a machine without an accelerator); it now names
    building the arguments inside the launched function. Without use_cpu on a machine without one, --use_cpu."""
    import types

    import torch

    from hf_sparse_cp.trainer.attach import check_launch

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    trainer = types.SimpleNamespace(accelerator=types.SimpleNamespace(num_processes=1),
                                    args=types.SimpleNamespace(use_cpu=use_cpu))
    with pytest.raises(ValueError, match="2 processes were launched but the Trainer sees 1") as refused:
        check_launch(trainer)
    assert fix in str(refused.value)


def test_cp_in_a_lone_process_is_refused_as_the_users_before_the_model_is_switched(monkeypatch, tmp_path):
    """`python -m hf_sparse_cp.run --cp_size 2 script.py` for a script that builds its TrainingArguments in code (the
    flags before its path, which no parser of the script checks) ended in a traceback from the mesh's "needs several
    processes", after the model was switched: it is refused as the user's (the message alone, exit status 2), naming
    how to launch, before the model changes."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.arguments import is_flag_error

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    before = model.config._attn_implementation
    args = SparseTrainingArguments(str(tmp_path), sparse_attention=True, cp_size=2, use_cpu=True, report_to="none")
    rows = torch.zeros(2, 64, dtype=torch.long)
    with pytest.raises(ValueError, match="this one runs alone: launch it with") as refused:
        SparseTrainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows])
    assert is_flag_error(refused.value)
    assert "N: a multiple of 2; or train with cp_size 1 in one process" in str(refused.value)
    assert model.config._attn_implementation == before
