"""SMET in the stock Trainer: `--smet` flags, the optimizer factory, logging, save and resume."""

import pytest
import torch
from transformers import HfArgumentParser, Trainer, TrainingArguments, default_data_collator

from hf_sparse_cp import SMETArguments, SMETCallback, install_smet, uninstall_smet
from hf_sparse_cp.smet import SMETAdam, SMETConfig, unwrap_smet
from hf_sparse_cp.smet.masks import active_mask

from smet_common import TokenRows, markov_tokens, tiny_llama

FLAGS = [
    "--smet", "--smet_density", "0.5", "--smet_block_size", "8", "--smet_update_interval", "4",
    "--smet_regrowth", "gradient", "--smet_regrow_warmup_steps", "3",
]

pytestmark = pytest.mark.usefixtures("single_thread")


def _trainer(out_dir, max_steps=12, seed=0, save_steps=6, flags=FLAGS):
    parser = HfArgumentParser((TrainingArguments, SMETArguments))
    training, smet = parser.parse_args_into_dataclasses(args=[
        "--output_dir", str(out_dir), "--max_steps", str(max_steps), "--per_device_train_batch_size", "4",
        "--learning_rate", "5e-3", "--lr_scheduler_type", "cosine", "--warmup_steps", "2", "--logging_steps", "1",
        "--save_steps", str(save_steps), "--report_to", "none", "--use_cpu", "--seed", "0", "--max_grad_norm", "1.0",
        *flags,
    ])
    assert smet.smet
    trainer = Trainer(model=tiny_llama(seed=seed), args=training, train_dataset=TokenRows(markov_tokens(48, 32)),
                      data_collator=default_data_collator)
    install_smet(trainer, smet.to_config())
    return trainer, smet


def _losses(trainer):
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


