"""A training step that runs the model on the batch itself, outside the Trainer's prepared inputs (TRL's experimental
OnlineDPOTrainer; a script's own `training_step`), splits no sequence under CP: every rank computes the whole rows,
one process's result without CP's memory saving, while the run's start said each sequence was split. It is said, once
per trainer on the first process, naming the fix; a step through the Trainer's own compute_loss says nothing."""

import logging
import os
import tempfile

import torch

from hf_sparse_cp.testing.spawn import run_gloo

WARNING = "split no sequence in this training step"


def _run(rank: int, world: int) -> dict:
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments, attach_to_trainer
    from hf_sparse_cp.distributed import ContextParallelConfig
    from hf_sparse_cp.testing.tiny_models import tiny_config

    class OwnStep(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            model.train()
            loss = model(**inputs).loss
            self.accelerator.backward(loss)
            return loss.detach()

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    hf_sparse_cp.patch()
    rows = torch.randint(3, 97, (2, 64), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": r, "labels": r} for r in rows]
    said = {}
    for name, trainer_class in (("own step", OwnStep), ("stock step", Trainer)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("qwen2", vocab_size=97))
        hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=16, min_seq_len=32, vertical_topk=2,
                                                            slash_topk=2, local_window=16, sink_tokens=4, last_q=16))
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("hf_sparse_cp").addHandler(handler)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                args = TrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, per_device_train_batch_size=1,
                                         max_steps=2, save_strategy="no", optim="sgd")
                trainer = trainer_class(model=model, args=args, train_dataset=data)
                attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True),
                                  ContextParallelConfig(cp_size=world))
                trainer.train()
        finally:
            logging.getLogger("hf_sparse_cp").removeHandler(handler)
        said[name] = [r.getMessage() for r in records if WARNING in r.getMessage()]
    return said


def test_a_step_that_runs_the_model_outside_the_prepared_inputs_is_said_once_under_cp():
    """Said once per run: on the first process (each process's log shows under a launcher: it was said on every
    rank), once per trainer though both steps ran unsplit."""
    first, other = run_gloo(_run, 2, timeout_s=300)
    (message,) = first["own step"]
    assert "CP 2" in message and "OwnStep.training_step" in message and "Drop --cp_size" in message
    assert first["stock step"] == [] and other == {"own step": [], "stock step": []}
