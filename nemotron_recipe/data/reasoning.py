"""Reasoning traces in assistant turns: where the trace is, how it is rendered, and which of it trains.

An assistant turn carries its reasoning either inline, as `<think>…</think>` before the answer
(a leading `<think>` may be missing, as in data whose prompts opened the block), or in a
`reasoning_content` field beside `content`, the field the released Nemotron 3 template reads.

`data.reasoning` says what the final assistant turn's trace becomes:

- `train`: it stays in the text and in the loss;
- `answer_only`: it stays in the text (the answer is still conditioned on it) but no token of it is a
  target;
- `drop`: it is removed, and the turn renders as one that never had reasoning.

Whatever the value, assistant turns before the last user turn lose their reasoning, as the released
Nemotron 3 template renders history. An empty think block (no reasoning, or only whitespace) is never
a target unless `data.train_empty_think`: the Nemotron 3 template writes `<think></think>` into the
generation prompt when reasoning is off, so a model never has to produce it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .sources import REASONING_FIELD, REASONING_MODES, DataError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# A block as rendered text, its inner part as group 1; used on templates' output.
_BLOCK = re.compile(re.escape(THINK_OPEN) + "(.*?)" + re.escape(THINK_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class Trace:
    """An assistant turn split at its reasoning trace.

    `source`: "none" (no trace), "inline" (tags in the content) or "field" (`reasoning_content`).
    `answer` is the text after the closing tag as written, or the whole content.
    """

    reasoning: str
    answer: str
    source: str

    @property
    def has_reasoning(self) -> bool:
        return bool(self.reasoning.strip())


def split_trace(content: str, field: str | None, where: str) -> Trace:
    """Split one assistant turn's `content` (and its `reasoning_content`, if any) at the trace."""
    tagged = THINK_OPEN in content or THINK_CLOSE in content
    if field is not None and field.strip():
        if tagged:
            raise DataError(
                f"{where}: the assistant turn has both a {REASONING_FIELD!r} field and <think> tags in its content, "
                f"so its reasoning is given twice. Fix: keep one of them."
            )
        return Trace(reasoning=field, answer=content, source="field")
    if not tagged:
        return Trace(reasoning="", answer=content, source="none")
    opens, closes = content.count(THINK_OPEN), content.count(THINK_CLOSE)
    if closes != 1 or opens > 1:
        what = "never closed by </think>" if closes == 0 else f"holds {opens} <think> and {closes} </think> tags"
        raise DataError(
            f"{where}: the assistant turn's reasoning is {what}. Fix: write it as one "
            "<think>reasoning</think> block before the answer (or in a 'reasoning_content' field)."
        )
    before, answer = content.split(THINK_CLOSE)
    if opens:
        lead = before.lstrip()
        if not lead.startswith(THINK_OPEN):
            raise DataError(
                f"{where}: the assistant turn has text before its <think> block ({lead.split(THINK_OPEN)[0][:40]!r}). "
                "Fix: put the reasoning first, or the text into the answer after </think>."
            )
        before = lead[len(THINK_OPEN):]
    return Trace(reasoning=before, answer=answer, source="inline")


def trace_of(turn: dict[str, str], where: str) -> Trace:
    return split_trace(turn["content"], turn.get(REASONING_FIELD), where)


@dataclass(frozen=True)
class ReasoningPolicy:
    """`data.reasoning` and `data.train_empty_think`: what a turn's trace renders as and what of it trains."""

    mode: str = "train"
    train_empty_think: bool = False

    def __post_init__(self) -> None:
        if self.mode not in REASONING_MODES:
            raise DataError(f"data.reasoning={self.mode!r}: unknown value. Fix: use one of {list(REASONING_MODES)}.")

    def keeps(self, history: bool) -> bool:
        """Whether a turn's trace stays in the text: never in history, and not under `drop`."""
        return not history and self.mode != "drop"

    def block_trained(self, reasoning: str) -> bool:
        """Whether a kept think block with this inner text is a target."""
        if not reasoning.strip():
            return self.train_empty_think
        return self.mode == "train"


Piece = tuple[str, str]  # (text, kind): kind is "open", "reasoning", "close" or "answer"


