"""A supervised fine-tuning script shaped like TRL's trl/scripts/sft.py (written for these tests, not a copy):
TRL's imports inside the functions, `TrlParser` over ScriptArguments, SFTConfig and ModelConfig (a `--config`
YAML file allowed), the dataset named by `--dataset_name`, `SFTTrainer`. It knows nothing of hf-sparse-cp."""

import argparse


def main(script_args, training_args, model_args):
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=model_args.dtype,
                                                 attn_implementation=model_args.attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config,
                           streaming=script_args.dataset_streaming)
    trainer = SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    trainer.save_state()


def make_parser(subparsers: argparse._SubParsersAction | None = None):
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

    dataclass_types = (ScriptArguments, SFTConfig, ModelConfig)
    if subparsers is not None:
        return subparsers.add_parser("sft", help="Run the SFT training script", dataclass_types=dataclass_types)
    return TrlParser(dataclass_types)


if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args, model_args, _ = parser.parse_args_and_config(return_remaining_strings=True)
    main(script_args, training_args, model_args)
