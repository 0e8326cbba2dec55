"""Online CP switching (`hf_sparse_cp.trainer.curriculum`): the schedule and its validation (`stage_plan`), the
run-long batch sampler (`stage_data`), then 4 gloo processes training through CP 1 x DP 4 -> CP 2 x DP 2 (ring) -> CP 4
x DP 1 (hybrid: heads over 2 ranks x a ring of 2) in one Trainer run, compared with the same stages run as
three jobs chained through checkpoints (DDP; AdamW and SMET), and a resume from a checkpoint saved in the
middle stage; then FSDP2 over the 4 ranks (functional API) through CP and mode switches against one
process; and 2 processes through a CP switch, each step against one process on the samples it took, and on
inputs_embeds as on their token ids."""

import logging
import os
import re

import numpy as np
import pytest
import torch

from hf_sparse_cp.attention.budgets import Mass
from hf_sparse_cp.config import SparseAttentionConfig
from hf_sparse_cp.distributed import CP_SHARD_KWARG, ParallelDims, RingTopology
from hf_sparse_cp.trainer.checkpoints import MARKER, read_marker
from hf_sparse_cp.trainer.schedule import parse_schedule
from hf_sparse_cp.trainer.stage_data import StageBatchSampler, StageSamples, check_row_lengths
from hf_sparse_cp.trainer.stage_plan import build_schedule, check_schedule_flags

SCHEDULE = "0:128:1,2:256:2,4:512:4:vertical_topk=32:cp_mode=hybrid:cp_ulysses_size=2"
PATTERN = SparseAttentionConfig(block_size=64, min_seq_len=256, vertical_topk=16, slash_topk=32, local_window=32,
                                sink_tokens=4, last_q=32)


def test_parse_reads_steps_epochs_and_sparse_fields():
    stages = parse_schedule(SCHEDULE + ",1.5ep:512:2")
    assert [(s.from_step, s.from_epoch, s.seq_len, s.cp_size) for s in stages] == [
        (0, None, 128, 1), (2, None, 256, 2), (4, None, 512, 4), (None, 1.5, 512, 2)]
    assert stages[2].sparse == {"vertical_topk": 32}
    assert stages[2].cp == {"cp_mode": "hybrid", "cp_ulysses_size": 2} and stages[1].cp == {}
    assert ",".join(s.text for s in stages) == SCHEDULE + ",1.5ep:512:2"
    # a section's fields, nested as in a config file
    nested = parse_schedule("0:128:1,2:256:1:budget.mode=mass:budget.mass_target=0.5:scoring.last_q=16")
    assert nested[1].sparse == {"budget": {"mode": "mass", "mass_target": 0.5}, "scoring": {"last_q": 16}}
    assert nested[1].text == "2:256:1:budget.mode=mass:budget.mass_target=0.5:scoring.last_q=16"
    config = _build("0:128:1,2:256:1:budget.mode=mass:budget.mass_target=0.5:scoring.last_q=16", world=1).configs[1]
    assert (config.budget, config.scoring.last_q) == (Mass(mass_target=0.5), 16)


@pytest.mark.parametrize("text, match", [
    ("0:128", "FROM:SEQ_LEN:CP_SIZE"),
    ("0:128:1:vertical_topk", "FROM:SEQ_LEN:CP_SIZE"),
    ("x:128:1", "FROM must be a step"),
    # an epoch no step reaches: was accepted, then 'cannot convert float NaN to integer' from every launched rank
    ("0:128:1,nanep:256:2", "a stage starts at step or epoch nan: use a finite value >= 0"),
    ("0:128:1,infep:256:2", "a stage starts at step or epoch inf: use a finite value >= 0"),
    # which stage, in a schedule of several (the message named none)
    ("0:128:1,2:256:0", r"cp_schedule stage '2:256:0': SEQ_LEN 256 and CP_SIZE 0 must both be >= 1, e.g. '0:4096:1'"),
    ("0:128:1,-2:256:2", r"cp_schedule stage '-2:256:2': a stage starts at step or epoch -2"),
    ("", "empty"),
    (" , ", "cp_schedule is empty: give at least one stage"),
    # a stray comma: the empty stage was skipped, the schedule taken as if it were not there
    ("0:128:1,,2:256:2", r"cp_schedule '0:128:1,,2:256:2': stage 2 of 3 is empty \(two commas in a row, or one at an "
                         r"end\): remove the stray comma, or give the stage there"),
    ("0:128:1,2:256:2,", r"stage 3 of 3 is empty"),
    (",0:128:1", r"stage 1 of 2 is empty"),
    # a field given twice in one stage: the last value was taken silently
    ("0:128:1,2:256:2:vertical_topk=4:vertical_topk=8", r"'2:256:2:vertical_topk=4:vertical_topk=8' gives "
                                                        r"vertical_topk more than once: give each field once"),
    ("0:128:2:cp_mode=ring:budget.mode=mass:cp_mode=ulysses:budget.mode=topk",
     "gives budget.mode, cp_mode more than once"),
])
def test_malformed_schedules_are_refused(text, match):
    with pytest.raises(ValueError, match=match):
        parse_schedule(text)


def _build(text, world=4, max_steps=6, **kw):
    return build_schedule(parse_schedule(text), world_size=world, sparse_config=PATTERN, max_steps=max_steps, **kw)


@pytest.mark.parametrize("text, match", [
    ("0:128:1,2:384:3", r"stage 1 \(2:384:3\): cp_size=3 does not divide the world size 4.*divides it \(1, 2 or 4\)"),
    ("0:128:1,2:320:2", r"seq_len=320 does not split into whole blocks of 64 tokens over 2 CP ranks.*256 or 384"),
    ("0:128:1,2:256:2:vertical_top=4", r"\['vertical_top'\] are not sparse-pattern fields .* or CP fields"),
    # a layer's fields: the run's config file sets them for every stage
    ("0:128:1,2:256:2:layer_overrides.1.vertical_topk=8", r"stage 1 \(2:256:2:layer_overrides.1.vertical_topk=8\): a "
     r"stage cannot set layer_overrides: give them in the run's --sparse_config file, where they hold for every stage "
     r"\(a stage's fields reach the layers whose overrides do not set them\)\."),
    # a bare `mode`: the budget's (budget_mode=, budget.mode=), named; SMET's is the run's --smet_mode
    ("0:128:1,2:256:2:mode=mass", r"\['mode'\] are not sparse-pattern fields .*: the budget's mode is budget_mode=mass "
                                  r"\(or budget.mode=mass\); SMET's, --smet_mode, holds for the whole run\."),
    ("0:128:1,2:256:2:block_size=48", "power of two"),
    ("1:128:1", "must start at 0"),
    ("0:128:1,2:256:2,2:512:4", "not after stage 1"),
    ("0:128:1,6:256:2", "at or after --max_steps 6"),
    ("0:128:1,1ep:256:2", "needs a dataset with a length"),
    # a section's unknown key, listing the known ones; one field given twice in one stage
    ("0:128:1:budget.bogus=1", r"stage 0 \(0:128:1:budget.bogus=1\): Unknown budget key 'bogus'; the budget "
                               r"section's keys: \['mode', "),
    ("0:128:1:scoring.last_qq=1", r"Unknown scoring key 'last_qq' \(did you mean 'last_q'\?\); the scoring section's "
                                  r"keys: \['last_q', "),
    ("0:128:1:mass_threshold=0.01:budget.mass_threshold=0.02", r"mass_threshold=0.01 and "
                                                               r"budget.mass_threshold=0.02 give one field two values"),
])
def test_invalid_schedules_name_the_fix(text, match):
    with pytest.raises(ValueError, match=match):
        _build(text)


