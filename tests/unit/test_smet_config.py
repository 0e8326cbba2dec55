"""SMETConfig validation, `--smet_*` flags and config files."""

import re

import pytest
from transformers import HfArgumentParser

from hf_sparse_cp import SMETArguments, SparseAttentionFlags
from hf_sparse_cp.recipes import recipe_path
from hf_sparse_cp.smet import SMETConfig
from hf_sparse_cp.trainer.arguments import SparseCPArguments


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        ({"mode": "lottery"}, "use one of"),
        ({"density": 0.0}, "must be in (0, 1]"),
        ({"density": 1.5}, "must be in (0, 1]"),
        ({"block_size": 0}, "16 or 32 are usual"),
        ({"update_interval": 1}, "regrown blocks train before the next update"),
        ({"prune_rate": 1.2}, "must be in [0, 1]"),
        ({"regrowth": "magnitude"}, "use one of"),
        ({"regrow_warmup_steps": -1}, "0 turns it off"),
        ({"prune_decay_steps": 0}, "must be >= 1"),
        # the random choices hash the seed's low 32 bits: seed -1 drew as 2**32 - 1, 2**32 as 0
        ({"seed": -1}, "seed=-1 must be in [0, 4294967295]: the random choices hash 32 bits of it, so it would draw "
                       "as seed=4294967295 does"),
        ({"seed": 2**32}, "would draw as seed=0 does"),
        ({"target_modules": []}, "target_modules is empty"),
        ({"target_modules": [""]}, "target_modules is empty"),  # (it matched no module, refused at set-up only)
        # NaN or inf made the sparse weights' learning rate NaN or inf: every sparse weight NaN after one step
        ({"lr_density_exponent": float("nan")}, "lr_density_exponent=nan must be finite and >= 0"),
        ({"lr_density_exponent": float("inf")}, "lr_density_exponent=inf must be finite and >= 0"),
        # wrong types: refused by name with what to write, not a TypeError from a comparison
        ({"density": "high"}, "density='high' (str) is not valid: use a number, e.g. density=0.25"),
        ({"block_size": 16.0}, "block_size=16.0 (float) is not valid: use a whole number"),
        ({"local_bias_correction": "yes"}, "local_bias_correction='yes' (str) is not valid: use true or false"),
        ({"target_modules": ["q_proj", 1]}, "target_modules=['q_proj', 1] (list) is not valid: use a list of text"),
        ({"prune_decay_steps": "5"}, "prune_decay_steps='5' (str) is not valid: use a whole number or unset"),
        ({"regrowth": 1}, "regrowth=1 (int) is not valid: use one of 'random', 'gradient' or unset"),
    ],
)
def test_bad_values_name_the_fix(kwargs, fix):
    with pytest.raises(ValueError, match=re.escape(fix)):
        SMETConfig(**kwargs)


def test_defaults_and_derived_values():
    cfg = SMETConfig()
    assert cfg.mode == "sparse_weights" and cfg.regrowth_rule == "random"
    assert SMETConfig(mode="sparse_update").regrowth_rule == "gradient"
    assert cfg.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert SMETConfig(density=0.25, lr_density_exponent=1.0).lr_scale_at(0.25) == pytest.approx(4.0)
    assert SMETConfig(density=0.25, density_lr_scaling=False).lr_scale_at(0.25) == 1.0
    assert SMETConfig(target_modules="q_proj, v_proj").target_modules == ["q_proj", "v_proj"]


def test_flags_parse_next_to_the_trainer_and_plugin_arguments(tmp_path):
    # Imported after the plugin: from the repo root, transformers finds the top-level kernels/ folder as
    # the `kernels` package and imports it, which imports the plugin (a cycle if transformers comes first).
    from transformers import TrainingArguments

    parser = HfArgumentParser((TrainingArguments, SparseCPArguments, SparseAttentionFlags, SMETArguments))
    _, _, _, smet = parser.parse_args_into_dataclasses(args=[
        "--output_dir", str(tmp_path), "--smet", "--smet_mode", "sparse_update", "--smet_density", "0.05",
        "--smet_target_modules", "q_proj", "v_proj", "--no_smet_local_bias_correction", "--smet_regrowth", "random",
        "--sparse_block_size", "64",  # the attention pattern's block size is a different flag
    ])
    cfg = smet.to_config()
    assert smet.smet and cfg.mode == "sparse_update" and cfg.density == 0.05 and cfg.block_size == 16
    assert cfg.target_modules == ["q_proj", "v_proj"] and not cfg.local_bias_correction
    assert cfg.regrowth == "random"


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_config_file_with_flag_overrides(tmp_path, suffix):
    path = tmp_path / f"smet{suffix}"
    SMETConfig(density=0.1, update_interval=50, block_size=32).save(path)
    assert SMETConfig.from_file(path) == SMETConfig(density=0.1, update_interval=50, block_size=32)
    args = HfArgumentParser(SMETArguments).parse_args_into_dataclasses(
        args=["--smet", "--smet_config", str(path), "--smet_update_interval", "25"]
    )[0]
    cfg = args.to_config()
    assert (cfg.density, cfg.update_interval, cfg.block_size) == (0.1, 25, 32)


