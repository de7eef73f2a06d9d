"""Data sources and formats, chat rendering and masking, length policies, validation splits and
packing: through the data layer, and end to end through the recipe."""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from nemotron_recipe.config import ConfigError, build_model_config
from nemotron_recipe.data import (
    DEFAULT_ASSETS_DIR,
    IGNORE_INDEX,
    ChatFormatter,
    DataError,
    SFTExamples,
    collate,
    load_sft_examples,
    load_tokenizer,
    pack_examples,
    split_indices,
    val_batches,
)
from nemotron_recipe.models.nemotron_v3 import NemotronHForCausalLM
from nemotron_recipe.training.objectives import sft as sft_objective
from nemotron_recipe.training.finetune import run
from nemotron_recipe.training import loss as loss_module
from nemotron_recipe.training.loss import cross_entropy_sum

from helpers import RUN_BASE, compose_run, metrics_rows

REPO = Path(__file__).resolve().parents[1]

PAIRS = [
    {"prompt": "Add 12 and 7.", "response": "12 + 7 = 19."},
    {"prompt": "Sort: 3 1 2", "response": "1 2 3"},
    {"prompt": "Repeat: cat dog", "response": "cat dog"},
    {"prompt": "What colour is the milk?", "response": "The milk is white."},
]
CHATS = [
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": "1 + 2 = 3."},
        {"role": "user", "content": "And 2 and 2?"},
        {"role": "assistant", "content": "2 + 2 = 4."},
    ],
    [{"role": "user", "content": "Repeat: sun"}, {"role": "assistant", "content": "sun"}],
    [{"role": "user", "content": "Reverse: a b"}, {"role": "assistant", "content": "b a"}],
]
# Renders exactly like the built-in format, so the template path must give the same tokens.
BUILTIN_LIKE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Plain-text headers: the tokenizer glues the header's trailing space onto the reply's first word.
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_ASSETS_DIR)


def write(path: Path, rows: list, fmt: str | None = None) -> Path:
    fmt = fmt or path.suffix.lstrip(".")
    if fmt == "jsonl":
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows, indent=1))
    elif fmt == "parquet":
        pd.DataFrame(rows).to_parquet(path)
    elif fmt == "csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    return path


def trained_runs(ids: list[int], targets: list[int]) -> list[list[int]]:
    """Contiguous runs of trained target tokens, checking each is the next input token."""
    for t, target in enumerate(targets):
        if target != IGNORE_INDEX:
            assert target == ids[t + 1]
    return [list(run) for keep, run in itertools.groupby(targets, key=lambda t: t != IGNORE_INDEX) if keep]


# ---------------------------------------------------------------------------------------- formats
@pytest.mark.parametrize("fmt", ["json", "parquet", "csv", "jsonl-as-json"])
def test_every_format_gives_the_same_examples(tmp_path, tok, fmt):
    reference = load_sft_examples(write(tmp_path / "ref.jsonl", PAIRS), tok, seq_len=64)
    if fmt == "jsonl-as-json":  # JSON Lines under a .json name, which is common
        path = write(tmp_path / "d.json", PAIRS, fmt="jsonl")
    else:
        path = write(tmp_path / f"d.{fmt}", PAIRS)
    ex = load_sft_examples(path, tok, seq_len=64)
    assert (ex.input_ids, ex.targets) == (reference.input_ids, reference.targets)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_utf8_bom_at_the_start_is_accepted(tmp_path, tok, suffix):
    """Editors on Windows save UTF-8 with a byte-order mark; the rows are those of the file without it."""
    reference = load_sft_examples(write(tmp_path / f"ref{suffix}", PAIRS), tok, seq_len=64)
    path = tmp_path / f"bom{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + (tmp_path / f"ref{suffix}").read_bytes())
    ex = load_sft_examples(path, tok, seq_len=64)
    assert (ex.input_ids, ex.targets) == (reference.input_ids, reference.targets) and len(ex) == len(PAIRS)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet"])
