"""The figure of the kept fraction of attention blocks per layer that a Trainer logged, and the logs it reads.

`SparsityLoggingCallback` writes `sparse/kept_fraction/layer_NN` (and their mean, `sparse/kept_fraction`)
into every log of the Trainer, so they end up in `state.log_history` and in the `trainer_state.json` of
every checkpoint. This module turns them into per-layer series and means (for the model card) and into a
figure (for the card and `hf-sparse-cp plot`).

matplotlib is optional (`pip install 'hf-sparse-cp[plot]'`) and imported only when a figure is drawn. The
figures are built on `matplotlib.figure.Figure` directly, without pyplot: no global backend is chosen and
no figure stays registered after it is saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..backends import require_matplotlib
from ..checkpoint_marker import newest_complete_checkpoint
from ..config.files import read_mapping
from ..integration.stats import LAYER_LOG_KEY  # what `SparsityLoggingCallback` logs (layer -1: no layer index)

TRAINER_STATE = "trainer_state.json"


def kept_fraction_series(log_history: list[dict[str, Any]]) -> dict[int, tuple[list[int], list[float]]]:
    """The logged kept fraction of every layer over training.

    Args:
        log_history: a Trainer's `state.log_history` (or the `log_history` of a trainer_state.json).

    Returns:
        layer index -> (steps, kept fractions), layers in ascending order; empty when nothing was logged. The logs of
        training only: an evaluation's (its `eval_` keys) holds the kept fraction of its own forwards.
    """
    series: dict[int, tuple[list[int], list[float]]] = {}
    for entry in log_history:
        if any(key.startswith("eval_") for key in entry):
            continue
        for key, value in entry.items():
            match = LAYER_LOG_KEY.match(key)
            if match:
                steps, values = series.setdefault(int(match.group(1)), ([], []))
                steps.append(int(entry.get("step", len(steps))))
                values.append(float(value))
    return dict(sorted(series.items()))


def mean_kept_fraction_per_layer(log_history: list[dict[str, Any]]) -> dict[int, float]:
    """layer index -> the mean of its logged kept fractions (each log weighs the same)."""
    return _mean_per_layer(kept_fraction_series(log_history))


def _mean_per_layer(series: dict[int, tuple[list[int], list[float]]]) -> dict[int, float]:
    return {layer: sum(values) / len(values) for layer, (_, values) in series.items()}


def find_trainer_state(run_dir: str | Path) -> Path:
    """The trainer_state.json of a run: in `run_dir` itself (a checkpoint, or an output directory after
    `trainer.save_state()`), else in its last complete checkpoint. Raises FileNotFoundError naming the fix."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{str(run_dir)!r} is not a directory; give a Trainer output or checkpoint directory.")
    for folder in (run_dir, newest_complete_checkpoint([run_dir])[0]):
        if folder is not None and (folder / TRAINER_STATE).is_file():
            return folder / TRAINER_STATE
    raise FileNotFoundError(
        f"No {TRAINER_STATE} in {str(run_dir)!r} or in a checkpoint-N folder inside it: the Trainer writes one with "
        "every checkpoint (--save_steps N) and with trainer.save_state() at the end of a run."
    )


def read_log_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """The `log_history` of the trainer_state.json that `find_trainer_state(run_dir)` finds; a ValueError
    naming the file when it cannot be read (e.g. cut off by a run that died while writing it)."""
    path = find_trainer_state(run_dir)
    try:
        state = read_mapping(path, "the Trainer's state", kind="Trainer state file")
    except ValueError as e:
        raise ValueError(f"{str(e).rstrip('.')}. It may have been cut off while being written: plot an earlier "
                         "checkpoint-N folder of the run instead.") from None
    if not isinstance(state.get("log_history"), list):
        raise ValueError(f"Trainer state file {str(path)!r} has no log_history list; give the trainer_state.json "
                         "a Trainer wrote.")
    return state["log_history"]


def new_figure(**kwargs):
    """A `matplotlib.figure.Figure(**kwargs)` (see `require_matplotlib` when matplotlib is missing)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def _layer_colors(layers: list[int]):
    """One color per layer, from early (dark) to late (bright) layers."""
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    span = max(len(layers) - 1, 1)
    return {layer: cmap(0.9 * i / span) for i, layer in enumerate(layers)}


def kept_fraction_figure(log_history: list[dict[str, Any]], title: str | None = None):
    """Draw the kept fraction per layer: over the logged steps (left) and its mean per layer (right).

    Args:
        log_history: a Trainer's log history holding `sparse/kept_fraction/layer_NN` keys.
        title: the figure's title (default: none).

    Returns:
        The matplotlib `Figure` (two axes); save it with `fig.savefig(path)`. Raises ValueError when the
        history holds no kept fraction.
    """
    series = kept_fraction_series(log_history)
    if not series:
        raise ValueError(
            "The log history holds no sparse/kept_fraction/layer_NN values: train with the sparse_cp backend and "
            "--sparse_log_sparsity (attach_to_trainer adds the logging callback), with logging_steps reached at least "
            "once."
        )
    layers = list(series)
    colors = _layer_colors(layers)
    fig = new_figure(figsize=(12, 4.4), layout="constrained")
    over_steps, per_layer = fig.subplots(1, 2, width_ratios=(3, 2))
    few_points = max(len(steps) for steps, _ in series.values()) <= 30
    for layer, (steps, values) in series.items():
        over_steps.plot(steps, values, color=colors[layer], marker="o" if few_points else None, markersize=3,
                        linewidth=1.2, label=f"layer {layer}")
    mean_by_step: dict[int, list[float]] = {}
    for steps, values in series.values():
        for step, value in zip(steps, values):
            mean_by_step.setdefault(step, []).append(value)
    mean_steps = sorted(mean_by_step)
    over_steps.plot(mean_steps, [sum(mean_by_step[s]) / len(mean_by_step[s]) for s in mean_steps], color="black",
                    linestyle="--", linewidth=2, label="mean over layers")
    over_steps.set(title="Kept fraction of attention blocks per layer", xlabel="optimizer step",
                   ylabel="kept fraction (of the dense blocks)", ylim=(0, 1.02))
    over_steps.xaxis.get_major_locator().set_params(integer=True)  # steps, not fractions of one
    over_steps.grid(alpha=0.3)
    # a legend entry per layer stays readable up to a dozen layers; beyond, the bar chart names them
    handles, labels = over_steps.get_legend_handles_labels()
    many = len(layers) > 12
    if many:
        handles, labels = handles[-1:], labels[-1:]
    over_steps.legend(handles, labels, fontsize="small", ncols=1 + len(handles) // 7, loc="best",
                      title="layer colors: as on the right" if many else None, title_fontsize="small")

    means = _mean_per_layer(series)
    overall = sum(means.values()) / len(means)
    per_layer.bar([str(layer) for layer in means], list(means.values()), color=[colors[layer] for layer in means])
    per_layer.axhline(overall, color="black", linestyle="--", linewidth=1.5, label=f"mean {overall:.3f}")
    per_layer.set(title="Mean kept fraction per layer", xlabel="layer", ylabel="mean kept fraction", ylim=(0, 1.02))
    if len(means) > 16:  # keep the layer labels from overlapping
        per_layer.tick_params(axis="x", labelsize="x-small", labelrotation=90)
    per_layer.grid(axis="y", alpha=0.3)
    per_layer.legend(fontsize="small", loc="upper right")
    if title:
        fig.suptitle(title)
    return fig
