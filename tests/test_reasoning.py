"""Reasoning traces and chat formats: the Nemotron 3 rendering against the released template, the trained
mask under every `data.reasoning` value and format, generation markers, and bad input."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch

from nemotron_recipe.config import ConfigError, validate_config
from nemotron_recipe.data import DEFAULT_ASSETS_DIR, IGNORE_INDEX, ChatFormatter, DataError, encode_conversation
from nemotron_recipe.data import load_sft_data, load_tokenizer
from nemotron_recipe.data import nemotron3
from nemotron_recipe.data.reasoning import ReasoningPolicy, trace_of

from helpers import compose_run

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# The released template as llama.cpp mirrors it (models/templates/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja, stored
# there through git LFS under this digest), byte for byte.
RELEASED_TEMPLATE = FIXTURES / "nemotron3_nano_chat_template.jinja"
RELEASED_SHA256 = "650b9d301337fd103f9014f6f6ae89b46660ae92e4421d95bd3157115e5b02ce"


def user(text):
    return {"role": "user", "content": text}


def assistant(text, reasoning=None):
    turn = {"role": "assistant", "content": text}
    if reasoning is not None:
        turn["reasoning_content"] = reasoning
    return turn


CONVERSATIONS = {
    "field": [user("Add 2 and 3."), assistant("5.", "two plus three is five")],
    "inline": [user("Add 2 and 3."), assistant("<think>\ntwo plus three\n</think>\n5.")],
    "inline_tight": [user("Sort: 3 1"), assistant("<think>small first</think>1 3")],
    "none": [user("Repeat: sun"), assistant("sun")],
    "empty_inline": [user("Repeat: sun"), assistant("<think></think>sun")],
    "blank_field": [user("Repeat: sun"), assistant("sun", "  \n")],
    "padded": [user("Repeat: sun"), assistant("  sun \n")],
    "system_multi": [
        {"role": "system", "content": "Answer briefly."},
        user("Add 1 and 2."), assistant("<think>1+2</think>\n3."),
        user("And 2 and 2?"), assistant("4.", "2+2 is 4"),
    ],
    "history_field": [user("Hi"), assistant("Hello.", "greet back"), user("Bye"), assistant("Bye.")],
    "two_after_user": [user("Count"), assistant("one", "first"), assistant("two", "second")],
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_ASSETS_DIR)


@pytest.fixture(scope="module")
def released():
    return RELEASED_TEMPLATE.read_bytes().decode()


def render(turns, mode="train", train_empty_think=False, train_on="assistant"):
    assistant_turns = {i for i, t in enumerate(turns) if t["role"] == "assistant"}
    if train_on == "last_assistant":
        assistant_turns = {max(assistant_turns)}
    return nemotron3.render(turns, assistant_turns, ReasoningPolicy(mode, train_empty_think), "test")


def strip_reasoning(turns):
    out = []
    for t in turns:
        t = {"role": t["role"], "content": t["content"]}
        if t["role"] == "assistant" and "</think>" in t["content"]:
            t["content"] = t["content"].split("</think>")[1].lstrip()
        out.append(t)
    return out


def test_fixture_is_the_published_template():
    assert hashlib.sha256(RELEASED_TEMPLATE.read_bytes()).hexdigest() == RELEASED_SHA256


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_nemotron3_renders_like_the_released_template(tok, released, name):
    turns = CONVERSATIONS[name]
    text, _ = render(turns)
    assert text == tok.apply_chat_template(turns, chat_template=released, tokenize=False)
    # `drop` renders what the template renders for the same conversation written without reasoning.
    dropped, _ = render(turns, "drop")
    assert dropped == tok.apply_chat_template(strip_reasoning(turns), chat_template=released, tokenize=False)


# "inline_tight" writes no newline after <think>, so the template's reasoning-on prompt ("<think>\n") is not
# a prefix of it; its trained text still starts right after "<think>" (test_nemotron3_masks_per_reasoning_mode).
@pytest.mark.parametrize("name", sorted(set(CONVERSATIONS) - {"inline_tight"}))
@pytest.mark.parametrize("mode", ["train", "drop"])
def test_nemotron3_trains_what_follows_the_generation_prompt(released, tok, name, mode):
    """The final turn's trained text is exactly what a model writes after the released template's
    generation prompt (reasoning on for a turn with a trace, off without), up to and with <|im_end|>."""
    turns = CONVERSATIONS[name]
    text, spans = render(turns, mode, train_on="last_assistant")
    thinking = mode == "train" and trace_of(turns[-1], "test").has_reasoning
    history = strip_reasoning(turns) if mode == "drop" else turns
    prompt = tok.apply_chat_template(history[:-1], chat_template=released, tokenize=False, add_generation_prompt=True,
                                     enable_thinking=thinking)
    assert text.startswith(prompt)
    assert spans == [(len(prompt), len(text) - 1)] and text.endswith("<|im_end|>\n")


def _runs(tok, enc):
    """The text with trained runs in brackets."""
    out, run, cur = "", [], None
    for i, t in zip(enc.ids, enc.trained):
        if t != cur and run:
            out += f"[{tok.decode(run)}]" if cur else tok.decode(run)
            run = []
        cur = t
        run.append(i)
    return out + (f"[{tok.decode(run)}]" if cur else tok.decode(run))


def test_nemotron3_masks_per_reasoning_mode(tok):
    turns = CONVERSATIONS["system_multi"]
    got = {mode: _runs(tok, encode_conversation(ChatFormatter(tok, "nemotron3", reasoning=mode), turns))
           for mode in ("train", "answer_only", "drop")}
    head = ("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nAdd 1 and 2.<|im_end|>\n"
            "<|im_start|>assistant\n<think></think>[\n3.<|im_end|>]\n<|im_start|>user\nAnd 2 and 2?<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert got["train"] == head + "<think>\n[2+2 is 4\n</think>\n4.<|im_end|>]\n"
    assert got["answer_only"] == head + "<think>\n2+2 is 4\n</think>[\n4.<|im_end|>]\n"
    # `drop` renders the conversation as if written without reasoning, history included.
    assert got["drop"] == head.replace("[\n3.", "[3.") + "<think></think>[4.<|im_end|>]\n"


def test_empty_think_block_trains_only_when_asked(tok):
    for name in ("none", "empty_inline", "blank_field"):
        plain = _runs(tok, encode_conversation(ChatFormatter(tok, "nemotron3"), CONVERSATIONS[name]))
        assert plain.endswith("<think></think>[sun<|im_end|>]\n"), plain
        asked = _runs(tok, encode_conversation(ChatFormatter(tok, "nemotron3", train_empty_think=True),
                                               CONVERSATIONS[name]))
        assert asked.endswith("[<think></think>sun<|im_end|>]\n"), asked
