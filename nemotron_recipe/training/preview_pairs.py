"""What a DPO run trains on: each preference pair's two sequences as the trainer collates them.

DPO collates pair `i`'s halves as sequences `i` (chosen) and `len(pairs) + i` (rejected) of
`PreferencePairs.sequences`, through `collate`; the preview renders those same sequences through the
same function (`preview_examples`), so a half's trained mask is the one its summed log-prob reads.
The prompt is what the halves share before either one's first trained token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from nemotron_recipe.data import IGNORE_INDEX
from nemotron_recipe.data.preference import PreferenceData, PreferencePairs
from nemotron_recipe.training.preview import (
    CLOSE,
    OPEN,
    PreviewExample,
    marked_text,
    preview_examples,
    sequence_record,
)

HALVES = ("chosen", "rejected")


@dataclass
class PreviewPair:
    index: int
    chosen: PreviewExample
    rejected: PreviewExample

    @property
    def prompt_length(self) -> int:
        """Tokens the halves share before the first trained one of either."""
        first = min(e.trained_mask.index(True) if any(e.trained_mask) else len(e.tokens)
                    for e in (self.chosen, self.rejected))
        n = 0
        while n < first and self.chosen.tokens[n] == self.rejected.tokens[n]:
            n += 1
        return n


def preview_pairs(pairs: PreferencePairs, indices: Sequence[int], seq_len: int, pad_id: int) -> list[PreviewPair]:
    out = []
    for i in indices:
        chosen, rejected = preview_examples(pairs.sequences, [i, len(pairs) + i], seq_len, pad_id)
        out.append(PreviewPair(i, chosen, rejected))
    return out


def pairs_summary(name: str, pairs: PreferencePairs, seq_len: int) -> dict[str, Any]:
    """Counts over a whole split: trained and total tokens of both halves, and what the checks left out."""
    seqs = pairs.sequences
    trained = sum(sum(t != IGNORE_INDEX for t in row) for row in seqs.targets)
    return {"split": name, **pairs.counts(), "trained_tokens": trained,
            "total_tokens": sum(len(row) for row in seqs.input_ids), "seq_len": seq_len}


def _summaries(data: PreferenceData, seq_len: int) -> list[dict[str, Any]]:
    return [pairs_summary(name, p, seq_len) for name, p in (("train", data.train), ("val", data.val)) if p is not None]


def pairs_as_json(shown: list[PreviewPair], tok: PreTrainedTokenizerBase, data: PreferenceData, seq_len: int) -> str:
    records = [{"index": p.index, "prompt": tok.decode(p.chosen.tokens[: p.prompt_length]),
                **{h: sequence_record(getattr(p, h), tok) for h in HALVES}} for p in shown]
    return json.dumps({"format": data.formatter, "pairs": records, "summary": _summaries(data, seq_len)},
                      indent=1, ensure_ascii=False)


def pairs_as_text(shown: list[PreviewPair], tok: PreTrainedTokenizerBase, data: PreferenceData, seq_len: int,
                  *, color: bool, split: str) -> str:
    lines = [f"{data.formatter}; preference pairs; trained text (summed into each half's log-prob) between "
             f"{OPEN} and {CLOSE}"]
    for p in shown:
        n = p.prompt_length
        lines.append(f"--- {split} pair {p.index} ---")
        lines.append("prompt:")
        lines.append(marked_text(p.chosen, 0, n, tok, color))
        for h in HALVES:
            e = getattr(p, h)
            lines.append(f"{h}: {len(e.tokens)} tokens, {sum(e.trained_mask)} trained")
            lines.append(marked_text(e, n, len(e.tokens), tok, color))
    lines.append("---")
    for s in _summaries(data, seq_len):
        share = s["trained_tokens"] / max(s["total_tokens"], 1)
        lines.append(
            f"{s['split']}: {s['pairs']} pairs; {s['trained_tokens']} of {s['total_tokens']} tokens trained "
            f"({share:.1%}, both halves); {s['truncated']} with a response cut at seq_len={seq_len}, "
            f"{s['prompt_too_long']} dropped as their prompt leaves no response token, {s['dropped']} dropped as "
            f"longer, {s['identical']} dropped as chosen equals rejected"
        )
    return "\n".join(lines)