# A refusal of the configs' own checks that a stage's field triggers spelled the setting and its fix in Python's repr
# (pattern='vertical_slash') or as a flag (--cp_mode hybrid), neither of which the stage syntax takes: one case per
# check, each named as the stage writes fields.
@pytest.mark.parametrize("stage, refused", [
    ("2:256:2:estimation_chunk=128", "only a layer with pattern=vertical_slash and estimation=causal_chunks reads it, "
                                     "and no layer of this stage has them all (estimation=last_queries): drop it, or "
                                     "add estimation=causal_chunks."),
    ("2:256:1:estimation=causal_chunks:estimation_chunk=256", "with estimation=causal_chunks the first chunk of a "
                                                              "document is dense, so every layer would run dense (kept "
                                                              "fraction 1.0). Use an estimation_chunk below 256 (a "
                                                              "multiple of block_size=64, e.g. 128), or "
                                                              "estimation=last_queries."),  # (check_sparse_at)
    ("2:256:1:estimation=causal_chunks:estimation_chunk=100", "estimation_chunk=100 must be a positive multiple of "
                                                              "block_size=64"),
    ("2:256:1:block_size=48", "block_size=48 must be a power of two >= 16; use 64 or 128."),
    ("2:256:1:pattern=sparse", "pattern=sparse (str) is not valid: use one of vertical_slash, dense."),
    ("2:256:1:block_size=abc", "block_size=abc (str) is not valid: use a whole number, e.g. block_size=128"),
    ("2:256:1:budget_mode=greedy", "budget_mode=greedy (str) is not valid: use one of topk, topp, mass (a mode of "
     "your own: @hf_sparse_cp.config.sections.register_budget on its class first)."),
    ("2:256:1:mass_threshold=0.01", "mass_threshold=0.01 is read only in budget_mode=mass and would do nothing with "
                                    "budget_mode=topk; pass budget_mode=mass with it"),
    ("2:256:1:budget.mode=mass:budget_mode=topp", "budget_mode=topp and budget.mode=mass give one field two values"),
    ("2:256:1:budget_mode=topk:budget.mass_threshold=0.1",
     "budget_mode=topk and a budget section holding mass_threshold (read only in budget_mode=mass): the section's "
     "field would be dropped. Give the mode once, in the section (budget.mode=mass) with its own fields"),
    ("2:256:2:cp_sharding=random", "cp_sharding=random (str) is not valid: use one of striped, zigzag, contiguous, "
                                   "document."),
    ("2:256:2:cp_mode=hybrid", "cp_mode=hybrid needs cp_ulysses_size: "),
    ("2:256:2:cp_ulysses_size=2", "cp_ulysses_size=2 is the head-group size of cp_mode=hybrid; under cp_mode=ring it "
                                  "would be ignored: drop it, or use cp_mode=hybrid."),
    ("2:256:2:cp_mode=ulysses:cp_ring=hierarchical", "cp_ring=hierarchical would be ignored under cp_mode=ulysses"),
    ("2:256:2:cp_mode=ulysses:cp_sharding=zigzag", "cp_sharding=zigzag would be ignored under cp_mode=ulysses"),
    ("2:256:2:cp_mode=hybrid:cp_ulysses_size=2:cp_sharding=document", "cp_sharding=document is not available under "
                                                                      "cp_mode=hybrid"),
    # zigzag gives each rank a head and a tail chunk of whole blocks: 256 over 4 ranks of 64-token blocks was padded to
    # 512, silently (hybrid's ring too)
    ("2:256:4:cp_sharding=zigzag", "seq_len=256 does not split into zigzag's head and tail chunks of whole 64-token "
                                   "blocks on each of 4 CP ranks (a multiple of 512 does): every sequence would be "
                                   "padded to 512 tokens. Use seq_len=512, cp_sharding=striped"),
    ("2:384:2:cp_mode=hybrid:cp_ulysses_size=2:cp_sharding=zigzag", "(a multiple of 256 does)"),
])
def test_a_stages_refusal_spells_the_fix_as_the_stage_writes_fields(stage, refused):
    schedule = f"0:128:1,{stage}"
    with pytest.raises(ValueError) as error:
        check_schedule_flags(schedule, PATTERN, max_steps=6)  # (the stage's pattern and CP layout, as flags parse)
        _build(schedule)  # (the pattern at the stage's length)
    message = str(error.value)
    assert message.startswith(f"cp_schedule stage 1 ({stage}): ") and refused in message, message
    assert not re.search(r"\w='|--(?:cp|sparse)_\w+(?:\)| (?!stage))", message), message  # (no repr, no flag)


def test_the_runs_zigzag_sharding_checks_every_stages_length():
    """--cp_sharding zigzag for the run reaches each stage that does not set its own: a stage of 256 tokens over 4
    ranks of 64-token blocks is refused (each rank needs a head and a tail chunk), one that sets striped is not, and
    CP 1 stages shard nothing."""
    from hf_sparse_cp.distributed import ContextParallelConfig

    zigzag = ContextParallelConfig(cp_sharding="zigzag")
    with pytest.raises(ValueError, match=r"stage 1 \(2:256:4\): seq_len=256 does not split into zigzag's head and "
                                         r"tail chunks.*a multiple of 512"):
        check_schedule_flags("0:128:1,2:256:4", PATTERN, max_steps=6, cp_config=zigzag)
    check_schedule_flags("0:128:1,2:256:4:cp_sharding=striped,4:512:4", PATTERN, max_steps=6, cp_config=zigzag)


@pytest.mark.parametrize("schedule", ["0:128:1", "0:256:1,1ep:128:1"], ids=["steps", "epochs"])
def test_a_schedule_needs_max_steps_and_says_so_for_epoch_starts_too(schedule):
    with pytest.raises(ValueError, match="whether its stages start at steps or epochs .* set --max_steps"):
        _build(schedule, max_steps=-1)


def test_a_stages_layout_refused_for_the_model_spells_the_fix_as_the_stage_writes_fields():
    """As `enable_curriculum` checks each stage's CP layout against the model: its head split's fix named flags."""
    from types import SimpleNamespace

    from hf_sparse_cp.distributed import ContextParallelConfig

    stage = parse_schedule("0:128:1,2:256:4:cp_mode=ulysses")[1]
    with pytest.raises(ValueError) as error, stage.refusals(1):
        stage.cp_config(ContextParallelConfig()).check_model(SimpleNamespace(num_attention_heads=2,
                                                                             num_key_value_heads=2))
    message = str(error.value)
    assert message.startswith("cp_schedule stage 1 (2:256:4:cp_mode=ulysses): a head-parallel degree of 4 needs at "
                              "least 4 query heads"), message
    assert "cp_mode=hybrid with cp_ulysses_size among those and the ring over the rest of the CP degree, or " \
           "cp_mode=ring (no head parallelism" in message, message


@pytest.mark.parametrize("flags, match", [
    (dict(cp_schedule="0:256:1,4:512:2"), r"last stage starts at step 4, at or after --max_steps 4"),
    (dict(cp_schedule="0:256:1,2:500:2"), r"stage 1 \(2:500:2\): seq_len=500 does not split into whole blocks of 32 "
                                          r"tokens over 2 CP ranks .*use seq_len=448 or 512"),
    (dict(cp_schedule="0:256:1,2:512:2:vertical_top=4"), r"\['vertical_top'\] are not sparse-pattern fields"),
    # SMET's settings (typed as their flags or their fields) hold for the run: the refusal named pattern fields alone
    (dict(cp_schedule="0:256:1,2:512:2:smet_density=0.25:update_interval=4"), re.escape(
        "stage 1 (2:512:2:smet_density=0.25:update_interval=4): ['smet_density', 'update_interval'] are SMET "
        "settings, which hold for the whole run (a stage changes the sequence length, the CP layout and the "
        "sparse-attention pattern only): drop them from the stage and set them for the run (--smet_density 0.25 "
        "--smet_update_interval 4).")),
    # a stage's CP fields, alone or with the run's CP flags (they were refused only once the processes had built
    # their data and model)
    (dict(cp_schedule="0:256:1,2:512:2:cp_mode=bogus"), r"stage 1 \(2:512:2:cp_mode=bogus\): cp_mode=bogus \(str\) "
                                                            r"is not valid: use one of ring, ulysses, hybrid"),
    (dict(cp_schedule="0:256:1,2:512:2:cp_mode=ulysses:cp_sharding=zigzag"),
     r"stage 1 .*cp_sharding=zigzag would be ignored under cp_mode=ulysses"),
    (dict(cp_schedule="0:256:1,2:512:2:cp_mode=hybrid"), r"stage 1 .*cp_mode=hybrid needs cp_ulysses_size"),
    # with an epoch start (the data resolve it) what the other starts decide: they were refused only once every
    # process had built its data and model
    (dict(cp_schedule="0:256:1,1ep:512:2,0.5ep:512:1"), re.escape(
        "cp_schedule stage 2 (0.5ep:512:1) starts at epoch 0.5, not after stage 1 (epoch 1): order the stages")),
    (dict(cp_schedule="0:256:1,3:512:2,1ep:512:1,2:256:1"), re.escape(
        "cp_schedule stage 3 (2:256:1) starts at step 2, not after stage 1 (step 3): order the stages")),
    (dict(cp_schedule="0:256:1,0ep:512:2"), re.escape("stage 1 (0ep:512:2) starts at epoch 0, not after stage 0")),
    (dict(cp_schedule="0.5ep:256:1,1ep:512:2"), re.escape("first stage (0.5ep:256:1) must start at 0 (or 0ep)")),
    (dict(cp_schedule="0:256:1,1ep:512:2,4:512:1"), r"last stage starts at step 4, at or after --max_steps 4"),
])
def test_what_the_flags_alone_decide_is_refused_when_they_parse(tmp_path, flags, match):
    """`hf-sparse-cp train --nproc 2 --cp_schedule 0:256:1,4:512:2 --max_steps 4` started both processes, which
    each refused it once they had built their data and model; the arguments refuse it as they parse."""
    from hf_sparse_cp.trainer.sparse_trainer import SparseTrainingArguments

    with pytest.raises(ValueError, match=match):
        SparseTrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=4, sparse_block_size=32, **flags)
    # what the world size, the model or the data decide waits for them: CP 4 on 2 processes, an epoch start
    for schedule in ("0:256:1,1ep:512:4", "0:256:1,3:512:4,1ep:512:1"):
        SparseTrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=4, cp_schedule=schedule)


