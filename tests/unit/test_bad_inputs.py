"""Inputs that used to be accepted while something else was done (issue #14): the example script and the
config dataclasses refuse them, naming the flag or field and the fix."""

import re

import pytest

from hf_sparse_cp.distributed import ContextParallelConfig
from hf_sparse_cp.examples.train_long_context import parse_args


@pytest.mark.parametrize(
    "flags, refused",
    [
        (["--max_length", "0"], "--max_length 0: a training sequence needs at least 2 tokens; e.g. --max_length 4096"),
        (["--max_length", "-4096"], "--max_length -4096: a training sequence needs at least 2 tokens"),
        (["--pack_documents", "0"], "--pack_documents 0 must be >= 1 (1: one document per sequence)"),
        (["--max_length", "256", "--pack_documents", "512"],
         "--pack_documents 512 leaves documents of 0 tokens in a --max_length 256 sequence; a document needs "
         "at least 2 tokens: pack at most 128 documents, or raise --max_length"),
        (["--max_length", "256", "--pack_documents", "3"],
         "--pack_documents 3 does not divide --max_length 256: every sequence packs documents of max_length / "
         "pack_documents tokens, so the sequences would come out shorter. Use a divisor of 256 (e.g. 2, 4, 8, 16)"),
        (["--smet_config", "smet.yaml"], "--smet_config smet.yaml given without --smet would be ignored: add --smet"),
        (["--sparse_layer_overrides", '{"1-0": {"pattern": "dense"}}'],
         "layer_overrides key '1-0' is a reversed range"),
        (["--block_size", "64", "--seq_len", "8"], "--block_size is now --sparse_block_size; --seq_len is now "
         "--max_length."),
    ],
)
def test_the_example_refuses_what_it_would_not_honour(capsys, flags, refused):
    with pytest.raises(SystemExit) as stopped:
        parse_args(flags)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert re.search(r"^\S+: error: " + re.escape(refused), err, re.MULTILINE), err
    assert "usage:" not in err  # one line, not the Trainer's hundreds of flags


def test_the_example_takes_packed_documents_that_divide_the_sequence():
    script, training, *_ = parse_args(["--max_length", "256", "--pack_documents", "4"])
    assert (training.max_length, script.pack_documents) == (256, 4)


@pytest.mark.parametrize(
    "kwargs, refused",
    [
        ({"cp_size": "2"}, "cp_size='2' (str) is not valid: use a whole number, e.g. cp_size=1 (the default); this is "
                           "a number written as text: write it without quotes"),
        ({"cp_size": 2.0}, "cp_size=2.0 (float) is not valid: use a whole number"),
        ({"cp_node_size": 2.5}, "cp_node_size=2.5 (float) is not valid: use a whole number or unset"),
        ({"cp_sharding": "random"}, "cp_sharding='random' (str) is not valid: use one of 'striped', 'zigzag', "
                                    "'contiguous'"),
        ({"cp_ring": None}, "cp_ring=None (NoneType) is not valid: use one of 'flat', 'hierarchical'"),
    ],
)
def test_context_parallel_config_refuses_wrong_types(kwargs, refused):
    with pytest.raises(ValueError, match=re.escape(refused)):
        ContextParallelConfig(**kwargs)
