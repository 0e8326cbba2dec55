"""A stock script whose setup the plugin refuses under context parallelism, launched as a user launches it (2 gloo CPU
processes through `hf-sparse-cp launch --nproc 2`, i.e. torchrun): it ends with the refusal's message, printed once,
exit status 2, and no traceback, whether refused as its parser reads its flags (a mistyped one), as the Trainer
starts (a compute_loss_func) or at the first batch (padding between a row's tokens); a bug of the script keeps its
traceback and torchrun's failure report."""

import subprocess
import textwrap

import pytest

from hf_sparse_cp.testing.spawn import launch_cli

SCRIPT = textwrap.dedent("""
    import os
    import torch
    from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments
    from hf_sparse_cp.testing.tiny_models import tiny_config

    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2))
    case = os.environ["REFUSAL_CASE"]
    if case == "unrouted":  # attention computed in its own layers, not through transformers' AttentionInterface (as
        # a trust_remote_code model's may be): sparse_cp cannot reach it
        from transformers import LlamaForCausalLM
        from transformers.models.llama.modeling_llama import LlamaAttention

        class OwnAttention(LlamaAttention):
            def forward(self, hidden_states, *args, **kwargs):
                return self.o_proj(self.q_proj(hidden_states)), None

        class OwnAttentionModel(LlamaForCausalLM):
            def __init__(self, config):
                super().__init__(config)
                for i, layer in enumerate(self.model.layers):
                    layer.self_attn = OwnAttention(config, i)

        model = OwnAttentionModel(model.config)
    ids = torch.arange(3, 67)
    # padding between the tokens of the row: CP takes it at a row's start or end only
    mask = torch.ones_like(ids) if case != "padding" else torch.cat([torch.ones(8), torch.zeros(4), torch.ones(52)])
    rows = [{"input_ids": ids, "attention_mask": mask.long(), "labels": ids}] * 4
    loss = (lambda outputs, labels, **kwargs: outputs.loss) if case == "loss" else None
    trainer = Trainer(model=model, args=args, train_dataset=rows, compute_loss_func=loss)
    if case == "bug":
        raise RuntimeError("a bug of the script")
    trainer.train()
""")


def _launch(tmp_path, case: str, *flags: str) -> subprocess.CompletedProcess:
    (tmp_path / "train.py").write_text(SCRIPT)
    argv = ["launch", "--nproc", "2", "train.py", "--output_dir", "out", "--max_steps", "2", "--report_to", "none",
            "--save_strategy", "no", "--cp_size", "2", *flags]
    return launch_cli(argv, cwd=tmp_path, env={"HF_HUB_OFFLINE": "1", "REFUSAL_CASE": case})


@pytest.mark.parametrize("case, flags, message", [
    ("loss", (), "train.py: error: a compute_loss_func (<lambda>) under context parallelism (CP 2) is not supported"),
    ("padding", (), "train.py: error: attention_mask pads between the tokens of row 0"),
    # (a model refused as the Trainer switches it to sparse_cp: it ended in a traceback from every rank, exit status 1)
    ("unrouted", (), "train.py: error: OwnAttentionModel (model type 'llama') does not route its attention through "
                     "transformers' AttentionInterface"),
    # (a Trainer flag the plugin refuses on this machine: it ended in a traceback from every rank)
    ("liger", ("--use_liger_kernel",), "train.py: error: --sparse_fused_ops liger (or --use_liger_kernel): "
                                       "liger-kernel's Triton kernels need a CUDA GPU"),
])
def test_a_refused_setup_ends_the_launched_run_with_its_message_once_and_no_traceback(tmp_path, case, flags, message):
    done = _launch(tmp_path, case, *flags)
    assert done.returncode == 2, done.stderr[-6000:]
    assert done.stderr.count(message) == 1, done.stderr[-6000:]
    assert "Traceback" not in done.stderr + done.stdout and "ChildFailedError" not in done.stderr, done.stderr[-6000:]
    assert "failed (exitcode: 2)" not in done.stderr, done.stderr[-6000:]  # (torchrun's line repeating the status)