def test_epoch_starts_resolve_to_the_step_that_completes_them():
    # 16 samples; stage 0 takes 4 per step (DP 4), stage 1 takes 2 (DP 2)
    schedule = _build("0:128:1,1ep:256:2,1.75ep:512:4", max_steps=20, samples_per_step=[4, 2, 1], num_samples=16)
    assert schedule.starts == (0, 4, 10)  # 16 samples after 4 steps; 12 more (28 = 1.75 x 16) after 6
    assert schedule.configs[0].block_size == 64 and [schedule.index_at(s) for s in (0, 3, 4, 9, 10, 19)] == [
        0, 0, 1, 1, 2, 2]


def test_an_epoch_start_refused_says_the_step_it_resolved_to():
    """An epoch start that the data resolve into a step past --max_steps, or not after the stage before, was refused
    naming only that step ('the last stage starts at step 25', for a schedule that wrote 5ep): the refusal now says
    which stage's epoch start it is and how it resolved."""
    resolved = "Stage 1 (5ep:256:1) starts at step 25, the first by which 5 passes over the 10 samples are taken."
    with pytest.raises(ValueError, match=re.escape("at or after --max_steps 6: raise --max_steps above 25 or start "
                                                   f"the stage earlier. {resolved}")):
        _build("0:128:1,5ep:256:1", world=1, samples_per_step=[2, 2], num_samples=10)
    resolved = "Stage 1 (0.5ep:256:1) starts at step 3, the first by which 0.5 passes over the 10 samples are taken."
    with pytest.raises(ValueError, match=re.escape("stage 2 (2:256:1) starts at step 2, not after stage 1 (step 3): "
                                                   f"order the stages by their start. {resolved}")):
        _build("0:128:1,0.5ep:256:1,2:256:1", world=1, samples_per_step=[2, 2, 2], num_samples=10)