def test_trainer_trains_with_smet_from_flags_and_logs_it(tmp_path):
    trainer, flags = _trainer(tmp_path)
    install_smet(trainer, flags.to_config())  # a second install replaces the first: one callback
    assert sum(isinstance(cb, SMETCallback) for cb in trainer.callback_handler.callbacks) == 1
    trainer.train()
    smet = unwrap_smet(trainer.optimizer)
    assert isinstance(smet, SMETAdam) and smet.config.density == 0.5 and smet.config.update_interval == 4
    assert smet.schedule_horizon == 12  # cosine prune-rate decay over the Trainer's max_steps
    lrs = {group["lr"] for group in smet.param_groups}
    assert lrs == {trainer.lr_scheduler.get_last_lr()[0]} and lrs != {5e-3}  # the scheduler drives SMET
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert logs[-1]["smet/topology_updates"] == 3 and logs[-1]["smet/density"] == 0.5
    assert logs[-1]["loss"] < logs[0]["loss"]
    for group in smet.param_groups:
        for param in group["params"] if group["smet"] else ():
            state = smet.state[param]
            inactive = ~active_mask(state["block_index"], param.shape[1] // 8)
            assert param.detach().view(param.shape[0], -1, 8)[inactive].abs().max() == 0


def test_a_run_shorter_than_the_update_interval_is_said_to_keep_its_first_blocks(tmp_path, caplog):
    """max_steps below update_interval (the default 100 in a short fine-tuning run) never moved the topology: the run
    trained its set-up blocks throughout (static sparsity) without a word."""
    import logging

    for max_steps, said in ((3, True), (4, False)):  # (update interval 4)
        trainer, _ = _trainer(tmp_path / str(max_steps), max_steps=max_steps, save_steps=max_steps)
        with caplog.at_level(logging.WARNING, logger="hf_sparse_cp.trainer"):
            caplog.clear()
            trainer.train()
        notes = [r.getMessage() for r in caplog.records if "will not change which blocks" in r.getMessage()]
        assert notes == ([
            "SMET will not change which blocks are active in this run: max_steps=3 is below --smet_update_interval 4 "
            "(prune and regrow every update_interval optimizer steps), so the blocks chosen at set-up train "
            "throughout. For dynamic sparse training pass a smaller --smet_update_interval (e.g. 2)."] if said else [])
        assert unwrap_smet(trainer.optimizer).topology_updates == (0 if said else 1)


def test_uninstall_restores_the_trainer(tmp_path):
    trainer, _ = _trainer(tmp_path)
    assert trainer.optimizer_cls_and_kwargs is not None
    uninstall_smet(trainer)
    assert trainer.optimizer_cls_and_kwargs is None
    assert not any(isinstance(cb, SMETCallback) for cb in trainer.callback_handler.callbacks)
    uninstall_smet(trainer)  # a no-op once uninstalled


def test_trainer_resume_continues_as_if_uninterrupted(tmp_path):
    full, _ = _trainer(tmp_path / "full")
    full.train()
    resumed, _ = _trainer(tmp_path / "resumed", seed=1)  # a different init: all must come from the checkpoint
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-6"))
    # The first 6 logged losses come back with the checkpoint's trainer state; steps 7-12 are new.
    assert len(_losses(full)) == 12 and _losses(resumed) == _losses(full)
    # what SMET logs too, its share of blocks replaced at the last update (step 4) at steps 7 and 8 among them
    logged = [[{k: v for k, v in log.items() if k.startswith("smet/")} for log in trainer.state.log_history
               if "loss" in log] for trainer in (full, resumed)]
    assert logged[1] == logged[0] and logged[0][6]["smet/replaced_fraction"] > 0
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_resuming_with_other_smet_settings_is_refused_by_name(tmp_path):
    first, _ = _trainer(tmp_path / "first", max_steps=1, save_steps=1)
    first.train()
    for change, named in [
        (["--smet_density", "0.25"], r"density=0\.5 \(this run: 0\.25\)"),
        (["--smet_block_size", "16"], r"block_size=8 \(this run: 16\)"),
    ]:
        other, _ = _trainer(tmp_path / "other", max_steps=2, flags=FLAGS + change)
        with pytest.raises(ValueError, match=named):
            other.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-1"))


def _trained_with_weight_decay(out_dir, model, smet: bool):
    args = TrainingArguments(output_dir=str(out_dir), max_steps=3, per_device_train_batch_size=2, learning_rate=5e-3,
                             weight_decay=0.1, max_grad_norm=0.5, report_to="none", use_cpu=True, seed=0,
                             save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=TokenRows(markov_tokens(6, 16)),
                      data_collator=default_data_collator)
    if smet:
        install_smet(trainer, SMETConfig(density=1.0, block_size=16, update_interval=2))
    trainer.train()
    return dict(trainer.model.named_parameters())


def test_smet_decays_the_parameters_the_trainer_s_adamw_decays(tmp_path):
    """`--smet` stands in for `--optim adamw_torch`, but decayed every parameter of 2+ dims and no other, where the
    Trainer decays what `get_decay_parameter_names` lists: GPT-OSS's attention sinks (1-D) were not decayed, its
    experts' biases (2-D) were. At density 1 SMET trains as the stock AdamW does (fp64)."""
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.testing.tiny_models import tiny_config

    def gpt_oss():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(tiny_config(
            "gpt_oss", vocab_size=64, hidden_size=64, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_hidden_layers=1, experts_implementation="eager")).double()

    stock = _trained_with_weight_decay(tmp_path / "stock", gpt_oss(), smet=False)
    ours = _trained_with_weight_decay(tmp_path / "smet", gpt_oss(), smet=True)
    assert any(name.endswith("sinks") for name in ours) and any(name.endswith("proj_bias") for name in ours)
    for name, param in stock.items():
        torch.testing.assert_close(ours[name], param, rtol=1e-10, atol=1e-12, msg=name)


def test_a_sparse_weight_the_decay_rule_leaves_out_is_trained_without_weight_decay():
    from hf_sparse_cp.smet import smet_param_groups

    model = tiny_llama()
    groups = smet_param_groups(model, SMETConfig(block_size=16), 0.1,
                               lambda m: [n for n, _ in m.named_parameters() if "q_proj" not in n])
    by_kind = {(g["smet"], g["weight_decay"]): set(g["param_names"]) for g in groups}
    assert set(by_kind) == {(True, 0.1), (True, 0.0), (False, 0.1)}
    assert all("q_proj" in n for n in by_kind[True, 0.0]) and len(by_kind[True, 0.0]) == 2
    assert "model.norm.weight" in by_kind[False, 0.1]  # (this rule decays it; the default one would not)


@pytest.mark.parametrize("optim", ["adafactor", "adamw_8bit"])
def test_an_optim_smet_does_not_stand_in_for_is_refused_by_its_name_when_the_arguments_parse(tmp_path, optim):
    """`--smet --optim adafactor` was refused naming `--optim OptimizerNames.ADAFACTOR`, once every process had built
    its data and model; `--optim adamw_8bit` without bitsandbytes asked to install it (ImportError), whose optimizer
    SMET would then refuse. Both are refused by the name typed: as the plugin's arguments parse, and by install_smet."""
    from hf_sparse_cp.trainer.arguments import is_flag_error
    from hf_sparse_cp.trainer.sparse_trainer import SparseTrainingArguments

    refused = rf"--optim {optim} with --smet: .* use --optim adamw_torch or adamw_torch_fused"
    with pytest.raises(ValueError, match=refused) as error:
        SparseTrainingArguments(output_dir=str(tmp_path), use_cpu=True, smet=True, optim=optim)
    assert is_flag_error(error.value)
    SparseTrainingArguments(output_dir=str(tmp_path), use_cpu=True, optim=optim)  # (without --smet: the Trainer's)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, optim=optim, report_to="none")
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=TokenRows(markov_tokens(4, 16)))
    with pytest.raises(ValueError, match=refused):
        install_smet(trainer, SMETConfig())
