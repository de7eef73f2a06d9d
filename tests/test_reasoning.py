"""Reasoning traces and chat formats: the Nemotron 3 rendering against the released template, the trained
mask under every `data.reasoning` value and format, generation markers, and bad input."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch
from helpers import SMALL_DIMS, compose_run

from nemotron_recipe.config import ConfigError, validate_config
from nemotron_recipe.data import (
    DEFAULT_ASSETS_DIR,
    ChatFormatter,
    DataError,
    encode_conversation,
    load_sft_data,
    load_tokenizer,
    nemotron3,
)
from nemotron_recipe.data.reasoning import ReasoningPolicy, trace_of

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


# A ChatML template that reads `reasoning_content` and marks each assistant turn with {% generation %}.
MARKED_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}"
    "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_template(tok, template):
    t = load_tokenizer(DEFAULT_ASSETS_DIR)
    t.chat_template = template
    return t


def test_tokenizer_template_mask_is_transformers_assistant_mask(tok):
    marked = with_template(tok, MARKED_TEMPLATE)
    turns = [{"role": "system", "content": "Be brief."}, user("Add 1 and 2."), assistant("3."), user("And 2 and 2?"),
             assistant("4.")]
    enc = encode_conversation(ChatFormatter(marked, "tokenizer"), turns)
    ref = marked.apply_chat_template(turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert enc.ids == ref["input_ids"] and enc.trained == [bool(m) for m in ref["assistant_masks"]]
    # History lost its reasoning before the template saw it; the final turn's trains by mode.
    final = [user("Add 2 and 3."), assistant("5.", "two plus three")]
    runs = {mode: _runs(marked, encode_conversation(ChatFormatter(marked, "tokenizer", reasoning=mode), final))
            for mode in ("train", "answer_only", "drop")}
    assert runs["train"].endswith("assistant\n[<think>two plus three</think>5.<|im_end|>]")
    assert runs["answer_only"].endswith("assistant\n<think>two plus three</think>[5.<|im_end|>]")
    assert runs["drop"].endswith("assistant\n[5.<|im_end|>]")
    last = ChatFormatter(marked, "tokenizer", train_on="last_assistant")
    assert _runs(marked, encode_conversation(last, turns)).count("[") == 1


def test_auto_template_path_applies_reasoning_modes(tok):
    plain = with_template(tok, MARKED_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    turns = [user("Hi"), assistant("Hello.", "greet"), user("Add 2 and 3."), assistant("5.", "two plus three")]
    runs = {mode: _runs(plain, encode_conversation(ChatFormatter(plain, "auto", reasoning=mode), turns))
            for mode in ("train", "answer_only")}
    assert "assistant\n[Hello.<|im_end|>" in runs["train"] and "greet" not in runs["train"]
    assert runs["train"].endswith("[<think>two plus three</think>5.<|im_end|>\n]")
    assert runs["answer_only"].endswith("<think>two plus three</think>[5.<|im_end|>\n]")


def test_builtin_format_applies_reasoning_modes(tok):
    turns = [user("Add 2 and 3."), assistant("<think>two plus three</think>5.")]
    runs = {mode: _runs(tok, encode_conversation(ChatFormatter(tok, "builtin", reasoning=mode), turns))
            for mode in ("train", "answer_only", "drop")}
    assert runs["train"] == "<s><|user|>Add 2 and 3.<|assistant|>[<think>two plus three</think>5.</s>]"
    assert runs["answer_only"] == "<s><|user|>Add 2 and 3.<|assistant|><think>two plus three</think>[5.</s>]"
    assert runs["drop"] == "<s><|user|>Add 2 and 3.<|assistant|>[5.</s>]"


def test_template_choices_that_cannot_mask_are_refused(tok, released):
    with pytest.raises(DataError, match="has no chat_template"):
        ChatFormatter(tok, "tokenizer")
    with pytest.raises(DataError, match=r"no \{% generation %\} markers.*nemotron3"):
        ChatFormatter(with_template(tok, released), "tokenizer")
    auto = ChatFormatter(with_template(tok, released), "auto")
    with pytest.raises(DataError, match="data.chat_template=nemotron3"):
        encode_conversation(auto, CONVERSATIONS["history_field"])


@pytest.mark.parametrize("content,needle", [
    ("<think>never closed", "never closed"),
    ("<think>a</think>b<think>c</think>d", "2 <think> and 2 </think>"),
    ("Sure. <think>a</think>b", "text before its <think> block"),
])
def test_malformed_traces_name_the_row(tmp_path, tok, content, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "Q", "response": "fine"}) + "\n" + json.dumps({"prompt": "Q", "response": content}) + "\n")
    from nemotron_recipe.data import load_sft_examples

    with pytest.raises(DataError, match=f"bad.jsonl:2: turn 2.*{needle}"):
        load_sft_examples(path, tok, seq_len=64, chat_template="nemotron3")


def test_trace_given_twice_is_refused(tok):
    with pytest.raises(DataError, match="both a 'reasoning_content' field and <think> tags"):
        encode_conversation(ChatFormatter(tok, "nemotron3"), [user("Q"), assistant("<think>a</think>b", "c")])


@pytest.mark.parametrize("overrides,needle", [
    (["data.reasoning=hide"], r"data.reasoning='hide': unknown value.*answer_only"),
    (["data.reasoning=answer_only", "data.train_on=all"], r"answer_only with data.train_on=all.*Fix: data.train_on"),
    (["data.chat_template=nemotron"], r"data.chat_template='nemotron': neither one of .*nemotron3"),
])
def test_bad_reasoning_settings_are_named(tmp_path, overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        validate_config(compose_run(tmp_path, *overrides), world_size=1)


# ---------------------------------------------------------------- through the training data path
def _reasoning_rows(n):
    path = DEFAULT_ASSETS_DIR / "tiny_reasoning_train.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _train_data(tmp_path, tok, path, mode):
    cfg = compose_run(tmp_path, f"data.train_file={path}", "data.val_file=null", "data.chat_template=nemotron3",
                      f"data.reasoning={mode}")
    return load_sft_data(cfg.data, tok, seq_len=128, seed=0).train


def test_answer_only_loss_is_blind_to_the_reasoning_tokens(tmp_path, tok):
    """Rows that differ only inside their reasoning give, under answer_only, the very same targets, so the
    training loss on the same logits is bit-identical; under train the targets and the loss differ."""
    from nemotron_recipe.config import build_model_config
    from nemotron_recipe.data import collate
    from nemotron_recipe.models.nemotron_v3 import NemotronHForCausalLM
    from nemotron_recipe.training.loss import cross_entropy_sum

    rows = _reasoning_rows(8)
    # Every digit of the trace changes (9 - d), its tokens with it; the answer stays.
    flip = str.maketrans("0123456789", "9876543210")
    changed = [{"prompt": r["prompt"], "response": r["response"].split("</think>")[0].translate(flip) + "</think>"
                + r["response"].split("</think>")[1]} for r in rows]
    a, b = _write(tmp_path / "a.jsonl", rows), _write(tmp_path / "b.jsonl", changed)
    torch.manual_seed(0)
    small = [f"model.{k}={v}" for k, v in {**SMALL_DIMS, "vocab_size": len(tok)}.items()]
    model = NemotronHForCausalLM(build_model_config(compose_run(tmp_path, *small).model))
    losses = {}
    for mode in ("answer_only", "train"):
        ex_a, ex_b = _train_data(tmp_path, tok, a, mode), _train_data(tmp_path, tok, b, mode)
        batch_a, batch_b = (collate(ex, range(len(ex)), 128, tok.pad_token_id) for ex in (ex_a, ex_b))
        assert batch_a["input_ids"].shape == batch_b["input_ids"].shape  # the same length, token for token
        assert not torch.equal(batch_a["input_ids"], batch_b["input_ids"])
        with torch.no_grad():
            logits = model(batch_a["input_ids"]).logits
        losses[mode] = [cross_entropy_sum(logits, batch["targets"])[0] for batch in (batch_a, batch_b)]
        if mode == "answer_only":
            assert torch.equal(batch_a["targets"], batch_b["targets"])
    assert torch.equal(losses["answer_only"][0], losses["answer_only"][1])
    assert not torch.equal(losses["train"][0], losses["train"][1])


def test_reasoning_option_on_data_without_traces_is_said_once(tmp_path, tok, caplog):
    plain = (DEFAULT_ASSETS_DIR / "tiny_sft_train.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "plain.jsonl").write_text("".join(plain[:40]))
    (tmp_path / "plain_val.jsonl").write_text("".join(plain[40:48]))
    cfg = compose_run(tmp_path, "data.reasoning=answer_only", "data.chat_template=nemotron3",
                      f"data.train_file={tmp_path / 'plain.jsonl'}", f"data.val_file={tmp_path / 'plain_val.jsonl'}")
    with caplog.at_level(logging.WARNING, logger="nemotron_recipe"):
        data = load_sft_data(cfg.data, tok, seq_len=128, seed=0)
    notes = [r.getMessage() for r in caplog.records if "data.reasoning" in r.getMessage()]
    assert len(notes) == 1 and "data.reasoning=answer_only: no row of data.train_file" in notes[0]
    assert data.train.num_reasoning == 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nemotron_recipe"):
        traced = load_sft_data(compose_run(tmp_path, "data.reasoning=answer_only", "data.val_file=null",
                                           f"data.train_file={DEFAULT_ASSETS_DIR / 'tiny_reasoning_val.jsonl'}").data,
                               tok, seq_len=128, seed=0)
    assert traced.train.num_reasoning == 40 and not caplog.records