def _dims(world: int, rank: int, cp: int) -> ParallelDims:
    group = tuple(range(rank // cp * cp, rank // cp * cp + cp))
    return ParallelDims(world_size=world, rank=rank, cp_ranks=group, cp_group=None, topology=RingTopology(1, cp),
                        inner_group=None, outer_group=None, sharding="striped")


@pytest.mark.parametrize("seed", [None, 7], ids=["sequential", "shuffled"])
def test_the_sampler_takes_every_sample_once_per_pass_across_stages(seed):
    world, grad_accum, batch, n = 4, 2, 1, 20
    schedule = _build(SCHEDULE, max_steps=6)
    per_rank = []
    for rank in range(world):
        dims = [_dims(world, rank, stage.cp_size) for stage in schedule.stages]  # the layout of every stage
        sampler = StageBatchSampler(schedule, dims, num_samples=n, batch_size=batch, grad_accum=grad_accum,
                                    max_steps=6, seed=seed)
        per_rank.append(list(sampler))
        assert len(per_rank[-1]) == len(sampler) == 6 * grad_accum
    taken = []
    for step in range(6):
        cp = schedule.stages[schedule.index_at(step)].cp_size
        for micro in range(grad_accum):
            rows = [per_rank[r][step * grad_accum + micro] for r in range(world)]
            # the ranks of a CP group share their batch; the DP ranks take distinct ones, at the stage's length
            for r in range(world):
                assert rows[r] == rows[r // cp * cp]
                assert all(length == schedule.stages[schedule.index_at(step)].seq_len for _, length in rows[r])
            taken += [i for r in range(0, world, cp) for i, _ in rows[r]]
    assert len(taken) == 2 * 2 * 4 + 2 * 2 * 2 + 2 * 2 * 1 == 28  # 20 samples, then 8 of the second pass
    assert sorted(taken[:n]) == list(range(n)) and len(set(taken[n:])) == len(taken) - n
    assert (taken[:n] == list(range(n))) == (seed is None)


def test_the_sampler_begins_at_the_step_it_is_given_from_the_first_sample():
    """A resume that replays no batches (`ignore_data_skip`) iterates the sampler at its step: the batches are that
    step's stage's, the samples from the first on."""
    schedule = _build(SCHEDULE, max_steps=6)
    dims = [_dims(4, 1, stage.cp_size) for stage in schedule.stages]
    sampler = StageBatchSampler(schedule, dims, num_samples=20, batch_size=1, grad_accum=2, max_steps=6, seed=None,
                                first_step=lambda: 3)
    # step 3: CP 2 x DP 2, rank 1 is DP rank 0 (micro-batches 0 and 2 of 4); steps 4-5: CP 4 x DP 1
    assert list(sampler) == [[(0, 256)], [(2, 256)], [(4, 512)], [(5, 512)], [(6, 512)], [(7, 512)]]


def test_stage_samples_crop_every_token_field():
    data = [{"input_ids": torch.arange(10), "labels": list(range(10)), "source": "doc", "weights": torch.ones(3)}]
    item = StageSamples(data)[(0, 4)]
    assert item["input_ids"].tolist() == item["labels"] == [0, 1, 2, 3]
    assert item["source"] == "doc" and item["weights"].shape == (3,)
    # numpy arrays (a datasets.Dataset in numpy format) too: they were kept whole, and the stage then refused its
    # rows as packed ('the data collator turns 1 samples of up to 4 tokens into longer rows')
    data = [{"input_ids": np.arange(10), "attention_mask": np.ones(10, dtype=np.int64), "weights": np.ones(3),
             "score": np.float32(1.0)}]
    item = StageSamples(data)[(0, 4)]
    assert item["input_ids"].tolist() == [0, 1, 2, 3] and item["attention_mask"].shape == (4,)
    assert item["weights"].shape == (3,) and item["score"] == 1.0


@pytest.mark.parametrize("form", [list, torch.tensor, np.array])
def test_stage_samples_crop_a_packed_row_s_document_lengths(form):
    """TRL's packed rows keep their documents' lengths (`seq_lengths`), from which its collator builds the position_ids:
    kept whole, they described more tokens than the cropped row held."""
    data = [{"input_ids": torch.arange(10), "seq_lengths": form([3, 4, 3])}]
    for seq_len, lengths in ((2, [2]), (3, [3]), (5, [3, 2]), (7, [3, 4]), (10, [3, 4, 3])):
        item = StageSamples(data)[(0, seq_len)]
        assert item["input_ids"].tolist() == list(range(seq_len))
        assert type(item["seq_lengths"]) is type(data[0]["seq_lengths"]) and list(item["seq_lengths"]) == lengths
    # (lengths that do not add up to the row's tokens are not its documents': kept as they are)
    assert StageSamples([{"input_ids": torch.arange(10), "seq_lengths": [3, 4]}])[(0, 5)]["seq_lengths"] == [3, 4]


def test_stage_samples_of_embeddings_crop_them_and_every_token_field():
    """A script passing inputs_embeds in place of input_ids (a vision-language model's merged embeddings): before,
    every stage raised KeyError: 'input_ids' when the run began."""
    data = [{"inputs_embeds": torch.randn(10, 8), "labels": torch.arange(10), "weights": torch.ones(3)}]
    item = StageSamples(data)[(0, 4)]
    assert item["inputs_embeds"].shape == (4, 8) and torch.equal(item["inputs_embeds"], data[0]["inputs_embeds"][:4])
    assert item["labels"].tolist() == [0, 1, 2, 3] and item["weights"].shape == (3,)
    with pytest.raises(ValueError, match="neither input_ids nor inputs_embeds to measure it by"):
        StageSamples([{"labels": torch.arange(10)}])[(0, 4)]


def test_a_stage_longer_than_samples_of_embeddings_is_refused_naming_their_length():
    data = [{"inputs_embeds": torch.randn(192, 4), "labels": torch.arange(192)}] * 2
    collate = lambda rows: {key: torch.stack([r[key] for r in rows]) for key in rows[0]}  # noqa: E731
    check_row_lengths(_build("0:128:1,1:192:1", world=1, max_steps=2), data, collate, 2)
    with pytest.raises(ValueError, match=re.escape("stage 1 (1:256:1) would train rows of 192 tokens, not 256: the "
                                                   "samples hold 192 tokens")):
        check_row_lengths(_build("0:128:1,1:256:1", world=1, max_steps=2), data, collate, 2)


# ---- 4 gloo processes through the Trainer ----

NUM_SAMPLES, SAMPLE_LEN, MAX_STEPS = 16, 512, 6


def _samples() -> list[dict]:
    """A 24-token motif repeated from a random phase in every sample: learnable in a few steps."""
    g = torch.Generator().manual_seed(0)
    motif = torch.randint(3, 259, (24,), generator=g)
    phases = torch.randint(0, 24, (NUM_SAMPLES, 1), generator=g)
    ids = motif[(torch.arange(SAMPLE_LEN) + phases) % 24]
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _args(out: str, smet: bool, **kw):
    from hf_sparse_cp.trainer.sparse_trainer import SparseTrainingArguments

    fields = dict(
        output_dir=out, report_to="none", use_cpu=True, max_steps=MAX_STEPS, per_device_train_batch_size=1,
        learning_rate=1e-2, weight_decay=0.0, train_sampling_strategy="sequential", logging_steps=1,
        save_strategy="no", sparse_block_size=PATTERN.block_size, sparse_min_seq_len=PATTERN.min_seq_len,
        sparse_vertical_topk=PATTERN.budget.vertical_topk, sparse_slash_topk=PATTERN.budget.slash_topk,
        sparse_local_window=PATTERN.local_window, sparse_sink_tokens=PATTERN.sink_tokens,
        sparse_last_q=PATTERN.scoring.last_q,
        sparse_log_sparsity=False, seed=0)
    if smet:
        fields.update(smet=True, smet_density=0.5, smet_update_interval=2)
    return SparseTrainingArguments(**{**fields, **kw})


def _train(args, data, resume=None, stop_at=None) -> tuple[list, dict]:
    """Train a fresh tiny Llama; the loss of every step (rank 0's log) and the final weights."""
    from transformers import AutoModelForCausalLM, TrainerCallback, default_data_collator

    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.sparse_trainer import SparseTrainer

    losses = {}

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in (logs or {}):
                losses[state.global_step] = logs["loss"]

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == stop_at:  # a job of the chain ends its stage with a checkpoint
                control.should_save = control.should_training_stop = True

    def seen(module, args, kwargs):  # what each training forward gets: tokens, CP degree and mode, the top-k
        shard = kwargs.get(CP_SHARD_KWARG)
        forwards.append((kwargs["input_ids"].shape[1], 1 if shard is None else shard.parallel.cp_size,
                         None if shard is None else shard.parallel.mode.name,
                         module.config.sparse_attention["budget"]["vertical_topk"]))

    forwards = []
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    trainer = SparseTrainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                            callbacks=[Record()])
    model.register_forward_pre_hook(seen, with_kwargs=True)
    trainer.train(resume_from_checkpoint=resume)
    return losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, forwards


def _stage_data(samples, first, count, seq_len):
    return [{k: v[:seq_len] for k, v in samples[i].items()} for i in range(first, first + count)]


def _curriculum_vs_chain(rank: int, world: int, out: str) -> dict:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    samples = _samples()
    results = {}
    for smet in (False, True):
        name = "smet" if smet else "adamw"
        one = os.path.join(out, f"{name}-one")
        save = dict(save_strategy="steps", save_steps=3) if not smet else {}
        run = _train(_args(one, smet, cp_schedule=SCHEDULE, **save), samples)
        # the same stages as three jobs, each resuming the previous one's checkpoint on the samples it left
        chain, checkpoint, first = {}, None, 0
        for stage, (start, stop, seq_len, cp) in enumerate([(0, 2, 128, 1), (2, 4, 256, 2), (4, 6, 512, 4)]):
            count = (stop - start) * world // cp
            extra = dict(sparse_vertical_topk=32, cp_mode="hybrid", cp_ulysses_size=2) if stage == 2 else {}
            args = _args(os.path.join(out, f"{name}-chain"), smet, cp_size=cp, ignore_data_skip=True, **extra)
            losses, weights, _ = _train(args, _stage_data(samples, first, count, seq_len), checkpoint,
                                        stop_at=stop if stop < MAX_STEPS else None)
            chain.update(losses)
            checkpoint, first = os.path.join(out, f"{name}-chain", f"checkpoint-{stop}"), first + count
            # the next job changes the CP degree on purpose: drop the marker that would refuse the new layout
            if rank == 0 and stop < MAX_STEPS:
                os.remove(os.path.join(checkpoint, MARKER))
            torch.distributed.barrier()
        results[name] = {"run": run, "chain": (chain, weights)}
        if not smet:  # resume the one-run curriculum from its checkpoint in the middle stage (step 3)
            results["resumed"] = _train(_args(one, smet, cp_schedule=SCHEDULE),
                                        samples, os.path.join(one, "checkpoint-3"))
    return results if rank == 0 else {}


def _assert_same(got: tuple, want: tuple, steps) -> None:
    (got_losses, got_weights), (want_losses, want_weights) = got[:2], want[:2]
    assert sorted(got_losses) == list(steps) and sorted(want_losses) == list(steps)
    for step in steps:
        # (the Trainer logs losses rounded to 4 decimals)
        assert abs(got_losses[step] - want_losses[step]) <= 2e-4, (got_losses, want_losses)
    for key, value in want_weights.items():
        torch.testing.assert_close(got_weights[key], value, rtol=1e-5, atol=1e-6, msg=key)


def _fsdp2_through_cp_switches(rank: int, world: int) -> dict:
    """FSDP2 over all ranks (the flattened dp_shard x cp mesh) with AdamW, through CP 1 -> 2 (ring, then
    ulysses) -> 4 (hybrid 2 x 2, then ulysses) at 128 -> 256 -> 512 tokens (one step each), in float64,
    beside a one-process copy fed each step's global batch: the losses, the final weights, and where
    every local shard lives."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    import hf_sparse_cp
    from hf_sparse_cp.distributed import (
        ContextParallelConfig,
        global_mean_loss,
        global_num_items,
        prepare_context_parallel_inputs,
        rank_loss,
    )
    from hf_sparse_cp.testing.tiny_models import tiny_config

    if not hf_sparse_cp.is_patched():
        hf_sparse_cp.patch()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).double()
    hf_sparse_cp.configure(model, PATTERN)
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0) for m in (model, reference))
    steps = [(128, ContextParallelConfig(cp_size=1)), (256, ContextParallelConfig(cp_size=2)),
             (256, ContextParallelConfig(cp_size=2, cp_mode="ulysses")),
             (512, ContextParallelConfig(cp_size=4, cp_mode="hybrid", cp_ulysses_size=2)),
             (512, ContextParallelConfig(cp_size=4, cp_mode="ulysses"))]
    dims = [ParallelDims.from_config(config) for _, config in steps]  # built up front
    where = [(p.to_local().data_ptr(), tuple(p.to_local().shape)) for p in model.parameters()]
    samples, position, losses = torch.stack([s["input_ids"] for s in _samples()]), 0, []
    vocab = model.config.vocab_size
    for par, (seq_len, _) in zip(dims, steps):
        batch = samples[position : position + par.dp_size, :seq_len]  # the step's global batch, one per DP rank
        position += par.dp_size
        mine = batch[par.dp_rank : par.dp_rank + 1]
        inputs = prepare_context_parallel_inputs({"input_ids": mine, "labels": mine}, par,
                                                 block_size=PATTERN.block_size)
        logits = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"],
                       cp_shard=inputs[CP_SHARD_KWARG]).logits
        loss_sum = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), inputs["shift_labels"].reshape(-1),
                                                     reduction="sum")
        num = global_num_items(inputs["shift_labels"])
        rank_loss(loss_sum, num, world).backward()  # FSDP2 averages over all ranks: the global token mean
        opt.step()
        opt.zero_grad()
        ref_logits = reference(input_ids=batch).logits[:, :-1]
        ref_loss = torch.nn.functional.cross_entropy(ref_logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((global_mean_loss(loss_sum, num).item(), ref_loss.item()))
    stayed = where == [(p.to_local().data_ptr(), tuple(p.to_local().shape)) for p in model.parameters()]
    weights = max(float((p.detach().full_tensor() - q.detach()).abs().max())
                  for p, q in zip(model.parameters(), reference.parameters()))
    return {"losses": losses, "weights": weights, "stayed": stayed}


def _in_four_processes(rank: int, world: int, out: str) -> dict:
    return {"trainer": _curriculum_vs_chain(rank, world, out), "fsdp2": _fsdp2_through_cp_switches(rank, world)}


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory):
    from hf_sparse_cp.testing.spawn import run_gloo

    return run_gloo(_in_four_processes, 4, str(tmp_path_factory.mktemp("curriculum")), timeout_s=600)


def test_one_run_through_three_cp_stages_equals_three_chained_jobs(four_processes):
    results = four_processes[0]["trainer"]
    # each step ran in its stage: 128-token shards of 128, 256 and 512 tokens, CP 1, 2 (ring), 4 (hybrid), the last
    # stage's top-k
    stages = [(128, 1, None, 16)] * 2 + [(128, 2, "ring", 16)] * 2 + [(128, 4, "hybrid", 32)] * 2
    assert results["adamw"]["run"][2] == results["smet"]["run"][2] == stages
    assert results["resumed"][2] == stages[3:]
    for name in ("adamw", "smet"):
        _assert_same(results[name]["run"], results[name]["chain"], range(1, MAX_STEPS + 1))
        losses = results[name]["run"][0]
        assert losses[MAX_STEPS] < losses[1]
    # resumed at step 3 (stage CP 2 x DP 2): steps 4-6 and the final weights as without the interruption
    _assert_same(results["resumed"], ({s: results["adamw"]["run"][0][s] for s in (4, 5, 6)},
                                      results["adamw"]["run"][1]), range(4, MAX_STEPS + 1))


def test_fsdp2_shards_stay_in_place_through_cp_switches_and_train_like_one_process(four_processes):
    for r in four_processes:
        assert r["fsdp2"]["stayed"]  # every local shard: the same storage and shape after three CP degrees, 3 modes
        assert len(r["fsdp2"]["losses"]) == 5
        for got, want in r["fsdp2"]["losses"]:
            assert abs(got - want) <= 1e-9 * abs(want)
        assert r["fsdp2"]["weights"] < 1e-9


def _embeddings_or_ids(rank: int, world: int, out: str, embeddings: bool) -> tuple[list, dict]:
    """Three steps of `0:128:1,1:256:2` (CP 1 x DP 2, then CP 2) on a model with a frozen, untied embedding, fed the
    token ids or their embeddings (inputs_embeds, as a script or a vision-language model passes them): the losses
    and the trained weights."""
    from transformers import AutoModelForCausalLM, default_data_collator

    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.sparse_trainer import SparseTrainer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", tie_word_embeddings=False))
    table = model.get_input_embeddings().weight.requires_grad_(False)
    samples = _stage_data(_samples(), 0, NUM_SAMPLES, 256)
    if embeddings:
        samples = [{"inputs_embeds": table[s["input_ids"]].detach(), "labels": s["labels"]} for s in samples]
    trainer = SparseTrainer(model=model, args=_args(out, False, cp_schedule="0:128:1,1:256:2", max_steps=3),
                            train_dataset=samples, data_collator=default_data_collator)
    trainer.train()
    return ([log["loss"] for log in trainer.state.log_history if "loss" in log],
            {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad})


def test_a_cp_switch_trains_on_embeddings_as_on_their_token_ids(tmp_path):
    """Samples of inputs_embeds through a CP switch: before, the run raised KeyError: 'input_ids' as it began."""
    from hf_sparse_cp.testing.spawn import run_gloo_each

    runs = run_gloo_each({kind: (_embeddings_or_ids, (str(tmp_path / kind), kind == "embeds"))
                          for kind in ("ids", "embeds")}, 2, timeout_s=300)
    for (ids_losses, ids_weights), (losses, weights) in zip(runs["ids"], runs["embeds"]):
        assert len(losses) == 3 and losses == pytest.approx(ids_losses, rel=1e-6)
        for name, want in ids_weights.items():
            torch.testing.assert_close(weights[name], want, rtol=1e-6, atol=1e-7, msg=name)


def _extended_after_checkpoint(rank: int, world: int, out: str, scheduler: str) -> dict:
    """`0:128:1,2:256:2` (4 steps) saving checkpoint-3, resumed with a stage added at step 3 and --max_steps 5; and
    the extended schedule uninterrupted. Rank 0's losses, final weights and forwards of each."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    samples, short, extended = _samples(), "0:128:1,2:256:2", "0:128:1,2:256:2,3:256:1"
    common = dict(lr_scheduler_type=scheduler)
    results = {"whole": _train(_args(os.path.join(out, "whole"), False, cp_schedule=extended, max_steps=5,
                                     **common), samples)}
    saved = os.path.join(out, "saved")
    _train(_args(saved, False, cp_schedule=short, max_steps=4, save_strategy="steps", save_steps=3, **common),
           samples)
    results["resumed"] = _train(_args(saved, False, cp_schedule=extended, max_steps=5, **common), samples,
                                os.path.join(saved, "checkpoint-3"))
    return results if rank == 0 else {}


def test_a_stage_added_after_the_checkpoint_resumes_as_the_extended_run_uninterrupted(tmp_path):
    """A checkpoint resumed with a --cp_schedule that adds a stage from its step on (--max_steps raised) was refused
    as another layout; the steps before it trained with the same stages and samples, so it continues exactly (an LR
    schedule that does not depend on --max_steps: a decaying one changes with it)."""
    from hf_sparse_cp.testing.spawn import run_gloo

    results = run_gloo(_extended_after_checkpoint, 2, str(tmp_path), "constant", timeout_s=300)[0]
    # steps 4 and 5 in the added stage (CP 1 x DP 2: 256-token samples, unsplit)
    assert results["resumed"][2] == results["whole"][2][3:] == [(256, 1, None, 16)] * 2
    _assert_same(results["resumed"], ({s: results["whole"][0][s] for s in (4, 5)}, results["whole"][1]), (4, 5))


# ---- one process: what a stage trains, and what it leaves behind (issue #31) ----


def _one_process(tmp_path, schedule: str, samples: list[dict], collator=None, batch: int = 1, max_steps: int = 2,
                 **extra):
    from transformers import AutoModelForCausalLM, default_data_collator

    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.sparse_trainer import SparseTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    args = _args(str(tmp_path), False, cp_schedule=schedule, max_steps=max_steps, per_device_train_batch_size=batch,
                 **extra)
    return SparseTrainer(model=model, args=args, train_dataset=samples, data_collator=collator or default_data_collator)


def test_a_stage_longer_than_the_samples_is_refused_before_training(tmp_path):
    """`--sparse_max_length 512 --cp_schedule 0:256:1,2:1024:1` trained its "1024" stage on 512-token samples."""
    from hf_sparse_cp.trainer.arguments import is_flag_error

    trainer = _one_process(tmp_path, "0:128:1,1:256:1", _stage_data(_samples(), 0, NUM_SAMPLES, 128))
    with pytest.raises(ValueError, match=re.escape(
            "cp_schedule stage 1 (1:256:1) would train rows of 128 tokens, not 256: the samples hold 128 tokens, and "
            "a stage crops samples to its length but never extends them: give samples of at least 256 tokens")
    ) as refused:
        trainer.train()
    assert trainer.state.global_step == 0
    # the user's data against the flag: a launched run ends with the message alone, exit status 2 (it printed a
    # traceback from every rank, then torchrun's ChildFailedError, exit status 1)
    assert is_flag_error(refused.value)


def test_a_stage_whose_rows_pack_several_samples_is_refused_before_training(tmp_path):
    """With --pack_documents the stage length cropped each document: rows were pack x stage length."""
    from transformers import DataCollatorWithFlattening

    from hf_sparse_cp.trainer.arguments import is_flag_error

    trainer = _one_process(tmp_path, "0:128:1,1:128:1", _stage_data(_samples(), 0, NUM_SAMPLES, 128),
                           DataCollatorWithFlattening(return_flash_attn_kwargs=True), batch=2)
    with pytest.raises(ValueError, match=r"cp_schedule stage 0 \(0:128:1\) would train rows of 256 tokens, not 128: "
                                         r"the data collator turns 2 samples .* without packing") as refused:
        trainer.train()
    assert trainer.state.global_step == 0 and is_flag_error(refused.value)
    # (rows packed before the collator, TRL's packing=True, are samples a stage crops: one to a batch)
    assert ("or with rows packed before the collator (TRL's packing=True, or restarting position_ids in the data) one "
            "to a batch: --per_device_train_batch_size 1, with --gradient_accumulation_steps for more") in str(
                refused.value)


def _short_at(samples: list[dict], lengths: dict[int, int]) -> list[dict]:
    """`samples` with sample k cut to `lengths[k]` tokens."""
    return [{key: v[:lengths.get(k, len(v))] for key, v in s.items()} for k, s in enumerate(samples)]


class _Unscanned(torch.utils.data.Dataset):
    """A torch Dataset whose lengths cannot be read before training (one that tokenizes in __getitem__)."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, k):
        return self.samples[k]


def _padding_collator(rows):
    """Pads rows to the micro-batch's longest, as DataCollatorWithPadding and TRL's SFT collator do."""
    pad = torch.nn.utils.rnn.pad_sequence
    return {"input_ids": pad([r["input_ids"] for r in rows], batch_first=True),
            "labels": pad([r["labels"] for r in rows], batch_first=True, padding_value=-100),
            "attention_mask": pad([torch.ones_like(r["input_ids"]) for r in rows], batch_first=True)}


@pytest.mark.parametrize("scanned, workers", [(True, 0), (False, 0), (False, 1)],
                         ids=["scanned", "at_the_step", "at_the_step_in_a_worker"])
def test_a_later_sample_shorter_than_its_stage_beside_a_longer_one_is_refused_naming_it(tmp_path, scanned, workers):
    """Only the first micro-batch of each stage was checked: a later 150-token sample beside a 256-token one in
    stage 1 ended the run when its step came (hours into a real one) in RuntimeError: stack expects each tensor to be
    equal size (default_data_collator). A list's lengths are read before training; a dataset's that cannot be read
    are refused at the step, as the user's, in a DataLoader worker too (torch re-raised it in the main process as a
    ValueError of the worker's traceback, not the user's: a launched run printed a traceback)."""
    from hf_sparse_cp.trainer.arguments import is_flag_error

    samples = _short_at(_stage_data(_samples(), 0, 8, 256), {3: 150})
    trainer = _one_process(tmp_path, "0:128:1,1:256:1", samples if scanned else _Unscanned(samples), batch=2,
                           dataloader_num_workers=workers)
    named = "cp_schedule stage 1 (1:256:1): step 1 draws samples [2, 3], rows of [256, 150] tokens" if scanned else (
        "cp_schedule: samples [2, 3] of the 256-token stage are rows of [256, 150] tokens")
    with pytest.raises(ValueError, match="^" + re.escape(named) + ".* which the data collator cannot batch "
                       ".*RuntimeError: stack expects.*give a data collator that pads rows") as refused:
        trainer.train()
    assert is_flag_error(refused.value)
    # (before training; at the step: the loader fetches step 1's batch during step 0)
    assert trainer.state.global_step == 0


@pytest.mark.parametrize("scanned, workers", [(True, 0), (False, 0), (False, 2)],
                         ids=["scanned", "at_the_step", "at_the_step_in_workers"])
def test_samples_shorter_than_their_stage_train_as_shorter_rows_warned_of_once(tmp_path, scanned, workers):
    """TRL's packing leaves the last rows short: they train exactly as shorter rows (padded with the micro-batch where
    the collator pads), so they are counted in one warning, not refused (a strict check of every sample refused
    such a dataset); before, nothing said so. Said once by the DataLoader workers too (it was once per worker)."""
    samples = _short_at(_stage_data(_samples(), 0, 8, 256), {3: 150, 5: 40, 6: 200})
    trainer = _one_process(tmp_path, "0:128:1,1:256:1", samples if scanned else _Unscanned(samples),
                           _padding_collator, batch=2, max_steps=4, dataloader_num_workers=workers)
    logger = logging.getLogger("hf_sparse_cp.trainer.stage_loader")
    handler = logging.FileHandler(tmp_path / "warned.log")  # (the workers' records too: they inherit it)
    logger.addHandler(handler)
    try:
        trainer.train()
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert trainer.state.global_step == 4
    warned = (tmp_path / "warned.log").read_text().splitlines()
    assert len(warned) == 1, warned
    assert ("stage 1 (1:256:1): 3 of the samples it draws, the shortest of 40 tokens" if scanned else
            "tokens, fewer than its stage's 256" if workers else
            "sample 3 holds 150 tokens, fewer than its stage's 256") in warned[0]


@pytest.mark.parametrize("batch", [1, 2])
def test_short_first_samples_train_where_the_lengths_are_read(tmp_path, caplog, batch):
    """Each stage's first micro-batch was collated from the dataset's first samples: a short first one refused the run
    ("would train rows of 150 tokens, not 256"), beside a longer one it ended the check in RuntimeError: stack
    expects each tensor to be equal size, though the run draws it only in the 128-token stage. Where the lengths are
    read, the check takes the first samples that reach the stage."""
    samples = _short_at(_stage_data(_samples(), 0, 8, 256), {1: 150} if batch == 2 else {0: 150, 1: 150})
    trainer = _one_process(tmp_path, "0:128:1,1:256:1", samples, batch=batch, max_steps=3)
    with caplog.at_level("WARNING", logger="hf_sparse_cp.trainer.stage_loader"):
        trainer.train()
    assert trainer.state.global_step == 3
    # (batch 1: sample 1 in stage 1; batch 2: sample 1 only in stage 0, cropped to 128 tokens)
    assert ("1 of the samples it draws" in caplog.text) == (batch == 1)


def test_a_resume_that_replays_no_batches_checks_the_micro_batches_it_draws(tmp_path):
    """The check before training walked the sampler from step 0: resumed at step 2 with --ignore_data_skip, the run
    draws samples 0-3 again, now in the 256-token stage, where sample 3's 150 tokens beside sample 2's 256 cannot be
    stacked: the check passed, and the resume trained on until step 3 was refused (hours in, in a real run)."""
    from hf_sparse_cp.trainer.arguments import is_flag_error

    samples = _short_at(_stage_data(_samples(), 0, 8, 256), {3: 150})
    _one_process(tmp_path, "0:128:1,2:256:1", samples, batch=2, max_steps=5, save_strategy="steps",
                 save_steps=2).train()
    resumed = _one_process(tmp_path, "0:128:1,2:256:1", samples, batch=2, max_steps=5, ignore_data_skip=True)
    named = "cp_schedule stage 1 (2:256:1): step 3 draws samples [2, 3], rows of [256, 150] tokens"
    with pytest.raises(ValueError, match="^" + re.escape(named)) as refused:
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert is_flag_error(refused.value) and resumed.state.global_step == 2


@pytest.mark.parametrize("ignore_data_skip, short, named", [
    (False, {3: 150}, None), (False, {3: 150, 5: 150}, "step 2 draws samples [4, 5]"), (True, {5: 150}, None)],
    ids=["skipped_batch", "skipped_and_drawn_batches", "replayed_from_the_first_sample"])
def test_a_resume_checks_exactly_the_micro_batches_it_draws(tmp_path, ignore_data_skip, short, named):
    """A resume from step 2 of `0:128:1,1:256:1` (trained with a padding collator, resumed with one that stacks)
    draws steps 2-3: samples 4-7 where it skips the batches already trained (accelerate's skip_first_batches), samples
    0-3 where it replays none (--ignore_data_skip). The check walked every step from step 0 where it skips them: the
    skipped step 1 (samples 2 and 3, the latter of 150 tokens) refused the resume, and was named where step 2 draws
    another such batch. A batch only step 0's order draws at a resumed step is not refused either."""
    from hf_sparse_cp.trainer.arguments import is_flag_error

    samples = _short_at(_stage_data(_samples(), 0, 8, 256), short)
    _one_process(tmp_path, "0:128:1,1:256:1", samples, _padding_collator, batch=2, max_steps=4,
                 save_strategy="steps", save_steps=2).train()
    resumed = _one_process(tmp_path, "0:128:1,1:256:1", samples, batch=2, max_steps=4,
                           ignore_data_skip=ignore_data_skip)
    checkpoint = str(tmp_path / "checkpoint-2")
    if named is None:
        resumed.train(resume_from_checkpoint=checkpoint)
        assert resumed.state.global_step == 4
        return
    with pytest.raises(ValueError, match="^" + re.escape(f"cp_schedule stage 1 (1:256:1): {named}")) as refused:
        resumed.train(resume_from_checkpoint=checkpoint)
    assert is_flag_error(refused.value) and resumed.state.global_step == 2


@pytest.mark.parametrize("begin", range(6))
def test_a_resume_that_skips_batches_is_checked_on_those_every_rank_then_draws(begin):
    """Through CP and DP layouts, two passes over shuffled data: resumed at step `begin`, the refused micro-batch is
    the first one of mixed lengths that any rank's sampler hands out (from step 0: accelerate's skip_first_batches
    skips the first `begin` steps of it) at step `begin` or later; none where there is none."""
    from hf_sparse_cp.trainer.stage_loader import check_drawn_lengths

    world, grad_accum, n, schedule = 4, 2, 10, _build(SCHEDULE, max_steps=6)
    lengths = np.array([512, 512, 100, 512, 512, 512, 300, 512, 512, 512])
    data = [{"input_ids": torch.arange(k), "labels": torch.arange(k)} for k in lengths]
    stack = lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]}  # noqa: E731
    mixed = []
    for rank in range(world):
        dims = [_dims(world, rank, stage.cp_size) for stage in schedule.stages]
        sampler = StageBatchSampler(schedule, dims, num_samples=n, batch_size=2, grad_accum=grad_accum,
                                    max_steps=6, seed=7)
        for k, batch in enumerate(sampler):  # (micro-batch j of DP rank d is the step's (j x DP + d)-th)
            step, stage = k // grad_accum, dims[schedule.index_at(k // grad_accum)]
            if step >= begin and len({min(lengths[i], seq) for i, seq in batch}) > 1:
                mixed.append(((step, k % grad_accum * stage.dp_size + stage.dp_rank), [i for i, _ in batch]))
    if not mixed:
        check_drawn_lengths(sampler, lengths, data, stack, begin)
        return
    (step, _), samples = min(mixed)
    with pytest.raises(ValueError, match=re.escape(f": step {step} draws samples {samples}, rows")):
        check_drawn_lengths(sampler, lengths, data, stack, begin)


