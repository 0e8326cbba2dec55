"""The tests' padding collator."""

import torch


def pad_collate(rows: list[dict], side: str = "right") -> dict:
    """Pads the batch to its longest row on `side` (attention_mask, labels -100), as DataCollatorForLanguageModeling."""
    n = max(len(r["input_ids"]) for r in rows)

    def padded(t, value):
        return torch.nn.functional.pad(t, (0, n - len(t)) if side == "right" else (n - len(t), 0), value=value)

    return {"input_ids": torch.stack([padded(r["input_ids"], 0) for r in rows]),
            "labels": torch.stack([padded(r["labels"], -100) for r in rows]),
            "attention_mask": torch.stack([padded(torch.ones_like(r["input_ids"]), 0) for r in rows])}