def test_chat_rows_train_exactly_the_assistant_turns(tmp_path, tok, fmt):
    path = write(tmp_path / f"chat.{fmt}", [{"messages": c} for c in CHATS])
    ex = load_sft_examples(path, tok, messages_key="messages", seq_len=64)
    assert len(ex) == len(CHATS)
    for chat, ids, targets in zip(CHATS, ex.input_ids, ex.targets):
        replies = [t["content"] + tok.eos_token for t in chat if t["role"] == "assistant"]
        assert [tok.decode(r) for r in trained_runs(ids, targets)] == replies
    assert tok.decode(ex.input_ids[0]) == (
        "<s>Answer briefly.<|user|>Add 1 and 2.<|assistant|>1 + 2 = 3.</s><|user|>And 2 and 2?"
        "<|assistant|>2 + 2 = 4.</s>"
    )


def test_chat_messages_as_json_strings_in_csv(tmp_path, tok):
    path = write(tmp_path / "chat.csv", [{"messages": json.dumps(c)} for c in CHATS])
    ex = load_sft_examples(path, tok, messages_key="messages", seq_len=64)
    ref = load_sft_examples(write(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS]), tok,
                            messages_key="messages", seq_len=64)
    assert (ex.input_ids, ex.targets) == (ref.input_ids, ref.targets)


def test_train_on_last_assistant_and_all(tmp_path, tok):
    path = write(tmp_path / "chat.jsonl", [{"messages": CHATS[0]}])
    last = load_sft_examples(path, tok, messages_key="messages", seq_len=64, train_on="last_assistant")
    assert [tok.decode(r) for r in trained_runs(last.input_ids[0], last.targets[0])] == ["2 + 2 = 4.</s>"]
    everything = load_sft_examples(path, tok, messages_key="messages", seq_len=64, train_on="all")
    ids, targets = everything.input_ids[0], everything.targets[0]
    assert targets == ids[1:] + [IGNORE_INDEX]


def test_chat_template_matches_builtin_format_and_handles_plain_headers(tok):
    where = [f"row {i}" for i in range(len(CHATS))]
    builtin = ChatFormatter(tok, template="builtin").encode(CHATS, where)
    assert ChatFormatter(tok, template=BUILTIN_LIKE_TEMPLATE).encode(CHATS, where) == builtin

    encoded = ChatFormatter(tok, template=PLAIN_TEMPLATE).encode(CHATS, where)
    for chat, (ids, trained) in zip(CHATS, encoded):
        assert tok.decode(ids).startswith(f"{chat[0]['role'].capitalize()}: {chat[0]['content']}")
        runs = [tok.decode([i for i, _ in run]) for keep, run in itertools.groupby(zip(ids, trained),
                                                                               key=lambda x: x[1]) if keep]
        # The header's space belongs to the reply's first token, which the model must learn to emit.
        assert runs == [" " + t["content"] + tok.eos_token for t in chat if t["role"] == "assistant"]


def test_tokenizer_chat_template_is_used_when_present(tmp_path, tok):
    templated = load_tokenizer(DEFAULT_ASSETS_DIR)
    templated.chat_template = PLAIN_TEMPLATE
    path = write(tmp_path / "d.jsonl", PAIRS[:1])
    ex = load_sft_examples(path, templated, seq_len=64)
    assert tok.decode(ex.input_ids[0]) == f"User: {PAIRS[0]['prompt']}Assistant: {PAIRS[0]['response']}</s>"
    builtin = load_sft_examples(path, templated, seq_len=64, chat_template="builtin")
    assert tok.decode(builtin.input_ids[0]).startswith("<s><|user|>")


def test_template_that_rewrites_earlier_turns_is_refused(tmp_path, tok):
    only_last = "{% for m in messages %}{% if loop.last %}{{ m['content'] }}{% else %}.{% endif %}{% endfor %}"
    path = write(tmp_path / "chat.jsonl", [{"messages": CHATS[0]}])
    with pytest.raises(DataError, match="does not render earlier turns") as info:
        load_sft_examples(path, tok, messages_key="messages", seq_len=64, chat_template=only_last)
    assert f"{path}:1" in str(info.value) and "data.chat_template=builtin" in str(info.value)