def test_the_samples_named_are_those_the_shuffled_order_draws_from_a_datasets_dataset(tmp_path):
    """The lengths of a `datasets.Dataset` (a selection of it: an indices mapping) are read from arrow, and the
    micro-batch refused is the one the seeded sampler hands out."""
    from datasets import Dataset

    from hf_sparse_cp.trainer.stage_loader import check_drawn_lengths, sample_lengths

    rows = [list(range(n)) for n in (256, 100, 256, 256, 256, 256, 256, 90, 256, 256)]
    data = Dataset.from_dict({"input_ids": rows, "labels": rows}).select([9, 8, 7, 6, 5, 4, 3, 2, 1, 0])
    data.set_format("torch")
    lengths = sample_lengths(data)
    assert lengths.tolist() == [256, 256, 90, 256, 256, 256, 256, 256, 100, 256]
    schedule = _build("0:128:1,2:256:1", world=1, max_steps=5)
    sampler = StageBatchSampler(schedule, [ParallelDims.single()] * 2, num_samples=10, batch_size=2, grad_accum=1,
                                max_steps=5, seed=3)
    drawn = [batch for batch in sampler if batch[0][1] == 256 and len({lengths[k] for k, _ in batch}) > 1][0]
    stack = lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]}  # noqa: E731
    with pytest.raises(ValueError, match=re.escape(f"draws samples {[k for k, _ in drawn]}")):
        check_drawn_lengths(sampler, lengths, data, stack)


