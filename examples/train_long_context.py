"""Long-context fine-tuning with the stock `Trainer` and the sparse_cp attention backend.

Run with no arguments for the embedded default: a tiny Qwen2-shaped model (random init), a byte
tokenizer built in code, and synthetic passkey-retrieval data at 4K tokens, trained for a few steps
with dynamic vertical-slash sparse attention. Every flag of `TrainingArguments`,
`SparseCPArguments` and `SparseAttentionConfig` can be given to override the defaults, e.g.

    python examples/train_long_context.py --seq_len 8192 --max_steps 20 --slash_topk 512
    python examples/train_long_context.py --model_name_or_path Qwen/Qwen2.5-0.5B --sparse_config cfg.yaml
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.arguments import SparseCPArguments
from hf_sparse_cp.integration import attach_to_trainer, enable_sparse_attention
from hf_sparse_cp.passkey import passkey_dataset
from hf_sparse_cp.tiny_models import tiny_config
from hf_sparse_cp.tokenizer import byte_tokenizer


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Pretrained model to fine-tune; default: a tiny random-init model."}
    )
    tiny_model_type: str = field(default="qwen2", metadata={"help": "Family of the tiny default model."})
    tiny_num_layers: int = field(default=2, metadata={"help": "Decoder layers of the tiny default model."})
    seq_len: int = field(default=4096, metadata={"help": "Tokens per training sequence."})
    num_samples: int = field(default=32, metadata={"help": "Synthetic passkey sequences to generate."})


# The embedded default job; flags given by the user come later on the command line and win.
DEFAULT_ARGS = [
    "--output_dir", "outputs/train_long_context",
    "--max_steps", "6",
    "--per_device_train_batch_size", "1",
    "--learning_rate", "2e-3",
    "--lr_scheduler_type", "constant",
    "--logging_steps", "1",
    "--save_strategy", "no",
    "--report_to", "none",
    "--sparse_attention",
    "--block_size", "64",
    "--min_seq_len", "1024",
    "--vertical_topk", "64",
    "--slash_topk", "128",
    "--local_window", "64",
    "--sink_tokens", "16",
]


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = HfArgumentParser((ScriptArguments, TrainingArguments, SparseCPArguments, SparseAttentionConfig))
    argv = sys.argv[1:] if argv is None else argv
    script, training, sparse, pattern = parser.parse_args_into_dataclasses(args=DEFAULT_ARGS + list(argv))
    set_seed(training.seed)

    if script.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path, dtype=torch.bfloat16)
    else:
        tokenizer = byte_tokenizer()
        config = tiny_config(
            script.tiny_model_type, vocab_size=len(tokenizer), num_hidden_layers=script.tiny_num_layers
        )
        model = AutoModelForCausalLM.from_config(config)
    if sparse.sparse_attention:
        enable_sparse_attention(model, sparse, pattern, training, max_length=script.seq_len)

    train_data = passkey_dataset(tokenizer, script.num_samples, script.seq_len, seed=training.seed)
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=train_data,
        data_collator=default_data_collator,
        processing_class=tokenizer,
    )
    attach_to_trainer(trainer, sparse)
    result = trainer.train()

    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    kept = [log["sparse/kept_fraction"] for log in trainer.state.log_history if "sparse/kept_fraction" in log]
    summary = {
        "first_loss": losses[0] if losses else float("nan"),
        "final_loss": losses[-1] if losses else float("nan"),
        "train_loss": result.training_loss,
        "mean_kept_fraction": sum(kept) / len(kept) if kept else 1.0,
    }
    if trainer.is_world_process_zero():
        print(
            f"done: {trainer.state.global_step} steps at {script.seq_len} tokens | loss "
            f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f} | mean kept fraction "
            f"{summary['mean_kept_fraction']:.3f}"
        )
    return summary


if __name__ == "__main__":
    main()
