"""SMET optimizer state and step time against AdamW on a small Llama-shaped model.

For AdamW and for SMET (`sparse_weights` mode) at each density (0.5, 0.25, 0.1, 0.05 by default):
the optimizer-state bytes after one step (exp_avg, exp_avg_sq, step; for SMET also the int16
block index and the int32 per-block step counter), over the whole model and over the matrices SMET
makes sparse (attention and MLP projections; embeddings and lm_head stay dense), and the median
time of `optimizer.step()` and of a whole training step (forward, backward, clipping, step).
Prints a table and writes JSON (device, versions, settings, rows) to benchmarks/results/.

    python benchmarks/bench_smet.py                      # hidden 320, 8 layers, vocab 8192
    python benchmarks/bench_smet.py --hidden_size 64 --num_hidden_layers 1 --vocab_size 64 --timed_steps 1

Runs on CPU or CUDA (`--device`). The default shape gives 20 blocks of 16 per row of the hidden-input
matrices and 80 per row of down_proj, so every density above is hit exactly.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import torch

from hf_sparse_cp.env import environment
from hf_sparse_cp.testing.benchmarking import write_report

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class BenchSMETArguments:
    hidden_size: int = field(default=320, metadata={"help": "Model width."})
    intermediate_size: int = field(default=1280, metadata={"help": "MLP width."})
    num_hidden_layers: int = field(default=8, metadata={"help": "Decoder layers."})
    num_attention_heads: int = field(default=5, metadata={"help": "Query heads (head_dim = hidden / heads)."})
    num_key_value_heads: int = field(default=5, metadata={"help": "Key/value heads."})
    vocab_size: int = field(
        default=8192,
        metadata={"help": "Vocabulary (dense embeddings and lm_head; with the defaults they hold 28%% of the weights, "
                  "about the share of a 1B Llama)."},
    )
    block_size: int = field(default=16, metadata={"help": "SMET block size."})
    densities: list[float] = field(
        default_factory=lambda: [0.5, 0.25, 0.1, 0.05], metadata={"help": "SMET densities to measure."}
    )
    batch_size: int = field(default=2, metadata={"help": "Sequences per training step."})
    seq_len: int = field(default=128, metadata={"help": "Tokens per sequence."})
    warmup_steps: int = field(default=2, metadata={"help": "Untimed steps first."})
    timed_steps: int = field(default=5, metadata={"help": "Timed steps; medians are reported."})
    device: str = field(default="auto", metadata={"help": "'cuda', 'cpu' or 'auto' (cuda when available)."})
    dtype: str = field(default="float32", metadata={"help": "Parameter dtype: float32 or bfloat16."})
    seed: int = field(default=0, metadata={"help": "Seed of the random init and tokens."})
    output: str | None = field(
        default=None, metadata={"help": "JSON path; default benchmarks/results/smet_<device>_<date>.json."}
    )

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r}; use float32 or bfloat16.")
        if self.timed_steps < 1 or self.warmup_steps < 0:
            raise ValueError("timed_steps must be >= 1 and warmup_steps >= 0.")


def build_model(args: BenchSMETArguments, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.testing.tiny_models import tiny_config

    config = tiny_config(
        "llama",
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        head_dim=args.hidden_size // args.num_attention_heads,
        max_position_embeddings=max(args.seq_len, 64),
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config).to(device=device, dtype=getattr(torch, args.dtype))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args: BenchSMETArguments, device: torch.device, density: float | None) -> tuple[dict, dict[str, int]]:
    """One row (AdamW when `density` is None, SMET at `density`) and the state bytes per parameter name."""
    from hf_sparse_cp.smet import SMETConfig, create_smet_optimizer, state_nbytes

    model = build_model(args, device)
    if density is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=device.type == "cuda")
    else:
        config = SMETConfig(density=density, block_size=args.block_size, update_interval=10**9)
        optimizer = create_smet_optimizer(model, torch.optim.AdamW, config, lr=1e-3)
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len), generator=gen).to(device)
    step_times, train_times = [], []
    for i in range(args.warmup_steps + args.timed_steps):
        _sync(device)
        start = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        _sync(device)
        before_step = time.perf_counter()
        optimizer.step()
        _sync(device)
        end = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if i >= args.warmup_steps:
            step_times.append(end - before_step)
            train_times.append(end - start)
    per_param = {name: state_nbytes(optimizer, [p]) for name, p in model.named_parameters()}
    row = {
        "optimizer": "adamw" if density is None else "smet",
        "density": None if density is None else density,
        "active_fraction": 1.0 if density is None else optimizer.trained_density(),
        "state_bytes": state_nbytes(optimizer),
        "optimizer_step_ms": 1e3 * statistics.median(step_times),
        "train_step_ms": 1e3 * statistics.median(train_times),
    }
    if density is not None:
        sparse = [p for g in optimizer.param_groups if g["smet"] for p in g["params"]]
        row["sparse_params"] = [n for g in optimizer.param_groups if g["smet"] for n in g["param_names"]]
        row["sparse_state_bytes"] = state_nbytes(optimizer, sparse)
        row["index_bytes"] = sum(
            optimizer.state[p][key].numel() * optimizer.state[p][key].element_size()
            for p in sparse for key in ("block_index", "block_step")
        )
    return row, per_param


def compare(rows: list[dict], adamw_per_param: dict[str, int]) -> list[dict]:
    """Ratios of every SMET row to AdamW: whole model, and over the matrices SMET makes sparse."""
    adam = rows[0]
    for row in rows[1:]:
        row["adamw_sparse_state_bytes"] = sum(adamw_per_param[n] for n in row.pop("sparse_params"))
        row["state_vs_adamw"] = row["state_bytes"] / adam["state_bytes"]
        row["sparse_state_vs_adamw"] = row["sparse_state_bytes"] / row["adamw_sparse_state_bytes"]
        row["optimizer_step_vs_adamw"] = row["optimizer_step_ms"] / adam["optimizer_step_ms"]
    return rows


def format_table(rows: list[dict]) -> str:
    mib = 2.0**20
    # AdamW's bytes over the matrices SMET makes sparse (the same set in every SMET row).
    adam_sparse = rows[1]["adamw_sparse_state_bytes"] if len(rows) > 1 else float("nan")
    lines = [
        f"{'optimizer':<9} {'density':>7} {'state MiB':>10} {'vs AdamW':>8} {'sparse MiB':>10} {'vs AdamW':>8} "
        f"{'index MiB':>9} {'step ms':>8} {'train ms':>9}"
    ]
    for row in rows:
        smet = row["optimizer"] == "smet"
        lines.append(
            f"{row['optimizer']:<9} {row['active_fraction']:>7.3f} {row['state_bytes'] / mib:>10.2f} "
            f"{row.get('state_vs_adamw', 1.0):>8.3f} "
            f"{(row['sparse_state_bytes'] if smet else adam_sparse) / mib:>10.2f} "
            f"{row.get('sparse_state_vs_adamw', 1.0):>8.3f} "
            f"{(row['index_bytes'] / mib if smet else 0.0):>9.3f} "
            f"{row['optimizer_step_ms']:>8.2f} {row['train_step_ms']:>9.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(BenchSMETArguments).parse_args_into_dataclasses(args=argv)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    env = environment(device)
    adam_row, adamw_per_param = measure(args, device, None)
    rows = compare([adam_row] + [measure(args, device, d)[0] for d in args.densities], adamw_per_param)
    print(f"SMET vs AdamW on {env['device']} (torch {env['torch']}, {args.dtype}); sparse = attention and MLP "
          "matrices, index = block index + per-block step counters")
    print(format_table(rows))
    report = {**env, "date": datetime.now().isoformat(timespec="seconds"), "settings": asdict(args), "rows": rows}
    write_report(report, RESULTS_DIR, "smet", args.output)
    return report


if __name__ == "__main__":
    main()