def test_a_dataset_without_a_length_is_refused_as_a_bad_flag(tmp_path):
    """A cp_schedule over an iterable dataset (no length: no global sample order to continue across stages) was
    refused with a traceback from every rank (exit status 1); it is the user's flag against the data (exit 2)."""
    from hf_sparse_cp.trainer.arguments import is_flag_error

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(_stage_data(_samples(), 0, NUM_SAMPLES, 128))

    trainer = _one_process(tmp_path, "0:128:1", Stream())
    with pytest.raises(ValueError, match="a cp_schedule needs a train_dataset with a length") as refused:
        trainer.train()
    assert trainer.state.global_step == 0 and is_flag_error(refused.value)


def test_epoch_starts_out_of_order_are_refused_as_a_bad_flag(tmp_path):
    """`hf-sparse-cp train --nproc 2 --cp_schedule 0:256:1,1:512:2,0.01ep:512:1` printed the refusal from every
    rank, then torchrun's traceback, exit status 1: a schedule the Trainer's data decide was refused as a bug. It
    is a refusal of the user's flag now (`flag_errors`), which a launched run ends with once, exit status 2."""
    from hf_sparse_cp.trainer.arguments import is_flag_error

    # 16 samples, one a step: the first (1/16 of an epoch) is consumed at step 1, where stage 1 starts
    with pytest.raises(ValueError, match=re.escape("cp_schedule stage 2 (0.0625ep:128:1) starts at step 1, not after "
                                                   "stage 1 (step 1)")) as refused:
        _one_process(tmp_path, "0:128:1,1:128:1,0.0625ep:128:1", _stage_data(_samples(), 0, NUM_SAMPLES, 128))
    assert is_flag_error(refused.value)


