"""What a run trains on: its sequences as the training loop receives them, with their trained tokens.

The examples come from `load_training_data` (chat format, reasoning option, length policy, packing)
and each one goes through `collate`, the function that builds the trainer's micro-batches, so the
mask shown is the one the loss applies. A token is trained when it is the target of the position
before it: `trained_mask[t] = targets[t - 1] != IGNORE_INDEX`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from nemotron_recipe.data import (
    IGNORE_INDEX,
    GlobalBatchPlan,
    SFTData,
    SFTExamples,
    collate,
)

FORMATS = ("text", "json")
SPLITS = ("train", "val")
OPEN, CLOSE = "[[", "]]"  # around trained text, so the marks read without colour
_GREEN, _RESET = "\033[32m", "\033[0m"


@dataclass
class PreviewExample:
    index: int
    tokens: list[int]
    trained_mask: list[bool]
    document_lengths: list[int] | None

    def documents(self) -> list[tuple[int, int]]:
        """(start, end) of each document laid in the sequence; one for an unpacked sequence."""
        lengths = self.document_lengths or [len(self.tokens)]
        starts = [sum(lengths[:k]) for k in range(len(lengths))]
        return [(s, s + n) for s, n in zip(starts, lengths)]

    def runs(self, lo: int, hi: int) -> list[tuple[list[int], bool]]:
        """Consecutive tokens in [lo, hi) with the same mark, so multi-byte characters decode whole."""
        out: list[tuple[list[int], bool]] = []
        for tok, trained in zip(self.tokens[lo:hi], self.trained_mask[lo:hi]):
            if out and out[-1][1] == trained:
                out[-1][0].append(tok)
            else:
                out.append(([tok], trained))
        return out


def training_order(num_examples: int, cfg: Any, n: int) -> list[int]:
    """The first `n` example indices in the order training's optimizer steps read them (over all ranks)."""
    t = cfg.trainer
    plan = GlobalBatchPlan(num_examples, t.global_batch_size, t.micro_batch_size, 0, 1, cfg.seed)
    n = min(n, num_examples)  # one epoch at most: later epochs show the same sequences again
    order: list[int] = []
    step = 0
    while len(order) < n:
        order += plan.global_indices_for_step(step)
        step += 1
    return order[:n]


def preview_examples(examples: SFTExamples, indices: Sequence[int], seq_len: int, pad_id: int) -> list[PreviewExample]:
    out = []
    for idx in indices:
        batch = collate(examples, [idx], seq_len, pad_id)
        length = len(examples.input_ids[idx])
        ids = batch["input_ids"][0, :length].tolist()
        targets = batch["targets"][0, :length]
        mask = [False] + (targets[:-1] != IGNORE_INDEX).tolist()
        lengths = None if examples.document_lengths is None else list(examples.document_lengths[idx])
        out.append(PreviewExample(idx, ids, mask, lengths))
    return out


def split_summary(name: str, ex: SFTExamples, seq_len: int) -> dict[str, Any]:
    """Counts over a whole split: tokens trained and total, and rows cut, left out or carrying reasoning."""
    trained = sum(sum(t != IGNORE_INDEX for t in row) for row in ex.targets)
    total = sum(len(row) for row in ex.input_ids)
    return {"split": name, "sequences": len(ex), "documents": ex.num_documents, "trained_tokens": trained,
            "total_tokens": total, "truncated": ex.num_truncated, "dropped": ex.num_dropped,
            "skipped": ex.num_skipped, "with_reasoning": ex.num_reasoning, "seq_len": seq_len}


def summaries(data: SFTData, seq_len: int) -> list[dict[str, Any]]:
    return [split_summary(name, ex, seq_len) for name, ex in (("train", data.train), ("val", data.val))
            if ex is not None]


def sequence_record(e: PreviewExample, tok: PreTrainedTokenizerBase) -> dict[str, Any]:
    """A sequence as JSON shows it: its text, the trained part's text, its tokens and their mask."""
    trained = [t for t, m in zip(e.tokens, e.trained_mask) if m]
    return {"text": tok.decode(e.tokens), "trained_text": tok.decode(trained), "tokens": e.tokens,
            "trained_mask": [int(m) for m in e.trained_mask]}


def as_json(examples: list[PreviewExample], tok: PreTrainedTokenizerBase, data: SFTData, seq_len: int) -> str:
    records = []
    for e in examples:
        record = {"index": e.index, **sequence_record(e, tok)}
        if e.document_lengths is not None:
            record["document_lengths"] = e.document_lengths
        records.append(record)
    return json.dumps({"format": data.formatter, "examples": records, "summary": summaries(data, seq_len)},
                      indent=1, ensure_ascii=False)


def marked_text(e: PreviewExample, lo: int, hi: int, tok: PreTrainedTokenizerBase, color: bool) -> str:
    """Tokens [lo, hi) of `e` decoded, trained runs between the marks (and green under `color`)."""
    body = ""
    for run, is_trained in e.runs(lo, hi):
        text = tok.decode(run)
        body += f"{_GREEN if color else ''}{OPEN}{text}{CLOSE}{_RESET if color else ''}" if is_trained else text
    return body


def as_text(examples: list[PreviewExample], tok: PreTrainedTokenizerBase, data: SFTData, seq_len: int,
            *, color: bool, split: str) -> str:
    lines = [f"{data.formatter}; trained text between {OPEN} and {CLOSE}"]
    for e in examples:
        trained = sum(e.trained_mask)
        docs = "" if e.document_lengths is None else f", {len(e.document_lengths)} packed documents"
        lines.append(f"--- {split} sequence {e.index}: {len(e.tokens)} tokens, {trained} trained{docs} ---")
        for k, (lo, hi) in enumerate(e.documents()):
            if e.document_lengths is not None:
                lines.append(f"~~~ document {k + 1} of {len(e.document_lengths)} ~~~")
            lines.append(marked_text(e, lo, hi, tok, color))
    lines.append("---")
    for s in summaries(data, seq_len):
        share = s["trained_tokens"] / max(s["total_tokens"], 1)
        lines.append(
            f"{s['split']}: {s['documents']} examples in {s['sequences']} sequences; {s['trained_tokens']} of "
            f"{s['total_tokens']} tokens trained ({share:.1%}); {s['truncated']} truncated to seq_len={seq_len}, "
            f"{s['dropped']} dropped as longer, {s['skipped']} skipped with nothing to train on; "
            f"{s['with_reasoning']} with reasoning traces"
        )
    return "\n".join(lines)
