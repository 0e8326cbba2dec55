"""How the pretrained-model loader finds a GGUF file that a package assembles from chunk packages: a missing chunk
package is named before anything is loaded, and an interrupted assembly leaves no half file in the cache."""

import sys
import textwrap

import pytest

from hf_sparse_cp.testing import pretrained

CONTENT = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """A model whose main package `fake_gguf` assembles its file from the chunk package `fake_gguf_part1`; the
    main package's `assemble` checks an existing file and writes through the given path, as the Gemma package's."""
    packages = tmp_path / "site"
    for name, body in (("fake_gguf", f"""
            import pathlib
            CONTENT = {CONTENT!r}
            FAIL = []

            def assemble(output_path, overwrite=False):
                import fake_gguf_part1  # noqa: F401  (the chunks live there)
                path = pathlib.Path(output_path)
                if path.exists() and not overwrite:
                    if path.read_bytes() != CONTENT:
                        raise FileExistsError(f"{{path}} already exists with an unexpected sha256")
                    return path
                with path.open("wb") as out:
                    out.write(CONTENT[:100])
                    if FAIL:
                        raise OSError(28, "No space left on device")
                    out.write(CONTENT[100:])
                return path
            """), ("fake_gguf_part1", "")):
        (packages / name).mkdir(parents=True)
        (packages / name / "__init__.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(packages))
    monkeypatch.setenv(pretrained.CACHE_ENV, str(tmp_path / "cache"))
    spec = pretrained.PretrainedModel("fake", "Fake", "fake-gguf", "fake_gguf", "fake.gguf", 1024, "none",
                                      ("fake-gguf-part1",))
    monkeypatch.setitem(pretrained.MODELS, "fake", spec)
    yield spec, packages
    for name in ("fake_gguf", "fake_gguf_part1"):
        sys.modules.pop(name, None)


def test_a_missing_chunk_package_is_named_before_anything_loads(chunked, monkeypatch):
    spec, packages = chunked
    monkeypatch.setattr(pretrained, "TEXT_PACKAGE", "fake_gguf")  # the text package is not what this test is about
    assert "fake-gguf-part1" not in pretrained.missing_eval_packages("fake")
    (packages / "fake_gguf_part1" / "__init__.py").unlink()
    (packages / "fake_gguf_part1").rmdir()
    assert "fake-gguf-part1" in pretrained.missing_eval_packages("fake")
    with pytest.raises(ImportError, match=r"fake-gguf assembles fake.gguf from the packages \['fake-gguf-part1'\], "
                                          "which are not installed; run pip install"):
        spec.gguf_file()


def test_an_interrupted_assembly_leaves_no_file_and_the_next_call_writes_a_whole_one(chunked):
    spec, _ = chunked
    import fake_gguf

    fake_gguf.FAIL.append(True)
    with pytest.raises(OSError, match="No space left"):
        spec.gguf_file()
    cache = pretrained.cache_dir()
    assert list(cache.iterdir()) == []  # neither the target nor the work folder
    fake_gguf.FAIL.clear()
    assert spec.gguf_file() == cache / "fake.gguf" and (cache / "fake.gguf").read_bytes() == CONTENT
    assert spec.gguf_file().read_bytes() == CONTENT  # found and checked, not written again


def test_a_cached_file_that_is_not_the_packages_is_assembled_again(chunked):
    spec, _ = chunked
    (pretrained.cache_dir() / "fake.gguf").write_bytes(CONTENT[:100])  # cut off by an earlier version's crash
    assert spec.gguf_file().read_bytes() == CONTENT