def test_the_pattern_a_stage_changed_is_undone_at_the_end_and_by_disabling(tmp_path):
    """A stage's pattern went onto the model unrecorded: the last stage's stayed the model's (and was saved
    as such), and disabling did not restore it."""
    from hf_sparse_cp.trainer.attach import detach_from_trainer, disable_sparse_attention

    trainer = _one_process(tmp_path, "0:128:1,1:128:1:vertical_topk=32", _stage_data(_samples(), 0, NUM_SAMPLES, 128))
    model = trainer.model
    seen = []
    model.register_forward_pre_hook(
        lambda module, args: seen.append(module.config.sparse_attention["budget"]["vertical_topk"]))
    trainer.train()
    assert seen == [16, 32]  # each step ran its stage's pattern
    assert model.config.sparse_attention == PATTERN.to_dict()  # after training: the run's own, as save_model writes
    detach_from_trainer(trainer)
    assert model.config.sparse_attention == PATTERN.to_dict()
    disable_sparse_attention(model)
    assert getattr(model.config, "sparse_attention", None) is None  # as before the run


def test_an_evaluation_after_training_leaves_the_run_s_own_pattern_on_the_model(tmp_path):
    """An evaluation after train() put the last stage's pattern back on the model and left it there, so a model saved
    after it (stock run_clm's push_to_hub, which follows its evaluation) carried vertical_topk 32, not the run's 16."""
    trainer = _one_process(tmp_path, "0:128:1,1:128:1:vertical_topk=32", _stage_data(_samples(), 0, NUM_SAMPLES, 128))
    trainer.eval_dataset = _stage_data(_samples(), 0, 2, 128)
    seen = []
    trainer.model.register_forward_pre_hook(
        lambda module, args: seen.append(module.config.sparse_attention["budget"]["vertical_topk"]))
    trainer.train()
    assert seen == [16, 32]  # each step ran its stage's pattern
    assert "eval_loss" in trainer.evaluate()
    assert seen[2:] == [16]  # the trained model (one batch of 2 rows), as it is saved
    assert trainer.model.config.sparse_attention == PATTERN.to_dict()


def test_an_evaluation_before_training_leaves_the_model_s_own_pattern_on_it(tmp_path):
    """A baseline evaluation before train() (scripts with --do_eval evaluate first) put the first stage's pattern on
    the model and left it there: a model saved then (an evaluation-only run's save) carried the stage's vertical_topk
    32, not its own 16. Outside training the model keeps its own pattern; training still runs each stage's."""
    trainer = _one_process(tmp_path, "0:128:1:vertical_topk=32,1:128:1", _stage_data(_samples(), 0, NUM_SAMPLES, 128))
    trainer.eval_dataset = _stage_data(_samples(), 0, 2, 128)
    seen = []
    trainer.model.register_forward_pre_hook(
        lambda module, args: seen.append(module.config.sparse_attention["budget"]["vertical_topk"]))
    assert "eval_loss" in trainer.evaluate()
    assert seen == [16] and trainer.model.config.sparse_attention == PATTERN.to_dict()
    trainer.train()
    assert seen[1:] == [32, 16]  # each step ran its stage's pattern
    assert trainer.model.config.sparse_attention == PATTERN.to_dict()


def test_epoch_strategies_act_at_the_end_of_each_pass_over_the_data(tmp_path):
    """A curriculum's sampler is one Trainer epoch of the whole run, so --save_strategy, --eval_strategy and
    --logging_strategy epoch saved, evaluated and logged once, at the last step, where a run without a schedule does so
    after each pass over the data (8 steps of 4 samples over 8 samples: checkpoints 2, 4, 6 and 8; with the schedule
    checkpoint-8 alone: a run stopped before its end had saved nothing). They act in the step that completes each pass
    now, as the stages' epoch starts count them (7 steps of 4 samples over 6: steps 2, 3, 5 and 6), and at the end."""
    from transformers import AutoModelForCausalLM, default_data_collator

    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.sparse_trainer import SparseTrainer

    torch.manual_seed(0)
    samples = _stage_data(_samples(), 0, 6, 256)
    args = _args(str(tmp_path), False, cp_schedule="0:128:1,2:256:1", max_steps=7, per_device_train_batch_size=4,
                 save_strategy="epoch", eval_strategy="epoch", logging_strategy="epoch", per_device_eval_batch_size=2)
    trainer = SparseTrainer(model=AutoModelForCausalLM.from_config(tiny_config("llama")), args=args,
                            train_dataset=samples, eval_dataset=samples[:2], data_collator=default_data_collator)
    marked, save = [], trainer._save_checkpoint

    def marked_first(*args, **kwargs):  # (a save that dies halfway must leave its checkpoint marked in progress)
        marked.append(read_marker(tmp_path / f"checkpoint-{trainer.state.global_step}"))
        return save(*args, **kwargs)

    trainer._save_checkpoint = marked_first
    trainer.train()
    ends = [2, 3, 5, 6, 7]
    assert sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("checkpoint-*")) == ends
    assert marked == [{"complete": False, "step": step} for step in ends]
    history = trainer.state.log_history
    assert [log["step"] for log in history if "eval_loss" in log] == ends
    assert [log["step"] for log in history if "loss" in log] == ends


def test_a_resume_that_replays_no_batches_trains_each_step_in_its_stage(tmp_path):
    """`--ignore_data_skip` resumed at step 2 of `0:128:1,2:256:1:...` trained steps 3-4 on stage 0's batches (the
    sampler began at step 0); under CP the ranks of a group then held different rows and stopped, blamed on data
    built differently per process."""
    schedule, out = "0:128:1,2:256:1:vertical_topk=32", str(tmp_path)
    samples = _stage_data(_samples(), 0, NUM_SAMPLES, 256)
    _train(_args(out, False, cp_schedule=schedule, max_steps=4, save_strategy="steps", save_steps=2), samples)
    args = _args(out, False, cp_schedule=schedule, max_steps=4, ignore_data_skip=True)
    losses, _, forwards = _train(args, samples, resume=os.path.join(out, "checkpoint-2"))
    assert forwards == [(256, 1, None, 32)] * 2 and sorted(losses) == [3, 4]


# ---- 2 gloo processes: every step of a CP switch is one process's step on that step's global batch ----

SWITCH, SWITCH_LEN = "0:256:1,2:512:2", 512  # CP 1 x DP 2 for steps 0-1, then CP 2 x DP 1


