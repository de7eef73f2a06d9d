"""The released Nemotron 3 chat template's rendering, with every character's role known.

Source: the `chat_template` of `tokenizer_config.json` in nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 on the
Hugging Face hub, as mirrored verbatim in llama.cpp's `models/templates/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja`
(10708 bytes, sha256 650b9d301337fd103f9014f6f6ae89b46660ae92e4421d95bd3157115e5b02ce). The tests render
conversations with that file and with this module and compare the text.

For system, user and assistant turns (tools are not rendered here) the template writes:

    <|im_start|>system\\n{system content, or nothing}<|im_end|>\\n          always, from a leading system turn
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{content, trimmed}<|im_end|>\\n

where an assistant turn's content is `<think>\\n{reasoning_content}\\n</think>\\n{content}` when it has a
`reasoning_content` field, its content as written when that holds think tags, else
`<think></think>{content}`. Assistant turns before the last user turn keep only `<think></think>` and
what follows `</think>` (its default `truncate_history_thinking`). The generation prompt is
`<|im_start|>assistant\\n<think>\\n` (reasoning on) or `...<think></think>` (off), so a trace's opening tag
is prompt, not output: it never trains, and neither does an empty block unless asked for.
"""

from __future__ import annotations

from .reasoning import (
    Piece,
    ReasoningPolicy,
    Trace,
    content_pieces,
    last_user_index,
    strip_pieces,
    trace_of,
    trained_kinds,
)

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def generation_prompt(policy: ReasoningPolicy) -> str:
    """The opening of the assistant turn a model continues: reasoning on (its think block opened), or off
    (an empty block) when training dropped the traces."""
    return f"{IM_START}assistant\n" + ("<think></think>" if policy.mode == "drop" else "<think>\n")


def render(turns: list[dict[str, str]], trained_turns: set[int], policy: ReasoningPolicy, where: str,
           *, train_all: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and its trained character spans: in each trained assistant turn, the
    parts of its content `policy` trains and the `<|im_end|>` that closes it."""
    parts: list[tuple[str, bool]] = []
    first = 0
    system = ""
    if turns and turns[0]["role"] == "system":
        system, first = turns[0]["content"], 1
    parts.append((f"{IM_START}system\n{system}{IM_END}\n", False))
    last_user = last_user_index(turns)
    for i in range(first, len(turns)):
        turn = turns[i]
        if turn["role"] != "assistant":
            parts.append((f"{IM_START}{turn['role']}\n{turn['content']}{IM_END}\n", False))
            continue
        trains = i in trained_turns
        parts.append((f"{IM_START}assistant\n", False))
        parts += _assistant(turn, history=i < last_user, trains=trains, policy=policy, where=f"{where}: turn {i + 1}")
        parts += [(IM_END, trains), ("\n", False)]
    text = "".join(t for t, _ in parts)
    if train_all:
        return text, [(0, len(text))]
    spans, pos = [], 0
    for t, trained in parts:
        if trained and t:
            if spans and spans[-1][1] == pos:  # one span per contiguous trained text
                spans[-1] = (spans[-1][0], pos + len(t))
            else:
                spans.append((pos, pos + len(t)))
        pos += len(t)
    return text, spans


def _assistant(turn: dict[str, str], *, history: bool, trains: bool, policy: ReasoningPolicy,
               where: str) -> list[tuple[str, bool]]:
    trace = trace_of(turn, where)
    if policy.mode == "drop" and trace.source != "none":
        # The conversation renders as if written without reasoning (history too, which the template
        # would otherwise cut after `</think>`, keeping the newline a trace leaves there).
        trace = Trace(reasoning="", answer=trace.answer.lstrip(), source="none")
    keep = policy.keeps(history) and trace.source != "none"
    pieces: list[Piece] = strip_pieces(content_pieces(trace, keep=keep, empty_block=True))
    kinds = trained_kinds(pieces, policy, open_in_prompt=True) if trains else set()
    return [(text, kind in kinds) for text, kind in pieces]