def test_masked_targets_do_not_reach_the_loss(tmp_path, tok):
    """Changing the target of a masked position (never its input) leaves the loss unchanged."""
    path = write(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS])
    ex = load_sft_examples(path, tok, messages_key="messages", seq_len=64)
    batch = collate(ex, range(len(ex)), 64, tok.pad_token_id)
    torch.manual_seed(0)
    model = NemotronHForCausalLM(build_model_config(compose_cfg(tmp_path).model))
    logits = model(batch["input_ids"]).logits.detach()
    targets = batch["targets"]
    masked = targets == IGNORE_INDEX
    # The label every position would have if everything were trained; only the mask decides.
    every_label = torch.cat([batch["input_ids"][:, 1:], torch.zeros_like(batch["input_ids"][:, :1])], 1)
    loss, count = cross_entropy_sum(logits, targets)
    per_token = F.cross_entropy(logits.flatten(0, 1), every_label.flatten(), reduction="none").view(targets.shape)
    torch.testing.assert_close(loss, per_token[~masked].sum())
    scrambled = torch.where(masked, torch.randint_like(every_label, 6, len(tok)), every_label)
    per_token_scrambled = F.cross_entropy(logits.flatten(0, 1), scrambled.flatten(), reduction="none")
    torch.testing.assert_close(loss, per_token_scrambled.view(targets.shape)[~masked].sum())
    assert count == (~masked).sum()
    # And the positions kept are exactly the assistant replies.
    decoded = [tok.decode(r) for ids, t in zip(ex.input_ids, ex.targets) for r in trained_runs(ids, t)]
    assert decoded == [t["content"] + "</s>" for c in CHATS for t in c if t["role"] == "assistant"]


# ---------------------------------------------------------------------------------------- errors
def test_missing_columns_name_file_and_columns(tmp_path, tok):
    for fmt in ("parquet", "csv"):
        path = write(tmp_path / f"d.{fmt}", [{"question": "q", "answer": "a"}])
        with pytest.raises(DataError, match="missing column") as info:
            load_sft_examples(path, tok, seq_len=32)
        msg = str(info.value)
        assert str(path) in msg and "'prompt'" in msg and "'question'" in msg and "data.prompt_key" in msg
    path = write(tmp_path / "d.json", [{"prompt": "p", "response": "r"}, {"prompt": "p"}])
    with pytest.raises(DataError, match=r": row 2: missing key\(s\) \['response'\]"):
        load_sft_examples(path, tok, seq_len=32)


@pytest.mark.parametrize("fmt", ["json", "parquet", "csv", "jsonl"])
def test_empty_dataset(tmp_path, tok, fmt):
    path = tmp_path / f"empty.{fmt}"
    if fmt == "parquet":
        pd.DataFrame({"prompt": pd.Series([], dtype=str), "response": pd.Series([], dtype=str)}).to_parquet(path)
    elif fmt == "csv":
        path.write_text("prompt,response\n")
    else:
        path.write_text("[]" if fmt == "json" else "\n")
    with pytest.raises(DataError, match="has no rows") as info:
        load_sft_examples(path, tok, seq_len=32)
    assert str(path) in str(info.value)


def test_invalid_json_array_names_line(tmp_path, tok):
    path = tmp_path / "bad.json"
    path.write_text('[\n{"prompt": "p", "response": "r"},\n{"prompt": "p" "response": "r"}\n]')
    with pytest.raises(DataError, match="invalid JSON") as info:
        load_sft_examples(path, tok, seq_len=32)
    assert f"{path}:3:" in str(info.value)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_bad_utf8_names_its_line(tmp_path, tok, suffix):
    # Far enough down the file that a block-decoding reader fails on an earlier line.
    lines = [json.dumps({"prompt": f"Question {i}: " + "word " * 20, "response": "answer"}).encode() for i in range(400)]
    lines[300] = lines[300].replace(b"answer", b"ans\xffwer")
    path = tmp_path / f"bad{suffix}"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError, match="not valid UTF-8") as info:
        load_sft_examples(path, tok, seq_len=32)
    column = lines[300].index(b"\xff") + 1
    assert f"{path}:301: not valid UTF-8 (byte 0xff at byte {column} of the line" in str(info.value)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_unknown_role_names_file_row_and_role(tmp_path, tok, fmt):
    bad = [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "hello"}]
    path = write(tmp_path / f"chat.{fmt}", [{"messages": CHATS[1]}, {"messages": bad}])
    with pytest.raises(DataError, match="unknown role 'human'") as info:
        load_sft_examples(path, tok, messages_key="messages", seq_len=32)
    msg = str(info.value)
    assert (f"{path}:2" if fmt == "jsonl" else f"{path}: row 2") in msg and "'assistant'" in msg