@pytest.mark.parametrize("flags, refused", [
    (["--smet_config", "smet.yaml"], "--smet_config smet.yaml given without --smet would be ignored: add --smet"),
    (["--smet_density", "0.1", "--smet_seed", "3"], "--smet_density, --smet_seed given without --smet would be "
                                                    "ignored: add --smet"),
])
def test_smet_settings_without_smet_are_refused(flags, refused):
    with pytest.raises(ValueError, match=re.escape(refused)):
        HfArgumentParser(SMETArguments).parse_args_into_dataclasses(args=flags)
    assert HfArgumentParser(SMETArguments).parse_args_into_dataclasses(args=["--smet", *flags])[0].smet
    assert not HfArgumentParser(SMETArguments).parse_args_into_dataclasses(args=[])[0].smet  # defaults: fine


@pytest.mark.parametrize("flags, refused", [
    (["--smet_density", "2"], "--smet_density=2.0 must be in (0, 1]"),
    (["--smet_update_interval", "-5"], "--smet_update_interval=-5 must be >= 2"),
    (["--smet_prune_rate_final", "1.5"], "--smet_prune_rate_final=1.5 must be in [0, 1]"),
    (["--smet_regrow_warmup_steps=-1"], "--smet_regrow_warmup_steps=-1 must be >= 0"),
    (["--smet_lr_density_exponent", "nan"], "--smet_lr_density_exponent=nan must be finite and >= 0"),
])
def test_bad_smet_flags_are_refused_when_parsed_naming_the_flag(tmp_path, flags, refused):
    """Not when the Trainer builds the optimizer, after the script built its model; a bad value in a --smet_config
    file names the file and the field, when the plugin's arguments read it (see test_launch)."""
    with pytest.raises(ValueError, match=re.escape(refused)):
        HfArgumentParser(SMETArguments).parse_args_into_dataclasses(args=["--smet", *flags])


def test_config_file_with_the_wrong_type_names_the_file_and_the_field(tmp_path):
    path = tmp_path / "smet.yaml"
    path.write_text("smet:\n  density: high\n")
    with pytest.raises(ValueError, match=r"smet.yaml': density='high' \(str\) is not valid: use a number"):
        SMETConfig.from_file(path)


def test_config_file_errors_list_the_known_keys(tmp_path):
    path = tmp_path / "smet.yaml"
    path.write_text("smet:\n  densty: 0.1\n")
    with pytest.raises(ValueError, match="known keys"):
        SMETConfig.from_file(path)
    with pytest.raises(FileNotFoundError):
        SMETConfig.from_file(tmp_path / "missing.yaml")


@pytest.mark.parametrize("recipe, mode", [("smet_pretrain", "sparse_weights"), ("smet_finetune", "sparse_update")])
def test_recipes_load(recipe, mode):
    (args,) = HfArgumentParser(SMETArguments).parse_yaml_file(str(recipe_path(recipe)))
    cfg = args.to_config()
    assert args.smet and cfg.mode == mode
    assert cfg.regrowth_rule == ("random" if mode == "sparse_weights" else "gradient")


def test_smet_flags_given_beat_the_file_whatever_their_value(tmp_path):
    from hf_sparse_cp.trainer.arguments import explicit_fields

    path = tmp_path / "smet.yaml"
    SMETConfig(density=0.1, update_interval=50, block_size=32).save(path)
    parser = HfArgumentParser(SMETArguments)
    argv = ["--smet", "--smet_config", str(path), "--smet_update_interval", "100", "--smet_density", "0.2"]
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    explicit = explicit_fields(parser, argv)
    assert explicit == {"smet", "smet_config", "smet_update_interval", "smet_density"}
    cfg = args.to_config(explicit)
    # 100 is the default update_interval: given on the command line, it still beats the file's 50
    assert (cfg.update_interval, cfg.density, cfg.block_size) == (100, 0.2, 32)
    legacy = args.to_config()  # without `explicit`: only flags that differ from the defaults
    assert (legacy.update_interval, legacy.density, legacy.block_size) == (50, 0.2, 32)


@pytest.mark.parametrize("flags", [["q_proj,v_proj"], ["q_proj, v_proj"], ["q_proj", "v_proj"], ["q_proj,", "v_proj"]])
def test_target_modules_flag_takes_comma_separated_names(flags):
    """`--smet_target_modules q_proj,v_proj` (the form the plugin's own messages suggest) parsed as ['q_proj,v_proj'],
    a name no module has: refused at set-up, and beside another name (`q_proj,v_proj down_proj`) silently left q_proj
    and v_proj dense."""
    (args,) = HfArgumentParser(SMETArguments).parse_args_into_dataclasses(args=["--smet", "--smet_target_modules",
                                                                                 *flags])
    assert args.to_config().target_modules == ["q_proj", "v_proj"]
    assert SMETConfig(target_modules=flags).target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize("kwargs", [{"lr": float("nan")}, {"eps": float("nan")}, {"weight_decay": float("nan")}])
def test_smet_adam_refuses_nan_hyperparameters_as_torch_adamw_does(kwargs):
    import torch

    from hf_sparse_cp.smet import SMETAdam

    params = [torch.nn.Parameter(torch.ones(2, 2))]
    with pytest.raises(ValueError):
        torch.optim.AdamW(params, **kwargs)
    with pytest.raises(ValueError, match="must be"):
        SMETAdam(params, **kwargs)
