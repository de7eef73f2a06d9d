"""The chat format training used, as the Jinja template an exported tokenizer carries.

`data.chat_template` names how conversations were rendered (chat.py): the tokenizer's own template
("auto" when it has one), a named format, or a Jinja string. `training_template` turns that setting
into the Jinja that makes transformers' `apply_chat_template` render the same text, and so the same
tokens. A named format adds one entry to `NAMED_TEMPLATES`: a function of the tokenizer returning its
Jinja (a function, because a format may depend on what the vocabulary holds).
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from .chat import ASSISTANT_TOKEN, SYSTEM_TOKEN, USER_TOKEN


def _literal(text: str) -> str:
    """`text` as a Jinja expression that prints it verbatim (token strings may hold braces)."""
    return "{{ " + repr(text) + " }}" if text else ""


def builtin_jinja(tokenizer: PreTrainedTokenizerBase) -> str:
    """The built-in format (chat.py): `[BOS] ([<|system|>] system) <|user|> user <|assistant|> assistant EOS ...`,
    with each role token only where the vocabulary has it, as training renders it."""
    vocab = tokenizer.get_vocab()
    marker = {role: (tok if tok in vocab else "") for role, tok in
              (("user", USER_TOKEN), ("assistant", ASSISTANT_TOKEN), ("system", SYSTEM_TOKEN))}
    bos = tokenizer.bos_token if tokenizer.bos_token_id is not None else ""
    return (
        _literal(bos)
        + "{%- for message in messages -%}"
        + "{%- if message['role'] == 'user' -%}" + _literal(marker["user"]) + "{{ message['content'] }}"
        + "{%- elif message['role'] == 'assistant' -%}" + _literal(marker["assistant"]) + "{{ message['content'] }}"
        + _literal(tokenizer.eos_token)
        + "{%- elif message['role'] == 'system' -%}" + _literal(marker["system"]) + "{{ message['content'] }}"
        + "{%- else -%}{{ raise_exception('unknown role ' + message['role'] + ': use system, user or assistant') }}"
        + "{%- endif -%}{%- endfor -%}"
        + "{%- if add_generation_prompt -%}" + _literal(marker["assistant"]) + "{%- endif -%}"
    )


def _own(tokenizer: PreTrainedTokenizerBase) -> str | dict | None:
    return tokenizer.chat_template or None


# `nemotron3` renders what the released Nemotron 3 template renders (nemotron3.py), so the released
# tokenizer's own template is its Jinja; the package ships no copy of it.
NAMED_TEMPLATES: dict[str, Callable[[PreTrainedTokenizerBase], str | dict | None]] = {
    "builtin": builtin_jinja,
    "tokenizer": _own,
    "nemotron3": _own,
}


def training_template(tokenizer: PreTrainedTokenizerBase, setting: str = "auto") -> str | dict | None:
    """The Jinja template `data.chat_template=setting` trains with, for `tokenizer`; None when no Jinja
    of it is known (`nemotron3` with a tokenizer that carries no template).

    "auto" is the tokenizer's own template when it has one (kept as it is) and the built-in format
    otherwise; a name in `NAMED_TEMPLATES` is that format; anything else is a Jinja template already."""
    if setting == "auto":
        return tokenizer.chat_template or builtin_jinja(tokenizer)
    if setting in NAMED_TEMPLATES:
        return NAMED_TEMPLATES[setting](tokenizer)
    return setting