def test_malformed_turns(tmp_path, tok):
    path = write(tmp_path / "a.jsonl", [{"messages": [{"speaker": "user", "text": "hi"}]}])
    with pytest.raises(DataError, match=r":1: turn 1 .*data.role_key"):
        load_sft_examples(path, tok, messages_key="messages", seq_len=32)
    path = write(tmp_path / "b.jsonl", [{"messages": "hello"}])
    with pytest.raises(DataError, match=r":1: 'messages' is a string that is not JSON"):
        load_sft_examples(path, tok, messages_key="messages", seq_len=32)
    path = write(tmp_path / "c.csv", [{"prompt": "p", "response": None}])
    with pytest.raises(DataError, match=r"c.csv: row 1: 'response' must be a string"):
        load_sft_examples(path, tok, seq_len=32)


def test_untrainable_rows_are_skipped_and_counted(tmp_path, tok):
    rows = [
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "no reply"}]},
        {"messages": []},
        {"messages": [{"role": "user", "content": "cat " * 40}, {"role": "assistant", "content": "x"}]},
        {"messages": CHATS[1]},
    ]
    ex = load_sft_examples(write(tmp_path / "d.jsonl", rows), tok, messages_key="messages", seq_len=16)
    assert (len(ex), ex.num_skipped, ex.num_truncated) == (1, 3, 1)


def test_max_length_policy_drop_counts(tmp_path, tok):
    rows = [PAIRS[0], {"prompt": "Repeat: cat", "response": "cat " * 30}]
    path = write(tmp_path / "d.jsonl", rows)
    dropped = load_sft_examples(path, tok, seq_len=24, max_length_policy="drop")
    assert (len(dropped), dropped.num_dropped, dropped.num_truncated) == (1, 1, 0)
    truncated = load_sft_examples(path, tok, seq_len=24)
    assert (len(truncated), truncated.num_dropped, truncated.num_truncated) == (2, 0, 1)
    with pytest.raises(DataError, match="1 were dropped as longer than trainer.seq_len"):
        load_sft_examples(write(tmp_path / "long.jsonl", rows[1:]), tok, seq_len=24, max_length_policy="drop")


# ---------------------------------------------------------------------------------------- hub
def test_hub_dataset_loads_through_datasets(monkeypatch, tok):
    calls = []

    def fake_load_dataset(name, split=None, **kwargs):
        calls.append((name, split))
        return datasets.Dataset.from_list([{"messages": c} for c in CHATS])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ex = load_sft_examples("someorg/some-chats", tok, messages_key="messages", seq_len=64, split="train_sft")
    assert calls == [("someorg/some-chats", "train_sft")] and len(ex) == len(CHATS)


def test_hub_dataset_offline_is_a_clear_error(monkeypatch, tok):
    def offline(name, split=None, **kwargs):
        raise ConnectionError("Couldn't reach 'someorg/some-chats' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError) as info:
        load_sft_examples("someorg/some-chats", tok, seq_len=64, field_name="data.train_file")
    msg = str(info.value)
    assert "data.train_file='someorg/some-chats'" in msg and "data.train_split='train'" in msg
    assert "ConnectionError" in msg and "local .jsonl/.json/.parquet/.csv file" in msg


def test_recipe_with_unreachable_hub_dataset_fails_before_training(tmp_path, monkeypatch):
    def offline(name, split=None, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="data.train_file='someorg/some-chats'"):
        run(compose_cfg(tmp_path, "data.train_file=someorg/some-chats", "data.val_file=null"))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_config_tells_hub_ids_from_missing_files(tmp_path):
    from nemotron_recipe.data import check_data_config

    cfg = compose_cfg(tmp_path, "data.train_file=someorg/some-chats", "data.val_file=null").data
    assert check_data_config(cfg) == []
    for value in ("data/missing.jsonl", "/abs/missing", "missing.txt"):
        cfg = compose_cfg(tmp_path, f"data.train_file={value}").data
        assert any(f"data.train_file='{value}'" in e and "does not exist" in e for e in check_data_config(cfg))
    txt = write(tmp_path / "d.txt", PAIRS, fmt="jsonl")
    errors = check_data_config(compose_cfg(tmp_path, f"data.train_file={txt}").data)
    assert any("data.format" in e and "'.txt'" in e for e in errors)
    assert check_data_config(compose_cfg(tmp_path, f"data.train_file={txt}", "data.format=jsonl").data) == []


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["data.val_split_fraction=0.1"], "data.val_split_fraction=0.1 and data.val_file="),
        (["data.val_split_fraction=1.0", "data.val_file=null"], "must lie in [0, 1)"),
        (["data.train_on=prompt"], "data.train_on='prompt'"),
        (["data.max_length_policy=wrap"], "data.max_length_policy='wrap'"),
        (["data.format=xml"], "data.format='xml'"),
        (["data.chat_template=chatml"], "data.chat_template='chatml'"),
    ],
)
def test_invalid_data_settings_are_named(tmp_path, overrides, needle):
    with pytest.raises(ConfigError) as info:
        run(compose_cfg(tmp_path, *overrides))
    assert needle in str(info.value)


