"""A causal-LM fine-tuning script shaped like transformers' examples/pytorch/language-modeling/run_clm.py
(written for these tests, not a copy): its own ModelArguments and DataTrainingArguments (the sequence length is
`--block_size`), one HfArgumentParser with TrainingArguments, a text file tokenized and cut into blocks, the
stock Trainer; with --do_eval, run_clm.py's evaluation (the accuracy of the argmax predictions against the shifted
labels, through preprocess_logits_for_metrics and compute_metrics). It knows nothing of hf-sparse-cp: the tests run
it unchanged, directly and under `python -m hf_sparse_cp.run`."""

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain

import datasets
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "A pretrained model to start from."})
    model_type: str | None = field(default=None, metadata={"help": "A model family to train from scratch."})
    config_overrides: str | None = field(
        default=None, metadata={"help": "Config changes from scratch, e.g. n_embd=10,resid_pdrop=0.2."})
    config_name: str | None = field(default=None, metadata={"help": "A config, if not the model's."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "A tokenizer, if not the model's."})
    use_fast_tokenizer: bool = field(default=True, metadata={"help": "Use a fast tokenizer."})
    dtype: str | None = field(default=None, metadata={"help": "Load the model in this dtype.",
                                                      "choices": ["auto", "bfloat16", "float16", "float32"]})


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(default=None, metadata={"help": "A text file to train on."})
    validation_file: str | None = field(default=None, metadata={"help": "A text file to evaluate on (--do_eval)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep this many blocks at most."})
    block_size: int | None = field(default=None, metadata={"help": "Tokens per training block."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenizing."})
    keep_linebreaks: bool = field(default=True, metadata={"help": "Keep line breaks in text files."})


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", handlers=[
        logging.StreamHandler(sys.stdout)])
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    logger.info(f"Training parameters {training_args}")

    set_seed(training_args.seed)
    files = {"train": data_args.train_file}
    if training_args.do_eval:
        files["validation"] = data_args.validation_file
    raw = datasets.load_dataset("text", data_files=files, keep_linebreaks=data_args.keep_linebreaks)

    if model_args.config_name:
        config = AutoConfig.from_pretrained(model_args.config_name)
    elif model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    else:
        config = AutoConfig.for_model(model_args.model_type)
        if model_args.config_overrides is not None:
            config.update_from_string(model_args.config_overrides)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path,
                                              use_fast=model_args.use_fast_tokenizer)
    if model_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, config=config,
                                                     dtype=model_args.dtype)
    else:
        model = AutoModelForCausalLM.from_config(config)
        logger.info(f"Training a new model from scratch: {sum(p.numel() for p in model.parameters()):,} parameters")

    column = raw["train"].column_names[0]

    def tokenize(examples):
        return tokenizer(examples[column])

    with training_args.main_process_first(desc="tokenizing"):
        tokenized = raw.map(tokenize, batched=True, num_proc=data_args.preprocessing_num_workers,
                            remove_columns=raw["train"].column_names)

    block_size = data_args.block_size or min(tokenizer.model_max_length, 1024)

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = len(joined[next(iter(examples))]) // block_size * block_size
        blocks = {k: [t[i: i + block_size] for i in range(0, total, block_size)] for k, t in joined.items()}
        blocks["labels"] = blocks["input_ids"].copy()
        return blocks

    with training_args.main_process_first(desc="grouping texts"):
        lm_datasets = tokenized.map(group_texts, batched=True, num_proc=data_args.preprocessing_num_workers)
    train_dataset = lm_datasets["train"]
    if data_args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))

    eval_dataset = lm_datasets["validation"] if training_args.do_eval else None

    def preprocess_logits_for_metrics(logits, labels):
        if isinstance(logits, tuple):  # the model's other outputs (past_key_values)
            logits = logits[0]
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds):  # the accuracy of the next-token predictions
        preds, labels = eval_preds
        labels, preds = labels[:, 1:].reshape(-1), preds[:, :-1].reshape(-1)
        return {"accuracy": float((preds == labels).mean())}

    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                      processing_class=tokenizer, data_collator=default_data_collator,
                      compute_metrics=compute_metrics if training_args.do_eval else None,
                      preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None)
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    metrics = result.metrics
    metrics["train_samples"] = len(train_dataset)
    metrics["perplexity"] = math.exp(min(metrics["train_loss"], 50))
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        metrics["perplexity"] = math.exp(min(metrics["eval_loss"], 50))
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    trainer.create_model_card(finetuned_from=model_args.model_name_or_path, tasks="text-generation")


if __name__ == "__main__":
    main()
