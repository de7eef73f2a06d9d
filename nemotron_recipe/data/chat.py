"""Chat rendering: a conversation becomes token ids plus, per token, whether it is trained.

`encode_conversation` (and `ChatFormatter.encode`, its batched form) is the one place a conversation
becomes `(ids, trained)`; SFT rows, preference rows and `recipes.preview` all go through it.
`data.chat_template` picks the renderer:

- `nemotron3`: the released Nemotron 3 chat template's rendering (see `nemotron3.py`), with each
  assistant turn's pieces (reasoning, answer, end token) known by construction;
- `tokenizer`: the tokenizer's own `chat_template`, rendered by transformers; the trained tokens are the
  ones inside the template's `{% generation %}` blocks;
- a Jinja template string, or `auto` when the tokenizer has a template: each assistant turn is located
  as the text the template adds between "the conversation so far, with a generation prompt" and "the
  conversation through this turn"; tokens overlapping that text are trained. This needs no markers,
  only a template that renders a conversation prefix as a prefix of the whole;
- `builtin`, or `auto` without a template:
  `[BOS] ([<|system|>] system) <|user|> user <|assistant|> assistant EOS <|user|> ...`, with role
  tokens used when the vocabulary has them. Trained tokens are each assistant turn's content and EOS.

Reasoning traces are handled the same way by all of them (see `reasoning.py`): history loses its
reasoning before rendering, `drop` removes the final turn's, and within a trained turn the trace's
tokens train only under `train`, an empty block only with `data.train_empty_think`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from transformers import PreTrainedTokenizerBase

from . import nemotron3
from .reasoning import (
    REASONING_FIELD,
    ReasoningPolicy,
    content_pieces,
    last_user_index,
    trace_of,
    trained_kinds,
    untrained_think_spans,
    without_reasoning,
)
from .sources import TRAIN_ON, DataError

USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SYSTEM_TOKEN = "<|system|>"
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")

Turns = list[dict[str, str]]


class Encoded(NamedTuple):
    """One rendered conversation: token ids, and per token whether it is a training target."""

    ids: list[int]
    trained: list[bool]


def _trained_turns(turns: Turns, train_on: str) -> set[int]:
    assistant = [i for i, t in enumerate(turns) if t["role"] == "assistant"]
    if train_on == "last_assistant":
        return set(assistant[-1:])
    return set(assistant)


def _overlaps(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    # A token is trained when its text overlaps a trained span: BPE may glue a space of a template's header
    # onto the first word of the reply, and that token must still be learned.
    return [any(start < hi and end > lo for lo, hi in spans) for start, end in offsets]


class ChatFormatter:
    """Encodes conversations (lists of `{"role", "content"}` turns, assistant turns optionally with
    `reasoning_content`) for training.

    `template`: one of `CHAT_TEMPLATES` or a Jinja chat template. `train_on`: "assistant" (every
    assistant turn), "last_assistant" (only the final one) or "all" (every token). `reasoning` and
    `train_empty_think`: see `reasoning.py`.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str = "auto", train_on: str = "assistant",
                 reasoning: str = "train", train_empty_think: bool = False):
        if train_on not in TRAIN_ON:
            raise DataError(f"data.train_on={train_on!r}: unknown value. Fix: use one of {list(TRAIN_ON)}.")
        self.tokenizer = tokenizer
        self.train_on = train_on
        self.policy = ReasoningPolicy(reasoning, train_empty_think)
        if reasoning == "answer_only" and train_on == "all":
            raise DataError("data.reasoning=answer_only with data.train_on=all: every token would be a target, the "
                            "reasoning's too. Fix: data.train_on=assistant (or last_assistant), or data.reasoning=train.")
        self.kind, self.template = _resolve_template(tokenizer, template)
        if tokenizer.eos_token_id is None:
            raise DataError(
                "data.tokenizer: the tokenizer defines no EOS token, which ends every assistant turn. Fix: set "
                "eos_token in its tokenizer_config.json."
            )
        vocab = tokenizer.get_vocab()
        self._bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        # Without role tokens the built-in format degrades to plain concatenation of the turns.
        self._markers = {
            "user": [vocab[USER_TOKEN]] if USER_TOKEN in vocab else [],
            "assistant": [vocab[ASSISTANT_TOKEN]] if ASSISTANT_TOKEN in vocab else [],
            "system": [vocab[SYSTEM_TOKEN]] if SYSTEM_TOKEN in vocab else [],
        }

    @classmethod
    def from_config(cls, data_cfg: Any, tokenizer: PreTrainedTokenizerBase) -> ChatFormatter:
        """The formatter the `data` config describes."""
        return cls(tokenizer, template=data_cfg.chat_template, train_on=data_cfg.train_on,
                   reasoning=getattr(data_cfg, "reasoning", "train"),
                   train_empty_think=getattr(data_cfg, "train_empty_think", False))

    @property
    def uses_template(self) -> bool:
        return self.kind != "builtin"

    def describe(self) -> str:
        names = {"builtin": "built-in chat format", "nemotron3": "Nemotron 3 chat format",
                 "tokenizer": "tokenizer's chat template (generation markers)", "jinja": "chat template"}
        return f"{names[self.kind]}, reasoning={self.policy.mode}"

    def encode(self, conversations: Sequence[Turns], where: Sequence[str]) -> list[Encoded]:
        """One `Encoded` per conversation; `where[i]` names it in errors."""
        if self.kind == "builtin":
            return self._encode_builtin(conversations, where)
        return [self.encode_one(turns, w) for turns, w in zip(conversations, where)]

    def encode_one(self, turns: Turns, where: str = "conversation") -> Encoded:
        if self.kind == "builtin":
            return self._encode_builtin([turns], [where])[0]
        if self.kind == "nemotron3":
            text, spans = nemotron3.render(turns, _trained_turns(turns, self.train_on), self.policy, where,
                                           train_all=self.train_on == "all")
            return self._tokenize(text, spans)
        return self._encode_with_template(turns, where)

    def encode_prompt(self, turns: Turns, where: str = "prompt") -> list[int]:
        """The ids a model continues to answer `turns` (which end before an assistant turn): the
        conversation as training renders it, then the opening of an assistant turn (a template's
        generation prompt)."""
        if self.kind == "builtin":
            return self._encode_builtin([turns], [where])[0].ids + self._markers["assistant"]
        if self.kind == "nemotron3":
            text, _ = nemotron3.render(turns, set(), self.policy, where)
            text += nemotron3.generation_prompt(self.policy)
        else:
            text = self._render(self._prepared(turns, where), where, generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------ shared steps
    def _tokenize(self, text: str, spans: Sequence[tuple[int, int]]) -> Encoded:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return Encoded(list(enc["input_ids"]), _overlaps(enc["offset_mapping"], spans))

    def _prepared(self, turns: Turns, where: str) -> Turns:
        """The messages a template renders: history without reasoning, the final turns' kept as written
        (a field trace as `reasoning_content`), or removed under `drop`."""
        last_user = last_user_index(turns)
        out: Turns = []
        for i, turn in enumerate(turns):
            if turn["role"] != "assistant":
                out.append({"role": turn["role"], "content": turn["content"]})
                continue
            trace = trace_of(turn, f"{where}: turn {i + 1}")
            if not self.policy.keeps(history=i < last_user) or trace.source == "none":
                out.append(without_reasoning(turn, trace))
            elif trace.source == "field":
                out.append({"role": "assistant", "content": trace.answer, REASONING_FIELD: trace.reasoning})
            else:
                out.append({"role": "assistant", "content": turn["content"]})
        return out

    def _unmask_think(self, text: str, offsets: Sequence[tuple[int, int]], trained: list[bool],
                      regions: Sequence[tuple[int, int]]) -> list[bool]:
        """Within the trained `regions` of a template's text, think blocks that must not train stop
        training: tokens inside such a block, and any token touching its reasoning."""
        blocks = [b for lo, hi in regions for b in untrained_think_spans(text, lo, hi, self.policy)]
        if not blocks:
            return trained
        out = list(trained)
        for k, (start, end) in enumerate(offsets):
            if any((start >= bs and end <= be) or (start < ie and end > is_) for bs, be, is_, ie in blocks):
                out[k] = False
        return out

    # ------------------------------------------------------------------ built-in format
    def _assistant_content(self, turns: Turns, i: int, where: str, trained: bool) -> tuple[str, list[tuple[int, int]]]:
        """Turn `i`'s content with reasoning applied, and its trained character spans."""
        trace = trace_of(turns[i], f"{where}: turn {i + 1}")
        keep = self.policy.keeps(history=i < last_user_index(turns)) and trace.source != "none"
        pieces = content_pieces(trace, keep=keep, empty_block=False)
        kinds = trained_kinds(pieces, self.policy, open_in_prompt=False) if trained else set()
        spans, pos = [], 0
        for text, kind in pieces:
            if kind in kinds and text:
                spans.append((pos, pos + len(text)))
            pos += len(text)
        return "".join(text for text, _ in pieces), spans

    def _encode_builtin(self, conversations: Sequence[Turns], where: Sequence[str]) -> list[Encoded]:
        everything = self.train_on == "all"
        contents: list[str] = []
        # Per turn: None for a turn that is not the assistant's, else (trained spans, whether it trains).
        spans: list[tuple[list[tuple[int, int]], bool] | None] = []
        for turns, w in zip(conversations, where):
            trained_turns = _trained_turns(turns, self.train_on)
            for i, turn in enumerate(turns):
                if turn["role"] != "assistant":
                    contents.append(turn["content"])
                    spans.append(None)
                    continue
                trains = everything or i in trained_turns
                text, turn_spans = self._assistant_content(turns, i, w, trains)
                contents.append(text)
                spans.append((turn_spans, trains))
        # One batched call: the fast tokenizer then works through all texts in Rust.
        enc = self.tokenizer(contents, add_special_tokens=False, return_offsets_mapping=True) if contents else None
        eos = self.tokenizer.eos_token_id
        out: list[Encoded] = []
        k = 0
        for turns in conversations:
            ids = list(self._bos)
            trained = [everything] * len(ids)
            for turn in turns:
                head = self._markers[turn["role"]]
                body, info = list(enc["input_ids"][k]), spans[k]
                if info is None:
                    mask = [everything] * len(body)
                else:
                    mask = _overlaps(enc["offset_mapping"][k], info[0]) + [info[1]]
                    body.append(eos)
                ids += head + body
                trained += [everything] * len(head) + [everything or m for m in mask]
                k += 1
            out.append(Encoded(ids, trained))
        return out

    # ------------------------------------------------------------------ chat templates
    def _render(self, turns: Turns, where: str, *, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                turns, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # the template's own `raise_exception`, or a Jinja error
            raise DataError(
                f"{where}: the chat template failed on this conversation ({type(e).__name__}: {e}). Fix: "
                "correct the row (e.g. roles in the order the template expects), or set data.chat_template "
                "(builtin, nemotron3, or another template)."
            ) from e

    def _encode_with_template(self, turns: Turns, where: str) -> Encoded:
        turns = self._prepared(turns, where)
        if self.kind == "tokenizer":
            text, spans = self._generation_spans(turns, where)
        else:
            text, spans = self._prefix_spans(turns, where)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        if self.train_on == "all":
            return Encoded(ids, [True] * len(ids))
        trained = self._unmask_think(text, offsets, _overlaps(offsets, spans), spans)
        return Encoded(ids, trained)

    def _prefix_spans(self, turns: Turns, where: str) -> tuple[str, list[tuple[int, int]]]:
        text = self._render(turns, where, generation_prompt=False)
        spans: list[tuple[int, int]] = []
        if self.train_on == "all":
            return text, spans
        for i in sorted(_trained_turns(turns, self.train_on)):
            # A conversation opening with an assistant turn has no prefix to render.
            before = self._render(turns[:i], where, generation_prompt=True) if i else ""
            through = self._render(turns[: i + 1], where, generation_prompt=False)
            if not (text.startswith(before) and text.startswith(through) and len(through) >= len(before)):
                hint = (" The released Nemotron 3 template writes a different think block into its generation "
                        "prompt than into a turn: use data.chat_template=nemotron3."
                        if "truncate_history_thinking" in self.template else "")
                raise DataError(
                    f"{where}: the chat template does not render earlier turns of a conversation the same "
                    f"way once later turns follow (turn {i + 1}), so the assistant's tokens cannot be "
                    "located. Fix: use a template that does not rewrite earlier turns, one with {% generation %} "
                    f"markers (data.chat_template=tokenizer), or data.chat_template=builtin.{hint}"
                )
            spans.append((len(before), len(through)))
        return text, spans

    def _generation_spans(self, turns: Turns, where: str) -> tuple[str, list[tuple[int, int]]]:
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, indices = render_jinja_template(
                conversations=[turns], chat_template=self.template, return_assistant_tokens_mask=True,
                **self.tokenizer.special_tokens_map,
            )
        except Exception as e:
            raise DataError(
                f"{where}: the tokenizer's chat template failed on this conversation ({type(e).__name__}: {e}). "
                "Fix: correct the row, or set data.chat_template (builtin, nemotron3, or a template string)."
            ) from e
        text, spans = rendered[0], list(indices[0])
        assistant = [i for i, t in enumerate(turns) if t["role"] == "assistant"]
        if len(spans) != len(assistant):
            raise DataError(
                f"{where}: the tokenizer's chat template marks {len(spans)} {{% generation %}} block(s) for "
                f"{len(assistant)} assistant turn(s), so the turns' tokens cannot be told apart. Fix: use a "
                "template with one generation block per assistant turn, or another data.chat_template."
            )
        keep = _trained_turns(turns, self.train_on)
        return text, [span for span, i in zip(spans, assistant) if i in keep]


def _resolve_template(tokenizer: PreTrainedTokenizerBase, template: str) -> tuple[str, str | None]:
    """(renderer kind, Jinja text) for a `data.chat_template` value."""
    if template == "auto":
        return ("jinja", tokenizer.chat_template) if tokenizer.chat_template else ("builtin", None)
    if template in ("builtin", "nemotron3"):
        return template, None
    own = tokenizer.chat_template if template == "tokenizer" else None
    if template == "tokenizer" and not own:
        raise DataError(
            "data.chat_template=tokenizer: the tokenizer (data.tokenizer) has no chat_template. Fix: use "
            "nemotron3, builtin, auto, or give a Jinja template string."
        )
    if own is not None:
        if not _GENERATION.search(own):
            raise DataError(
                "data.chat_template=tokenizer: the tokenizer's chat_template has no {% generation %} markers, so "
                "the assistant's tokens cannot be read from it. Fix: use data.chat_template=nemotron3 for the "
                "released Nemotron 3 template, auto (locates each turn by rendering prefixes), or add "
                "{% generation %}...{% endgeneration %} around the assistant content in the template."
            )
        return "tokenizer", own
    return "jinja", template


def encode_conversation(formatter: ChatFormatter, turns: Turns, where: str = "conversation") -> Encoded:
    """Render one conversation into token ids and its trained mask, exactly as training sees it (before
    the length policy). `turns`: `{"role", "content"}` dicts, assistant turns optionally carrying
    `reasoning_content`."""
    return formatter.encode_one(turns, where)


def describe(formatter: ChatFormatter) -> str:
    return formatter.describe()