# ---------------------------------------------------------------------------------------- split, packing
def test_validation_split_is_seeded_and_disjoint():
    train, val = split_indices(100, 0.1, seed=3)
    assert len(val) == 10 and sorted(train + val) == list(range(100))
    assert (train, val) == split_indices(100, 0.1, seed=3)
    assert val != split_indices(100, 0.1, seed=4)[1]
    assert len(split_indices(5, 0.01, seed=0)[1]) == 1
    with pytest.raises(DataError, match="data.val_split_fraction"):
        split_indices(1, 0.5, seed=0)


def _documents(lengths: list[int]) -> SFTExamples:
    ids = [[1000 * i + t for t in range(n)] for i, n in enumerate(lengths)]
    targets = [x[1:] + [IGNORE_INDEX] for x in ids]
    return SFTExamples(input_ids=ids, targets=targets, num_truncated=2)


def test_packing_keeps_every_document_whole_and_apart():
    lengths = [5, 30, 12, 64, 7, 7, 33, 2, 18, 40, 9, 25]
    docs = _documents(lengths)
    packed = pack_examples(docs, 64, seed=0)
    assert packed.num_documents == len(lengths) and packed.num_truncated == 2
    assert len(packed) < len(lengths) and sum(map(len, packed.input_ids)) == sum(lengths)
    seen = []
    for ids, targets, doc_lens in zip(packed.input_ids, packed.targets, packed.document_lengths):
        assert len(ids) == len(targets) == sum(doc_lens) <= 64
        start = 0
        for n in doc_lens:
            doc = ids[start] // 1000
            assert ids[start:start + n] == docs.input_ids[doc] and targets[start:start + n] == docs.targets[doc]
            # No label crosses into the next document.
            assert targets[start + n - 1] == IGNORE_INDEX
            seen.append(doc)
            start += n
    assert sorted(seen) == list(range(len(lengths)))
    again = pack_examples(docs, 64, seed=0)
    assert (again.input_ids, again.document_lengths) == (packed.input_ids, packed.document_lengths)

    batch = collate(packed, [0, 1], 64, pad_id=0)
    for row in range(2):
        doc_ids = batch["document_ids"][row]
        n_docs = len(packed.document_lengths[row])
        used = sum(packed.document_lengths[row])
        assert doc_ids[:used].tolist() == [j for j, n in enumerate(packed.document_lengths[row]) for _ in range(n)]
        assert (doc_ids[used:] == n_docs).all()  # padding is a document of its own
    assert "document_ids" not in collate(docs, [0], 64, pad_id=0)
    val = list(val_batches(packed, 4, 0, 1, seq_len=64, pad_id=0))
    assert all(b["document_ids"].shape == b["input_ids"].shape and len(b["input_ids"]) == 4 for b in val)


# ---------------------------------------------------------------------------------------- recipe
TINY = [*RUN_BASE, "trainer.max_steps=2", "trainer.val_every=0"]


compose_cfg = functools.partial(compose_run, base=TINY)


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in metrics_rows(run_dir) if "loss" in r]

def _many_chats(n: int) -> list[dict]:
    return [{"messages": CHATS[i % len(CHATS)]} for i in range(n)]


