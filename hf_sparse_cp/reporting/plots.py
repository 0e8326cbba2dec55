"""Pictures of a run's sparse attention (`hf-sparse-cp plot`).

* the kept fraction of attention blocks per layer over training, from the Trainer's logs (the
  `trainer_state.json` of an output or checkpoint directory): `hf_sparse_cp.reporting.kept_fraction_figure`;
* the block layouts the `sparse_cp` backend builds for one input: the model runs once on a text or a
  synthetic passkey sample, the layouts of that forward are captured (`capturing_layouts`), and each chosen
  layer and query head is drawn at block resolution (`layout_figure`).

matplotlib is optional (`pip install 'hf-sparse-cp[plot]'`); every figure is a `matplotlib.figure.Figure`
returned to the caller, and `plot_run` also saves them as PNG.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from transformers.utils import ADAPTER_CONFIG_NAME as ADAPTER_CONFIG

from ..attention import sequence
from ..attention.dense import DENSE_BACKEND_ENV
from ..attention.layout import SparseLayout
from ..backends import require_matplotlib
from ..checkpoint_marker import newest_complete_checkpoint
from ..config import SparseAttentionConfig, language_config
from ..config.files import adapter_base
from ..config.model_fields import learned_positions
from ..integration.interfaces import is_patched, patch, unpatch
from ..integration.patching import PatchSet
from ..integration.registration import configure
from ..recipes import pattern_path
from .card_quick_start import TOKENIZER_FILES
from .kept_fraction_figure import kept_fraction_figure, new_figure, read_log_history
from .model_card import KEPT_FRACTION_PLOT

LAYOUTS_PLOT = "sparse_block_layouts.png"
PICTURES = ("kept_fraction", "layouts")
# Most layers / heads drawn when none are chosen: evenly spaced, first and last included.
DEFAULT_PANELS = 4


def block_coverage(layout: SparseLayout, k_len: int, head: int) -> torch.Tensor:
    """The share of every key block that each query block computes, for the first batch row and one query head.

    This is `layout.to_mask(...)` averaged over each key block (the rows of a query block share their
    keys), computed from the layout's indices without the [q_len, k_len] mask.

    Args:
        layout: a layout of one attention call.
        k_len: the number of keys of that call.
        head: the query head (any head of a layout shared by all heads).

    Returns:
        float [query blocks, key blocks] in [0, 1]: 1 for a listed block, the share of its tokens for
        key columns.
    """
    bs = layout.block_size
    nkb = -(-k_len // bs)
    h = head if layout.heads > 1 else 0
    listed = torch.zeros(layout.num_q_blocks, nkb + 1, dtype=torch.float64)  # (slot nkb: the unused index slots)
    listed.scatter_(1, torch.where(layout.valid_blocks()[0, h], layout.block_idx[0, h].long(), nkb).cpu(), 1.0)
    valid = layout.valid_cols()[0, h].cpu()
    columns = torch.zeros_like(listed).scatter_add_(
        1, torch.where(valid, layout.col_idx[0, h].long().cpu() // bs, nkb), valid.double())
    block_len = torch.full((nkb,), float(bs), dtype=torch.float64)
    block_len[-1] = k_len - (nkb - 1) * bs
    return listed[:, :nkb] + columns[:, :nkb] / block_len  # (a column never lies in a listed block)


@contextlib.contextmanager
def capturing_layouts(model: torch.nn.Module) -> Iterator[dict[int, SparseLayout]]:
    """Record the layout of every `sparse_cp` attention call of `model` inside the block.

    Yields:
        layer index -> the layout (on the CPU) of that layer's last call in the block; filled as the model
        runs. Dense calls are captured too: inside the block they run on the plugin's kernels, not flash-attn.
    """
    captured: dict[int, SparseLayout] = {}
    running: list[int] = []  # layer indices of the modules being run, innermost last

    def enter(module, args) -> None:
        running.append(module.layer_idx)

    def leave(module, args, output) -> None:  # (a hook that returns something replaces the output)
        running.pop()

    handles = []
    for module in model.modules():
        if isinstance(getattr(module, "layer_idx", None), int):
            handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]
    layout_of = sequence.sequence_layout  # (estimated, or the dense layout of a dense call: every layer's)

    def recording(*args, **kwargs) -> SparseLayout:
        layout = layout_of(*args, **kwargs)
        captured[running[-1] if running else len(captured)] = layout.to("cpu")
        return layout

    patches = PatchSet()
    patches.set_attr(sequence, "sequence_layout", recording)
    # a dense call taken by flash-attn builds no layout; the documented switch keeps it on the kernels
    patches.set_item(os.environ, DENSE_BACKEND_ENV, "kernels")
    try:
        yield captured
    finally:
        patches.undo()
        for handle in handles:
            handle.remove()


def capture_layouts(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[int, SparseLayout]:
    """The layout of every layer for one forward of `model` (selecting `sparse_cp`) on `input_ids` [1, S]."""
    with capturing_layouts(model) as captured, torch.no_grad():
        model(input_ids=input_ids.to(model.device), use_cache=False)
    if not captured:
        raise ValueError("The forward ran no sparse_cp attention call: load the model with "
                         "attn_implementation='sparse_cp' (after hf_sparse_cp.patch()).")
    return dict(sorted(captured.items()))


def spread(count: int) -> list[int]:
    """Up to `DEFAULT_PANELS` evenly spaced indices of `count`, first and last included."""
    if count <= DEFAULT_PANELS:
        return list(range(count))
    return sorted({round(i * (count - 1) / (DEFAULT_PANELS - 1)) for i in range(DEFAULT_PANELS)})


def _check_choice(chosen: Sequence[int], available: Sequence[int], what: str, flag: str) -> None:
    wrong = [i for i in chosen if i not in available]
    if wrong:
        raise ValueError(f"{what} {wrong} do not exist: the model has {what} {available[0]} to {available[-1]}; "
                         f"choose them with {flag}, e.g. {flag} {available[0]},{available[-1]}.")


def layout_figure(
    layouts: dict[int, SparseLayout],
    seq_len: int,
    num_heads: int,
    *,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    title: str | None = None,
):
    """Draw block layouts: one panel per chosen layer (rows) and query head (columns).

    Args:
        layouts: layer index -> layout of one call on a single sequence (`capture_layouts`).
        seq_len: the tokens of that sequence.
        num_heads: the model's query heads.
        layers, heads: which to draw (default: up to 4 evenly spaced of each).
        title: the figure's title.

    Returns:
        The matplotlib `Figure`; each panel's title names its layer, head and kept fraction of causal blocks.
    """
    from matplotlib import colormaps
    from matplotlib.colors import PowerNorm
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    available = sorted(layouts)
    layers = [available[i] for i in spread(len(available))] if layers is None else list(layers)
    heads = spread(num_heads) if heads is None else list(heads)
    _check_choice(layers, available, "layers", "--layers")
    _check_choice(heads, range(num_heads), "heads", "--heads")
    first = layouts[available[0]]
    fig = new_figure(figsize=(max(2.9 * len(heads) + 1.6, 6.4), 2.9 * len(layers) + 1.5), layout="constrained")
    axes = fig.subplots(len(layers), len(heads), squeeze=False)
    # computed blocks dark, skipped ones white, the keys after each query (never visible) gray
    cmap = colormaps["Blues"].with_extremes(bad="#c8c8c8")
    # a key column is 1/block_size of a block: a power scale keeps such blocks visibly blue
    norm = PowerNorm(gamma=0.3, vmin=0, vmax=1)
    after_query = torch.ones(first.num_q_blocks, -(-seq_len // first.block_size), dtype=torch.bool).triu(1)
    causal_blocks = (~after_query).sum().item()
    image = None
    for r, layer in enumerate(layers):
        for c, head in enumerate(heads):
            coverage = block_coverage(layouts[layer], seq_len, head)
            kept = coverage.masked_fill(after_query, 0).sum().item() / causal_blocks
            ax = axes[r, c]
            image = ax.imshow(coverage.masked_fill(after_query, float("nan")).numpy(), cmap=cmap, norm=norm,
                              interpolation="nearest")
            ax.set_title(f"layer {layer}, head {head}: {kept:.0%} kept", fontsize="medium")
            ax.set_xlabel("key block")
            ax.set_ylabel("query block")
            for axis in (ax.xaxis, ax.yaxis):  # (block indices: a few blocks drew ticks at 0.5, 1.5, ...)
                axis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(image, ax=axes, shrink=0.8 if len(layers) > 1 else 1.0,
                 label="share of the key block computed (power scale)")
    fig.legend(handles=[Patch(facecolor=cmap(1.0), label="computed"),
                        Patch(facecolor=cmap(0.0), edgecolor="#999999", label="skipped"),
                        Patch(facecolor="#c8c8c8", label="after the query (causal)")],
               loc="outside lower center", ncols=3, fontsize="small")
    if title:
        fig.suptitle(title)
    return fig


def find_model(run_dir: str | Path) -> Path:
    """The saved model of a run: `run_dir` itself, else its last complete checkpoint. FileNotFoundError naming the
    fix."""
    run_dir = Path(run_dir)
    for folder in (run_dir, newest_complete_checkpoint([run_dir])[0]):
        if folder is not None and any((folder / name).is_file() for name in ("config.json", ADAPTER_CONFIG)):
            return folder
    raise FileNotFoundError(
        f"No saved model (config.json, or a PEFT adapter's {ADAPTER_CONFIG}) in {str(run_dir)!r} or its checkpoints: "
        "save it (trainer.save_model(), "
        "`hf-sparse-cp train --save_final_model`, or --save_steps N), pass --model PATH_OR_HUB_ID, or draw the kept "
        "fraction alone with --only kept_fraction."
    )


def missing_model(path: str | Path, hub: str) -> str:
    """The refusal of `--model PATH` where PATH is no folder here: both causes, the missing folder (or a file there)
    and `hub`, why the Hub gave no model of that name (not a Hub id; what the Hub answered)."""
    what = "a file here, not a folder" if Path(str(path)).exists() else "no such folder here"
    return f"--model {path}: {what}, {hub}; give the folder of a saved model (config.json), or its Hub id."


def load_sparse_model(path: str | Path, sparse_config: str | Path | None = None):
    """A causal LM from `path` (a directory or hub id) selecting `sparse_cp`, in eval mode.

    Args:
        path: where the model is; the pattern it was trained with is in its config.json. A folder holding a
            PEFT adapter loads its base model with the adapter (transformers reads adapter_config.json), and needs
            `sparse_config`: an adapter saves no pattern.
        sparse_config: a YAML/JSON `SparseAttentionConfig` to draw instead (a model saved without one gets
            the defaults).

    Returns:
        The model. The backend must be registered (`hf_sparse_cp.patch()`). OSError naming both causes where
        `path` is no folder here and the Hub gave no model of that name (`missing_model`).
    """
    from transformers import AutoModelForCausalLM

    if sparse_config is None and (Path(str(path)) / ADAPTER_CONFIG).is_file():
        # (the base model's config.json holds no pattern, or that of the run that saved the base: not this one's)
        raise ValueError(f"{str(path)!r} holds a PEFT adapter ({ADAPTER_CONFIG}), which saves no sparse pattern: "
                         "save the pattern the run's model card (README.md) states, its YAML block, to a file and "
                         "pass it with --sparse_config FILE.")
    if (Path(str(path)) / ADAPTER_CONFIG).is_file() and adapter_base(Path(str(path)) / ADAPTER_CONFIG) is None:
        # (transformers would look for a base model of that name on the Hub: "couldn't connect to huggingface.co")
        raise ValueError(f"{str(path)!r} holds a PEFT adapter whose {ADAPTER_CONFIG} names no base model "
                         "(base_model_name_or_path; a model built from a config has none): set it to the base "
                         "model's folder, or merge the adapter (merge_and_unload), save the model and pass its "
                         "folder with --model.")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sparse_cp")
    except OSError as e:
        if Path(str(path)).is_dir():
            raise
        # (transformers' error named neither the flag nor the folder: "We couldn't connect to huggingface.co" offline)
        raise OSError(missing_model(path, f"and the Hub could not provide it either ({str(e).splitlines()[0]})")
                      ) from None
    if sparse_config is not None:
        configure(model, SparseAttentionConfig.from_file(pattern_path(str(sparse_config))))
    elif SparseAttentionConfig.stored_on(model.config) is None:
        configure(model)
    return model.eval()


def sample_ids(tokenizer, text_file: str | Path | None = None, seq_len: int | None = None) -> torch.Tensor:
    """Token ids [1, S] to draw the layouts for: the last `seq_len` tokens of a text file (all of it when
    None), or a synthetic passkey-retrieval sample of `seq_len` tokens."""
    if text_file is not None:
        ids = tokenizer(Path(text_file).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        ids = ids[-seq_len:] if seq_len else ids
        if len(ids) < 2:
            raise ValueError(f"{str(text_file)!r} holds {len(ids)} token(s); give a longer text.")
        return torch.tensor([ids])
    try:
        from ..examples.passkey import passkey_dataset
    except ImportError:
        raise ImportError("The synthetic passkey sample needs `datasets`: pip install 'hf-sparse-cp[demo]', or "
                          "draw the layouts for a text of yours with --text_file PATH.") from None
    return torch.tensor([passkey_dataset(tokenizer, 1, seq_len)[0]["input_ids"]])


def plot_run(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    only: str | None = None,
    model: str | Path | None = None,
    text_file: str | Path | None = None,
    seq_len: int | None = None,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    sparse_config: str | Path | None = None,
) -> dict[Path, object]:
    """Draw a run's pictures and save them as PNG (what `hf-sparse-cp plot` does).

    Args:
        run_dir: the run's output or checkpoint directory (its trainer_state.json, or its last checkpoint's).
        out_dir: where the PNGs go (default: `run_dir`, beside the model card).
        only: "kept_fraction" or "layouts" to draw one picture (default: both).
        model: the model for the layouts (default: the one saved in `run_dir` or its last checkpoint).
        text_file: draw the layouts for this text (default: a synthetic passkey sample).
        seq_len: tokens of the input (default: the whole text; for the passkey sample, 4096 or the pattern's
            `min_seq_len` if longer, so that the pattern is sparse).
        layers, heads: the layers and query heads to draw (default: up to 4 evenly spaced).
        sparse_config: draw the layouts of this `SparseAttentionConfig` file instead of the model's own.

    Returns:
        PNG path -> the matplotlib `Figure` saved there: `sparse_kept_fraction.png` and
        `sparse_block_layouts.png`.
    """
    if only is not None and only not in PICTURES:
        raise ValueError(f"only={only!r}: choose one of {PICTURES}, or None for both.")
    require_matplotlib()
    run_dir = Path(run_dir)
    out_dir = run_dir if out_dir is None else Path(out_dir)
    figures = {}
    if only in (None, "kept_fraction"):
        figures[out_dir / KEPT_FRACTION_PLOT] = kept_fraction_figure(
            read_log_history(run_dir), title=f"Sparse attention during training ({run_dir.name})")
    if only in (None, "layouts"):
        figures[out_dir / LAYOUTS_PLOT] = _layouts_of(model or find_model(run_dir), text_file, seq_len, layers, heads,
                                                      sparse_config)
    out_dir.mkdir(parents=True, exist_ok=True)
    for path, figure in figures.items():
        figure.savefig(path, dpi=110)
    return figures


def _tokenizer_source(folder: Path) -> Path:
    """Where the tokenizer of the model at `folder` is: the folder, or, for a PEFT adapter saved without one
    (`model.save_pretrained` saves none), the base model that adapter_config.json names."""
    if (folder / ADAPTER_CONFIG).is_file() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        base = adapter_base(folder / ADAPTER_CONFIG)
        return Path(base) if base else folder
    return folder


def _layouts_of(model_path, text_file, seq_len, layers, heads, sparse_config):
    """The layout figure of one forward of the model at `model_path` (see `plot_run`)."""
    from transformers import AutoTokenizer

    registered = is_patched()
    patch()
    try:
        model = load_sparse_model(model_path, sparse_config)
        # refused before the forward, not after it
        _check_choice(layers or [], range(language_config(model.config).num_hidden_layers), "layers", "--layers")
        _check_choice(heads or [], range(language_config(model.config).num_attention_heads), "heads", "--heads")
        fix = ("save it with the model (Trainer(processing_class=tokenizer) saves it with every checkpoint), or draw "
               "the kept fraction alone with --only kept_fraction")
        source = _tokenizer_source(Path(str(model_path)))
        if source.is_dir() and not any((source / name).is_file() for name in TOKENIZER_FILES):
            # (transformers would build an empty tokenizer of the model's type, which encodes nothing)
            raise FileNotFoundError(f"No tokenizer with the model in {str(source)!r} (no "
                                    f"{' or '.join(TOKENIZER_FILES)}); {fix}.")
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(source))
        except (OSError, ValueError) as e:
            raise FileNotFoundError(f"No tokenizer with the model in {str(source)!r} ({e}); {fix}.") from None
        pattern = SparseAttentionConfig.stored_on(model.config)
        positions = learned_positions(model)  # (GPT-2's 1,024: its forward takes no longer input)
        if text_file is None and seq_len is None:
            seq_len = min(max(4096, pattern.min_seq_len), positions or math.inf)
        ids = sample_ids(tokenizer, text_file, seq_len)
        if positions is not None and ids.shape[1] > positions:
            raise ValueError(f"{ids.shape[1]:,} tokens to draw, and the model learns {positions:,} positions (its "
                             "position embeddings): a longer input fails in its forward. Give --max_length "
                             f"{positions} or less" + (" (the text's last tokens)." if text_file else "."))
        layouts = capture_layouts(model, ids)
    finally:
        if not registered:
            unpatch()
    source = "passkey sample" if text_file is None else Path(text_file).name
    title = (f"Block layouts of sparse_cp attention\n{Path(str(model_path)).name}: {ids.shape[1]:,} tokens "
             f"({source}), blocks of {pattern.block_size}")
    return layout_figure(layouts, ids.shape[1], model.config.num_attention_heads, layers=layers, heads=heads,
                         title=title)