def test_a_mistyped_plugin_flag_ends_the_launched_run_before_any_process_group_once_naming_the_flag(tmp_path):
    """Every process's parser refuses it alike, before the Trainer joins them in a group: the launcher's folder
    tells the first to print (`refusals.first_to_report`); it was a ValueError's traceback from every rank."""
    done = _launch(tmp_path, "loss", "--sparse_max_lenght", "300")
    assert done.returncode == 2, done.stderr[-6000:]
    assert done.stderr.count("did you mean --sparse_max_length for --sparse_max_lenght?") == 1, done.stderr[-6000:]
    assert "Traceback" not in done.stderr + done.stdout, done.stderr[-6000:]



OWN_PARSER_SCRIPT = textwrap.dedent("""
    import argparse
    from transformers import Trainer, TrainingArguments

    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir")
    print(parser.parse_args())
""")


@pytest.mark.parametrize("script, flag, close", [("stock", "--sparse_max_lenght", "--sparse_max_length"),
                                                 ("own_parser", "--cp_sizee", "--cp_size")])
def test_a_mistyped_plugin_flag_after_the_script_path_ends_the_launch_before_any_process_starts(
        tmp_path, script, flag, close):
    """Every process started and its parser refused the flag: a stock script's once (through the launcher's folder),
    a script's own argparse once per process without naming the close flag; torchrun's SIGTERM line came last. The
    launcher refuses it once, naming the close flag, before any process starts."""
    (tmp_path / "started").mkdir()
    marker = "import os; open(os.path.join('started', os.environ.get('RANK', '0')), 'w').close()\n"
    (tmp_path / "train.py").write_text(marker + (SCRIPT if script == "stock" else OWN_PARSER_SCRIPT))
    done = launch_cli(["launch", "--nproc", "2", "train.py", "--output_dir", "out", flag, "2"], cwd=tmp_path,
                      env={"HF_HUB_OFFLINE": "1", "REFUSAL_CASE": "none"})
    assert done.returncode == 2, done.stderr[-6000:]
    assert done.stderr.count(f"did you mean {close} for {flag}?") == 1, done.stderr[-6000:]
    assert done.stderr.endswith(f"hf-sparse-cp launch: error: {flag} after the script's path is not a plugin flag, nor "
                                f"one that train.py declares; did you mean {close} for {flag}?\n"), done.stderr[-6000:]
    assert not list((tmp_path / "started").iterdir()) and "Traceback" not in done.stderr, done.stderr[-6000:]

def test_a_bug_in_a_launched_script_keeps_its_traceback_and_the_launchers_report(tmp_path):
    done = _launch(tmp_path, "bug")
    assert done.returncode == 1, done.stderr[-6000:]
    assert "RuntimeError: a bug of the script" in done.stderr and "Traceback" in done.stderr
    assert "ChildFailedError" in done.stderr and "failed (exitcode: 1)" in done.stderr, done.stderr[-6000:]


def test_the_examples_refusal_under_launch_is_printed_once(tmp_path):
    """Issue #50: the long-context example's own refusals (a bad value, a mistyped flag) went through argparse's exit,
    so `hf-sparse-cp launch --nproc N examples/train_long_context.py` printed them once per process; they now go
    through the launcher's folder as a stock script's parser's do."""
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "train_long_context.py"
    # (a flag of the example's own: the launcher checks the plugin's flags after the script path itself)
    done = launch_cli(["launch", "--nproc", "2", str(example), "--pack_documents", "0"], cwd=tmp_path,
                      env={"HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2, done.stderr[-6000:]
    assert done.stderr.count("--pack_documents 0 must be >= 1") == 1, done.stderr[-6000:]
    assert "Traceback" not in done.stderr, done.stderr[-6000:]
