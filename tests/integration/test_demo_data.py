"""The demo's passkey data: built with `Dataset.map` into a cache file, the same data as the loop it replaced,
built once per node in a distributed run."""

import hashlib
import json
import os

import pytest

from hf_sparse_cp.examples import passkey
from hf_sparse_cp.examples.tokenizer import byte_tokenizer
from hf_sparse_cp.testing.spawn import run_gloo


def _digest(dataset) -> str:
    return hashlib.sha256(json.dumps(dataset.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def _counting_compose(monkeypatch) -> list:
    """Count the texts the map function builds (`_compose` is called once per example it maps)."""
    calls = []
    compose = passkey._compose

    def counted(*args):
        calls.append(args)
        return compose(*args)

    monkeypatch.setattr(passkey, "_compose", counted)
    return calls


# sha256 prefixes of the rows the loop-based passkey_dataset (before Dataset.map) produced with the byte tokenizer
@pytest.mark.parametrize("num_samples, seq_len, seed, digest", [
    (3, 512, 1, "6bee22ea2d0cae3f"),
    (5, 2048, 0, "a50c08faa1f3bae2"),
    (8, 256, 42, "70e432d1a0adc13c"),
])
def test_same_data_as_the_loop_for_the_same_seed(tmp_path, num_samples, seq_len, seed, digest):
    data = passkey.passkey_dataset(byte_tokenizer(), num_samples, seq_len, seed=seed, cache_dir=tmp_path)
    assert _digest(data) == digest
    assert {name: str(feature) for name, feature in data.features.items()} == {
        "input_ids": "List(Value('int32'))", "labels": "List(Value('int64'))", "answer_start": "Value('int64')"}


def test_a_second_call_loads_the_cache_and_other_inputs_build_anew(tmp_path, monkeypatch):
    calls = _counting_compose(monkeypatch)
    tok = byte_tokenizer()
    first = passkey.passkey_dataset(tok, 4, 256, seed=3, cache_dir=tmp_path)
    assert len(calls) == 4 and len(first.cache_files) == 1
    again = passkey.passkey_dataset(byte_tokenizer(), 4, 256, seed=3, cache_dir=tmp_path)  # a new, equal tokenizer
    assert len(calls) == 4  # not built again
    assert again.cache_files == first.cache_files and _digest(again) == _digest(first)
    for other in ({"seed": 4}, {"num_samples": 5}, {"seq_len": 300}):  # every input names its own file
        args = {"num_samples": 4, "seq_len": 256, "seed": 3} | other
        data = passkey.passkey_dataset(tok, cache_dir=tmp_path, **args)
        assert data.cache_files != first.cache_files and len(data) == args["num_samples"]
    assert len(calls) == 4 + 4 + 5 + 4


def _build_in_two_processes(rank: int, world: int, cache_dir: str) -> tuple[int, str]:
    """The example's data step on one rank of a 2-process run: (texts this rank built, data digest)."""
    import tempfile

    from datasets import config as datasets_config

    from hf_sparse_cp.examples.train_long_context import ScriptArguments, passkey_train_data
    from hf_sparse_cp.trainer.sparse_trainer import SparseTrainingArguments

    # what torchrun sets: TrainingArguments then sees the 2-process group run_gloo made
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    datasets_config.HF_DATASETS_CACHE = cache_dir  # (the example builds into the datasets cache)
    built = []
    compose = passkey._compose
    passkey._compose = lambda *args: built.append(args) or compose(*args)
    with tempfile.TemporaryDirectory() as tmp:
        training = SparseTrainingArguments(output_dir=tmp, use_cpu=True, report_to="none", sparse_max_length=256)
        assert training.world_size == world
        data = passkey_train_data(ScriptArguments(num_samples=3, pack_documents=2), training,
                                  byte_tokenizer())
    return len(built), _digest(data)


def test_a_two_process_run_builds_the_data_once(tmp_path):
    (built0, digest0), (built1, digest1) = run_gloo(_build_in_two_processes, 2, str(tmp_path), timeout_s=300)
    assert (built0, built1) == (6, 0)  # rank 0 builds 3 x 2 packed documents, rank 1 loads its cache file
    assert digest0 == digest1


def test_the_last_line_states_the_width_of_rows_aligned_documents_pad(tmp_path):
    """`--pack_documents 3 --align_documents --sparse_block_size 128 --sparse_max_length 960`: each 320-token document
    padded to 384, rows of 1,152 tokens, where the run's last line said 'at 960 tokens' alone."""
    from hf_sparse_cp.examples.train_long_context import ScriptArguments, aligned_width
    from hf_sparse_cp.trainer.packing import BlockAlignedFlattening
    from hf_sparse_cp.trainer.sparse_trainer import SparseTrainingArguments

    def training(length: int) -> SparseTrainingArguments:
        return SparseTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                       sparse_max_length=length, sparse_block_size=128)

    script = ScriptArguments(pack_documents=3, align_documents=True)
    width = BlockAlignedFlattening(128, return_tensors="pt")([{"input_ids": list(range(3, 323))}] * 3)["input_ids"]
    assert width.shape[-1] == 1152
    note = " (1152 with the padding aligning each of its 3 documents to blocks of 128)"
    assert aligned_width(script, training(960)) == note
    assert aligned_width(script, training(1152)) == ""  # (documents of 384 tokens: already whole blocks)
    assert aligned_width(ScriptArguments(pack_documents=3), training(960)) == ""


def test_documents_packed_below_min_seq_len_are_said_to_run_dense(tmp_path, caplog):
    """`--sparse_max_length 2048 --pack_documents 4` packs 512-token documents, under the demo's min_seq_len 1024:
    every layer ran dense (kept fraction 1.0) while the start-up line, which knows the row's length, said both layers
    were sparse. A warning now names the document length and the fixes; documents that reach min_seq_len, and rows
    the start-up line already calls dense, get none."""
    import logging

    from hf_sparse_cp.examples.train_long_context import build_trainer, parse_args

    def warned(*flags: str) -> list[str]:
        caplog.clear()
        script, training, *_ = parse_args(["--output_dir", str(tmp_path), "--num_samples", "1", "--tiny_num_layers",
                                           "1", *flags])
        with caplog.at_level(logging.WARNING):
            build_trainer(script, training)
        return [r.getMessage() for r in caplog.records if "packs documents" in r.getMessage()]

    said = warned("--sparse_max_length", "2048", "--pack_documents", "4")
    assert said == ["--pack_documents 4 packs documents of 512 tokens, under min_seq_len=1024: every layer runs dense "
                    "on them (kept fraction 1.0). Pack fewer documents (at most 2), raise --sparse_max_length, or give "
                    "--sparse_config trial (a shipped pattern sparse at every length)."], said
    assert warned("--sparse_max_length", "2048", "--pack_documents", "2") == []  # (1024-token documents: sparse)
    assert warned("--sparse_max_length", "512", "--pack_documents", "2") == []  # (the start-up line's note says it)
    assert warned("--sparse_max_length", "2048", "--pack_documents", "4", "--sparse_config", "trial") == []
