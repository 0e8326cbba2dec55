"""A training script that builds its TrainingArguments in code, with its own Trainer subclass (written for these
tests): a small Llama-shaped model from a config, seeded random rows built in code (the same on every process),
output to a folder relative to the working directory, and no use_cpu (as written for a GPU). It knows nothing of
hf-sparse-cp. It writes what it saw
of how it was run (`__name__`, `__file__`, sys.argv, sys.path[0]) to run_record.json in its output folder."""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

OUTPUT_DIR = "out_in_code"


class LoggingTrainer(Trainer):
    """A script's own Trainer subclass: adds how many optimizer steps it took to every log."""

    def log(self, logs, *args, **kwargs):
        logs["own_subclass_steps"] = self.state.global_step
        super().log(logs, *args, **kwargs)


def main():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = AutoModelForCausalLM.from_config(config)
    rows = torch.randint(3, 260, (8, 256), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(output_dir=OUTPUT_DIR, max_steps=3, per_device_train_batch_size=1, learning_rate=1e-3,
                             logging_steps=1, report_to="none", save_strategy="no", seed=0,
                             train_sampling_strategy="sequential")
    trainer = LoggingTrainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows])
    trainer.train()
    trainer.save_model()
    trainer.save_state()
    if trainer.is_world_process_zero():
        record = {"name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd()}
        with open(os.path.join(OUTPUT_DIR, "run_record.json"), "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