@pytest.mark.parametrize(
    "name, rows, overrides",
    [
        ("chat.jsonl", _many_chats(24), ["data.messages_key=messages"]),
        ("pairs.json", PAIRS * 6, []),
        ("chat.parquet", _many_chats(24), ["data.messages_key=messages", "data.train_on=last_assistant"]),
        ("pairs.csv", PAIRS * 6, ["data.max_length_policy=drop"]),
    ],
)
def test_recipe_trains_on_every_format(tmp_path, name, rows, overrides):
    path = write(tmp_path / name, rows)
    summary = run(compose_cfg(tmp_path / "run", f"data.train_file={path}", "data.val_file=null",
                              "data.val_split_fraction=0.25", *overrides))
    assert all(math.isfinite(r["loss"]) for r in train_rows(tmp_path / "run"))
    assert summary["data"]["train"]["documents"] == 18 and summary["data"]["val"]["documents"] == 6
    assert math.isfinite(summary["first_val_loss"]) and math.isfinite(summary["last_val_loss"])


def test_all_masked_global_batch_gives_zero_loss_not_nan(tmp_path, monkeypatch):
    real_collate = sft_objective.collate

    def masked_collate(*args, **kwargs):
        batch = real_collate(*args, **kwargs)
        batch["targets"].fill_(IGNORE_INDEX)
        return batch

    monkeypatch.setattr(sft_objective, "collate", masked_collate)
    summary = run(compose_cfg(tmp_path, "data.val_file=null"))
    rows = train_rows(tmp_path)
    assert [r["loss"] for r in rows] == [0.0, 0.0] and all(r["grad_norm"] == 0.0 for r in rows)
    assert summary["final_loss"] == 0.0


def test_packed_recipe_step_equals_documents_run_alone(tmp_path, monkeypatch):
    """One packed training step: every document's per-token losses are those of the document alone."""
    path = write(tmp_path / "chat.jsonl", _many_chats(12))
    cfg = compose_cfg(tmp_path / "run", f"data.train_file={path}", "data.val_file=null",
                      "data.messages_key=messages", "data.packing=true", "trainer.max_steps=1",
                      "trainer.preflight=false")  # its trace would run the instrumented loss too
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    real_collate, real_ce = sft_objective.collate, loss_module.cross_entropy_sum
    batches = []
    monkeypatch.setattr(sft_objective, "collate", lambda *a, **k: batches.append(real_collate(*a, **k)) or batches[-1])

    def recording_ce(logits, targets):
        b = batches[len(seen)]
        seen.append((b["input_ids"], b["document_ids"], targets, logits.detach()))
        return real_ce(logits, targets)

    monkeypatch.setattr(loss_module, "cross_entropy_sum", recording_ce)
    summary = run(cfg)
    assert summary["data"]["train"]["documents"] == 12 and summary["data"]["train"]["sequences"] < 12
    assert len(seen) == 2  # global batch 4 = two micro-batches of 2 packed sequences

    torch.manual_seed(cfg.seed)
    alone_model = NemotronHForCausalLM(build_model_config(cfg.model))
    checked = 0
    for ids, doc_ids, targets, logits in seen:
        for row in range(ids.shape[0]):
            for doc in doc_ids[row].unique().tolist():
                pos = (doc_ids[row] == doc).nonzero().flatten()
                s, e = pos[0].item(), pos[-1].item() + 1
                if (targets[row, s:e] == IGNORE_INDEX).all():
                    continue  # the row's padding
                packed = F.cross_entropy(logits[row, s:e], targets[row, s:e], reduction="none")
                alone_logits = alone_model(ids[row:row + 1, s:e]).logits[0].detach()
                alone = F.cross_entropy(alone_logits, targets[row, s:e], reduction="none")
                torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
                checked += 1
    assert checked > 4


@pytest.mark.distributed
def test_packed_context_parallel_matches_one_process(tmp_path):
    path = write(tmp_path / "chat.jsonl", _many_chats(30))
    common = [f"data.train_file={path}", "data.val_file=null", "data.val_split_fraction=0.2",
              "data.messages_key=messages", "data.packing=true", "trainer.max_steps=3", "data.val_max_batches=null"]
    run(compose_cfg(tmp_path / "single", *common))
    env = {k: v for k, v in os.environ.items() if k != "NR_RUN_ID"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "recipes.finetune", *TINY, *common, "mesh.cp=2", f"hydra.run.dir={tmp_path / 'cp2'}"],
        cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    def losses(d):
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        return [r.get("loss", r.get("val_loss")) for r in rows]

    summary = json.loads((tmp_path / "cp2" / "summary.json").read_text())
    assert summary["mesh"]["cp"] == 2
    assert losses(tmp_path / "cp2") == pytest.approx(losses(tmp_path / "single"), rel=1e-5)