def content_pieces(trace: Trace, *, keep: bool, empty_block: bool) -> list[Piece]:
    """An assistant turn's content as pieces.

    `keep`: the trace stays as written (a field trace as the Nemotron 3 template writes one). Otherwise it
    is removed: the answer alone, behind `<think></think>` when `empty_block` (a template that always
    writes the block, like Nemotron 3, which keeps history's answer as written after `</think>`).
    """
    if keep and trace.source == "field":
        # The released template's form, "<think>\n" R "\n</think>\n" A; the newline before A is its own
        # piece so history (everything after "</think>") keeps it exactly as that template does.
        return [(THINK_OPEN + "\n", "open"), (trace.reasoning, "reasoning"), ("\n" + THINK_CLOSE, "close"),
                ("\n" + trace.answer, "answer")]
    if keep and trace.source == "inline":
        # A newline right after the tag belongs to the opening, as in Nemotron 3's generation prompt "<think>\n".
        nl = "\n" if trace.reasoning.startswith("\n") else ""
        return [(THINK_OPEN + nl, "open"), (trace.reasoning[len(nl):], "reasoning"), (THINK_CLOSE, "close"),
                (trace.answer, "answer")]
    if not empty_block:
        return [(trace.answer.lstrip() if trace.source != "none" else trace.answer, "answer")]
    answer = trace.answer
    if trace.source == "field":
        answer = "\n" + answer
    return [(THINK_OPEN, "open"), ("", "reasoning"), (THINK_CLOSE, "close"), (answer, "answer")]


def strip_pieces(pieces: list[Piece]) -> list[Piece]:
    """`"".join(pieces).strip()`, keeping the pieces: Jinja's `trim` over a turn's content."""
    out = list(pieces)
    for order in (range(len(out)), range(len(out) - 1, -1, -1)):
        for i in order:
            text, kind = out[i]
            stripped = text.lstrip() if order.step == 1 else text.rstrip()
            out[i] = (stripped, kind)
            if stripped:
                break
    return out


def trained_kinds(pieces: list[Piece], policy: ReasoningPolicy, *, open_in_prompt: bool) -> set[str]:
    """Which piece kinds of a trained turn are targets. `open_in_prompt`: the format's generation prompt
    already ends with `<think>` (Nemotron 3's does), so a non-empty trace's opening tag is not generated."""
    reasoning = "".join(text for text, kind in pieces if kind == "reasoning")
    has_block = any(kind == "open" for _, kind in pieces)
    kinds = {"answer"}
    if has_block and policy.block_trained(reasoning):
        kinds |= {"reasoning", "close"}
        if not (open_in_prompt and reasoning.strip()):
            kinds.add("open")
    return kinds


def without_reasoning(turn: dict[str, str], trace: Trace) -> dict[str, str]:
    """The turn as a message that never had reasoning."""
    content = trace.answer.lstrip() if trace.source != "none" else trace.answer
    return {"role": turn["role"], "content": content}


def untrained_think_spans(text: str, lo: int, hi: int, policy: ReasoningPolicy) -> list[tuple[int, int, int, int]]:
    """Think blocks in `text[lo:hi]` (a trained region a template rendered) that must not train:
    `(block_start, block_end, inner_start, inner_end)` each."""
    out = []
    for m in _BLOCK.finditer(text, lo, hi):
        if not policy.block_trained(m.group(1)):
            out.append((m.start(), m.end(), m.start(1), m.end(1)))
    return out


def has_reasoning(turns: list[dict[str, str]]) -> bool:
    """Whether any assistant turn carries a non-empty reasoning trace (in tags or in the field)."""
    for t in turns:
        if t["role"] != "assistant":
            continue
        field = t.get(REASONING_FIELD)
        if field is not None and field.strip():
            return True
        if THINK_CLOSE in t["content"] and t["content"].split(THINK_CLOSE)[0].replace(THINK_OPEN, "").strip():
            return True
    return False


def last_user_index(turns: list[dict[str, str]]) -> int:
    return max((i for i, t in enumerate(turns) if t["role"] == "user"), default=-1)
