"""Chat rendering: a conversation becomes token ids plus, per token, whether it is trained.

Two renderers share one contract, so prompt/response rows and chat rows train the same way:

- the tokenizer's chat template (or `data.chat_template` given as a Jinja string). Each assistant
  turn is located as the text the template adds between "the conversation so far, with a
  generation prompt" and "the conversation through this turn"; tokens overlapping that text are
  trained. This needs no `{% generation %}` markers, only a template that renders a conversation
  prefix as a prefix of the whole, which chat templates do unless they rewrite earlier turns.
- the built-in format, for tokenizers without a template:
  `[BOS] ([<|system|>] system) <|user|> user <|assistant|> assistant EOS <|user|> ...`,
  with role tokens used when the vocabulary has them (the shipped tokenizer has `<|user|>` and
  `<|assistant|>`; without `<|system|>` a system turn is its bare text). Trained tokens are
  each assistant turn's content and its EOS.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from .sources import TRAIN_ON, DataError

USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SYSTEM_TOKEN = "<|system|>"

Turns = list[dict[str, str]]
Encoded = tuple[list[int], list[bool]]


def _trained_turns(turns: Turns, train_on: str) -> set[int]:
    assistant = [i for i, t in enumerate(turns) if t["role"] == "assistant"]
    if train_on == "last_assistant":
        return set(assistant[-1:])
    return set(assistant)


class ChatFormatter:
    """Encodes conversations (lists of `{"role", "content"}` turns) for SFT.

    `template`: "auto" (the tokenizer's chat template when it has one, else the built-in format),
    "builtin", or a Jinja chat template. `train_on`: "assistant" (every assistant turn),
    "last_assistant" (only the final one) or "all" (every token).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str = "auto", train_on: str = "assistant"):
        if train_on not in TRAIN_ON:
            raise DataError(f"data.train_on={train_on!r}: unknown value. Fix: use one of {list(TRAIN_ON)}.")
        self.tokenizer = tokenizer
        self.train_on = train_on
        if template == "auto":
            self.template = tokenizer.chat_template or None
        elif template == "builtin":
            self.template = None
        else:
            self.template = template
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

    @property
    def uses_template(self) -> bool:
        return self.template is not None

    def encode(self, conversations: Sequence[Turns], where: Sequence[str]) -> list[Encoded]:
        """One `(ids, trained)` pair per conversation; `where[i]` names it in errors."""
        if self.template is not None:
            return [self._encode_with_template(turns, w) for turns, w in zip(conversations, where)]
        return self._encode_builtin(conversations)

    def encode_prompt(self, turns: Turns, where: str = "prompt") -> list[int]:
        """The ids a model continues to answer `turns`: the conversation as training renders it, then
        the opening of an assistant turn (the template's generation prompt)."""
        if self.template is not None:
            text = self._render(turns, where, generation_prompt=True)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._encode_builtin([turns])[0][0] + self._markers["assistant"]

    # ------------------------------------------------------------------ built-in format
    def _encode_builtin(self, conversations: Sequence[Turns]) -> list[Encoded]:
        contents = [t["content"] for turns in conversations for t in turns]
        # One batched call: the fast tokenizer then works through all texts in Rust.
        content_ids = iter(self.tokenizer(contents, add_special_tokens=False)["input_ids"] if contents else [])
        eos = self.tokenizer.eos_token_id
        everything = self.train_on == "all"
        out: list[Encoded] = []
        for turns in conversations:
            trained_turns = _trained_turns(turns, self.train_on)
            ids = list(self._bos)
            trained = [everything] * len(ids)
            for i, turn in enumerate(turns):
                head = self._markers[turn["role"]]
                body = list(next(content_ids))
                if turn["role"] == "assistant":
                    body.append(eos)
                ids += head + body
                trained += [everything] * len(head) + [everything or i in trained_turns] * len(body)
            out.append((ids, trained))
        return out

    # ------------------------------------------------------------------ chat template
    def _render(self, turns: Turns, where: str, *, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                turns, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # the template's own `raise_exception`, or a Jinja error
            raise DataError(
                f"{where}: the chat template failed on this conversation ({type(e).__name__}: {e}). Fix: "
                "correct the row (e.g. roles in the order the template expects), or set data.chat_template "
                "(builtin, or another template)."
            ) from e

    def _encode_with_template(self, turns: Turns, where: str) -> Encoded:
        text = self._render(turns, where, generation_prompt=False)
        spans: list[tuple[int, int]] = []
        if self.train_on != "all":
            for i in sorted(_trained_turns(turns, self.train_on)):
                # A conversation opening with an assistant turn has no prefix to render.
                before = self._render(turns[:i], where, generation_prompt=True) if i else ""
                through = self._render(turns[: i + 1], where, generation_prompt=False)
                if not (text.startswith(before) and text.startswith(through) and len(through) >= len(before)):
                    raise DataError(
                        f"{where}: the chat template does not render earlier turns of a conversation the same "
                        f"way once later turns follow (turn {i + 1}), so the assistant's tokens cannot be "
                        "located. Fix: use a template that does not rewrite earlier turns, or "
                        "data.chat_template=builtin."
                    )
                spans.append((len(before), len(through)))
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        if self.train_on == "all":
            return ids, [True] * len(ids)
        # A token is trained when its text overlaps an assistant span: BPE may glue a space of the
        # template's header onto the first word of the reply, and that token must still be learned.
        trained = [any(start < hi and end > lo for lo, hi in spans) for start, end in enc["offset_mapping"]]
        return ids, trained


def describe(formatter: ChatFormatter) -> str:
    return "chat template" if formatter.uses_template else "built-in chat format"

