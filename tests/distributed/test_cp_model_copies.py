"""A model trained by `SparseTrainer` under CP 2 (with SMET, token tiles and NEFTune) pickles (`torch.save`) and
deep-copies, and the copy gives the trained model's logits in one process (issue #41 item 4: the CP
guard's hooks and the registration guard were local functions, which pickle refuses)."""

import copy
import io
import os
import tempfile

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser

from hf_sparse_cp.testing.spawn import run_gloo
from hf_sparse_cp.testing.tiny_models import tiny_config

FLAGS = ["--max_steps", "2", "--per_device_train_batch_size", "1", "--learning_rate", "1e-3", "--report_to", "none",
         "--use_cpu", "--save_strategy", "no", "--seed", "0", "--cp_size", "2", "--smet", "--smet_density", "0.5",
         "--sparse_token_tiling_min_length", "128", "--sparse_token_tile_size", "48", "--sparse_block_size", "32",
         "--sparse_min_seq_len", "128", "--sparse_vertical_topk", "8", "--sparse_slash_topk", "8",
         "--sparse_local_window", "32", "--sparse_sink_tokens", "4", "--sparse_last_q", "16",
         "--neftune_noise_alpha", "5"]


def _train_under_cp2_then_copy(rank: int, world: int) -> dict:
    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    rows = torch.randint(3, 259, (4, 256), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        (args,) = HfArgumentParser(SparseTrainingArguments).parse_args_into_dataclasses(["--output_dir", tmp, *FLAGS])
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("llama"))
        trainer = SparseTrainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows])
        trainer.train()
    buffer = io.BytesIO()
    torch.save(trainer.model, buffer)
    buffer.seek(0)
    copies = {"torch_save": torch.load(buffer, weights_only=False), "deepcopy": copy.deepcopy(trainer.model)}
    ids = rows[:1, :200]
    with torch.no_grad():  # one process: no CP shard in these calls
        want = trainer.model.eval()(ids).logits
        diffs = {name: float((m.eval()(ids).logits - want).abs().max()) for name, m in copies.items()}
    return {"diffs": diffs, "attn": {name: m.config._attn_implementation for name, m in copies.items()},
            "steps": trainer.state.global_step}


def test_a_model_trained_under_cp2_pickles_and_its_copy_gives_its_logits():
    for rank, result in enumerate(run_gloo(_train_under_cp2_then_copy, 2, timeout_s=600)):
        assert result["steps"] == 2, rank
        assert result["attn"] == {"torch_save": "sparse_cp", "deepcopy": "sparse_cp"}, rank
        for name, diff in result["diffs"].items():
            assert diff <= 1e-5, (rank, name, diff)