def _random_samples(n: int = 6) -> list[dict]:
    """Distinct random rows: two samples' losses differ well beyond fp32 rounding."""
    ids = torch.randint(3, 259, (n, SWITCH_LEN), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _switch_and_one_process(rank: int, world: int, out: str) -> dict:
    """Train through SWITCH; then, in this process alone, the loss and kept fraction of the weights each step
    started from, on the rows its global batch held and on the rows one process with batch 2 would take."""
    from transformers import AutoModelForCausalLM, TrainerCallback, default_data_collator

    from hf_sparse_cp.integration.stats import LOG_KEY, pop_kept_fractions
    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.sparse_trainer import SparseTrainer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    entering = []

    class Snapshot(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            entering.append({k: v.detach().clone() for k, v in model.state_dict().items()})

    samples = _random_samples()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    args = _args(out, False, cp_schedule=SWITCH, max_steps=3, sparse_log_sparsity=True)
    trainer = SparseTrainer(model=model, args=args, train_dataset=samples, data_collator=default_data_collator,
                            callbacks=[Snapshot()])
    trainer.train()
    logged = [(log["loss"], log[LOG_KEY]) for log in trainer.state.log_history if "loss" in log]
    speed = next(log for log in trainer.state.log_history if "train_samples_per_second" in log)
    trainer.create_model_card()
    card = open(os.path.join(out, "README.md")).read() if rank == 0 else None

    def one_process(weights, first: int, count: int, seq_len: int) -> tuple[float, float]:
        rows = torch.stack([s["input_ids"][:seq_len] for s in samples[first:first + count]])
        model.load_state_dict(weights)
        pop_kept_fractions(model)
        with torch.no_grad():
            loss = model(input_ids=rows, labels=rows).loss.item()
        kept = pop_kept_fractions(model)
        return loss, sum(kept.values()) / len(kept)

    # sequential order: steps 0-1 take samples 0-1 and 2-3 (one per DP rank), step 2 sample 4 (DP 1)
    batches = [(0, 2, 256), (2, 2, 256), (4, 1, 512)]
    return {"logged": logged,
            "one_process": [one_process(w, *batch) for w, batch in zip(entering, batches)],
            "batch_2": one_process(entering[2], 4, 2, 512), "card": card, "speed": speed}


@pytest.fixture(scope="module")
def switched(tmp_path_factory):
    from hf_sparse_cp.testing.spawn import run_gloo

    return run_gloo(_switch_and_one_process, 2, str(tmp_path_factory.mktemp("switch")), timeout_s=300)


def test_each_step_through_a_cp_switch_is_one_process_on_its_global_batch(switched):
    """Pins why `--cp_schedule 0:256:1,2:512:2` on 2 processes logs another step-2 loss than one process with batch
    2 and `0:256:1,2:512:1`: at CP 2 the DP degree is 1, so the step trains one 512-token sample (the tokens per
    step stay 2 x 256), the one-process run two. Each step's loss is one process's on the samples that step took,
    from the weights it started from, to fp32 rounding (the DP mean and the ring's merge sum in another order);
    the batch-2 run's samples give another loss and kept fraction."""
    results = switched
    assert results[0]["logged"] == results[1]["logged"] and len(results[0]["logged"]) == 3
    for r in results:
        for (loss, kept), (want_loss, want_kept) in zip(r["logged"], r["one_process"]):
            assert abs(loss - want_loss) <= 1e-6 * want_loss, (r["logged"], r["one_process"])
            assert abs(kept - want_kept) <= 1e-5, (r["logged"], r["one_process"])  # (logged rounded to 5 decimals)
        (loss, kept), (other_loss, other_kept) = r["logged"][2], r["batch_2"]
        assert kept < 1.0  # (step 2 runs sparse: its kept fraction tells the blocks selected)
        # one process with batch 2 trains samples 4 and 5 at step 2: another batch, another loss and kept fraction
        assert abs(loss - other_loss) > 1e-5 * other_loss and abs(kept - other_kept) > 1e-3


def test_the_samples_per_second_of_a_cp_switch_count_the_samples_its_steps_took(switched):
    """`--cp_schedule 0:256:1,2:512:2` on 2 processes, 3 steps, takes 2 + 2 + 1 samples; the Trainer's end-of-training
    train_samples_per_second counted max_steps x the first stage's total batch size, 6 samples."""
    for r in switched:
        speed = r["speed"]
        samples = speed["train_samples_per_second"] * speed["train_runtime"]
        assert samples == pytest.approx(5, rel=1e-3), speed


def test_the_model_card_of_a_cp_switch_states_every_stage(switched):
    """The card of `--cp_schedule 0:256:1,2:512:2` on 2 processes described the first stage alone: no context
    parallelism ('data parallel (DDP)'), 2 distinct sequences per step (the CP 2 stage's steps take 1), and the stock
    total_eval_batch_size, which counts each sequence of the CP 2 stage twice."""
    card = switched[0]["card"]
    section = card.split("## Sparse long-context training", 1)[1]
    assert "context parallelism over up to 2 ranks (a context-length curriculum)" in section
    assert ("| context parallelism | --cp_schedule 0:256:1,2:512:2: from step 0, 256-token samples without CP "
            "(DP 2); from step 2, 512-token samples on CP 2 x DP 1 (2 processes): each sequence split over 2 ranks"
            in section)
    assert "| total train batch size | 2 distinct sequences per optimizer step from step 0, 1 from step 2 |" in section
    assert "- total_train_batch_size: 2 from step 0, 1 from step 2 (distinct sequences" in card
    # (the stock line said 16, eval batch 8 x 2 processes: the CP 2 stage evaluates 8 distinct sequences a batch)
    assert "- total_eval_batch_size: 16 from step 0, 8 from step 2 (distinct sequences per evaluation batch" in card


# ---- 2 gloo processes: accelerate's split_batches ----


def _split_batches_refusal(rank: int, world: int, out: str, schedule: str) -> str:
    """The error a SparseTrainer with --cp_schedule `schedule` and split_batches ends with, or "trained"."""
    from transformers import AutoModelForCausalLM, default_data_collator

    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.arguments import is_flag_error
    from hf_sparse_cp.trainer.sparse_trainer import SparseTrainer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    args = _args(out, False, cp_schedule=schedule, max_steps=2, per_device_train_batch_size=2,
                 accelerator_config={"split_batches": True})
    try:
        trainer = SparseTrainer(model=AutoModelForCausalLM.from_config(tiny_config("llama")), args=args,
                                train_dataset=_random_samples(), data_collator=default_data_collator)
        trainer.train()
    except ValueError as error:
        return f"{is_flag_error(error)}: {error}"
    return "trained"


def test_split_batches_with_data_parallel_stages_is_refused_naming_the_fix(tmp_path):
    """With accelerate's split_batches a step takes per_device_train_batch_size samples in all, split over the ranks;
    a curriculum's sampler handed every DP rank of a stage that many, so `0:256:1,1:512:2` on 2 processes trained 4
    samples a step at CP 1 where stock split_batches takes 2 (the losses and weights of another run, silently). A
    schedule whose stages all have one DP rank takes the same samples either way, and trains."""
    from hf_sparse_cp.testing.spawn import run_gloo

    refused = run_gloo(_split_batches_refusal, 2, str(tmp_path / "dp"), "0:256:1,1:512:2", timeout_s=300)
    for text in refused:
        assert text.startswith("True: split_batches=True (--accelerator_config) with a cp_schedule whose stage 0 "
                               "(0:256:1) has 2 data-parallel ranks"), text
        assert "--per_device_train_batch_size 1 without split_batches" in text, text
    assert run_gloo(_split_batches_refusal, 2, str(tmp_path / "cp"), "0:256:2,1:512:2", timeout_s=300) == [
        "trained"] * 2


# ---- 2 gloo processes: evaluation loaders follow the stage ----


def _eval_rows_by_stage(rank: int, world: int, out: str) -> list[list[int]]:
    """The first token of every evaluation row this rank gets in stage 0 (CP 1 x DP 2) and stage 1 (CP 2 x DP 1), the
    Trainer keeping its evaluation loader (persistent workers)."""
    from transformers import AutoModelForCausalLM, default_data_collator

    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.sparse_trainer import SparseTrainer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.manual_seed(0)
    args = _args(out, False, cp_schedule=SWITCH, max_steps=3, per_device_eval_batch_size=1,
                 dataloader_num_workers=1, dataloader_persistent_workers=True)
    evals = [{"input_ids": torch.full((SWITCH_LEN,), 10 + i), "labels": torch.full((SWITCH_LEN,), 10 + i)}
             for i in range(4)]
    trainer = SparseTrainer(model=AutoModelForCausalLM.from_config(tiny_config("llama")), args=args,
                            train_dataset=_random_samples(), eval_dataset=evals, data_collator=default_data_collator)
    seen = []
    for step in (0, 2):  # an evaluation in each stage, as the Trainer runs one at a step's end
        trainer.state.global_step = step
        seen.append([int(batch["input_ids"][0, 0]) for batch in trainer.get_eval_dataloader()])
    return seen


def test_an_evaluation_loader_kept_across_stages_follows_the_stage(tmp_path):
    """With --dataloader_persistent_workers the Trainer keeps its evaluation loader: prepared at CP 1 x DP 2 it kept
    handing each rank half the rows at CP 2 x DP 1, so the two ranks of the CP group split different rows (eval_loss
    5.6638 where one process gives 5.6687, or a refusal blaming data built differently per process)."""
    from hf_sparse_cp.testing.spawn import run_gloo

    ranks = run_gloo(_eval_rows_by_stage, 2, str(tmp_path), timeout_s=300)
    assert sorted(ranks[0][0] + ranks[1][0]) == [10, 11, 12, 13]  # DP 2: each rank half of the rows
    assert ranks[0][1] == ranks[1][1] == [10, 11, 12, 13]  # CP 2 x DP 1: both ranks every row, in order
