import importlib.util
import json
from pathlib import Path

import pytest
import torch

from nemotron_recipe.data import (
    DEFAULT_ASSETS_DIR,
    IGNORE_INDEX,
    DataError,
    GlobalBatchPlan,
    SFTExamples,
    collate,
    load_sft_examples,
    load_tokenizer,
    val_batches,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_FILES = ["tiny_sft_train.jsonl", "tiny_sft_val.jsonl", "tiny_reasoning_train.jsonl", "tiny_reasoning_val.jsonl",
                 "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_ASSETS_DIR)


def write_jsonl(path: Path, rows) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


# ---------------------------------------------------------------- tokenizer


def test_shipped_tokenizer_facts(tok):
    assert len(tok) == 512
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.convert_tokens_to_ids(["<|user|>", "<|assistant|>"]) == [4, 5]
    text = "Reverse the words: cat dog sun"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_shipped_tokenizer_loads_with_auto_tokenizer():
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(DEFAULT_ASSETS_DIR))
    assert (auto.pad_token_id, auto.bos_token_id, auto.eos_token_id) == (0, 1, 2)


def test_load_tokenizer_from_bare_json_file_assigns_roles():
    bare = load_tokenizer(DEFAULT_ASSETS_DIR / "tokenizer.json")
    assert (bare.pad_token_id, bare.bos_token_id, bare.eos_token_id) == (0, 1, 2)


def test_load_tokenizer_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="data.tokenizer") as info:
        load_tokenizer(missing)
    assert str(missing) in str(info.value)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------- sft tokenization


def test_targets_are_shifted_and_masked_on_prompt(tmp_path, tok):
    rows = [
        {"prompt": "Add 12 and 7.", "response": "12 + 7 = 19."},
        {"prompt": "Repeat: cat dog", "response": "cat dog"},
    ]
    ex = load_sft_examples(write_jsonl(tmp_path / "d.jsonl", rows), tok, seq_len=64)
    assert len(ex) == 2 and ex.num_truncated == 0 and ex.num_skipped == 0
    for row, ids, targets in zip(rows, ex.input_ids, ex.targets):
        assert len(ids) == len(targets)
        assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
        assert targets[-1] == IGNORE_INDEX
        trained = [t for t in range(len(ids)) if targets[t] != IGNORE_INDEX]
        # Trained positions are one contiguous run whose targets are the next input tokens.
        assert trained == list(range(trained[0], len(ids) - 1))
        assert all(targets[t] == ids[t + 1] for t in trained)
        assert tok.decode([targets[t] for t in trained]) == row["response"] + tok.eos_token
        # Everything up to and including the position that predicts the first response token is prompt.
        assert tok.decode(ids[: trained[0] + 1]) == f"<s><|user|>{row['prompt']}<|assistant|>"


def test_truncation_and_skipping_are_counted(tmp_path, tok):
    rows = [
        {"prompt": "Sort: 3 1 2", "response": "1 2 3"},
        {"prompt": "Repeat: cat dog sun box", "response": "cat dog sun box " * 5},
        {"prompt": "Reverse the words: " + "cat " * 30, "response": "cat"},
    ]
    seq_len = 16
    ex = load_sft_examples(write_jsonl(tmp_path / "d.jsonl", rows), tok, seq_len=seq_len)
    assert ex.num_truncated == 2
    assert ex.num_skipped == 1
    assert len(ex) == 2
    for ids, targets in zip(ex.input_ids, ex.targets):
        assert len(ids) == len(targets) <= seq_len
        assert targets[-1] == IGNORE_INDEX
    truncated_ids, truncated_targets = ex.input_ids[1], ex.targets[1]
    assert len(truncated_ids) == seq_len and truncated_ids[-1] != tok.eos_token_id
    assert truncated_targets[-2] == truncated_ids[-1]


def test_all_rows_skipped_is_an_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "cat " * 40, "response": "x"}])
    with pytest.raises(DataError, match=r"no row is left to train on.*increase the sequence length \(trainer.seq_len\)"):
        load_sft_examples(path, tok, seq_len=8)


# ---------------------------------------------------------------- validation errors


def test_malformed_json_reports_path_and_line(tmp_path, tok):
    good = json.dumps({"prompt": "p", "response": "r"})
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, '{"prompt": "p", "response": ', good])
    with pytest.raises(DataError, match="invalid JSON") as info:
        load_sft_examples(path, tok, seq_len=32)
    assert f"{path}:3:" in str(info.value)


def test_missing_key_reports_line_and_keys_present(tmp_path, tok):
    good = {"prompt": "p", "response": "r"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, {"prompt": "p", "answer": "r"}])
    with pytest.raises(DataError) as info:
        load_sft_examples(path, tok, seq_len=32)
    msg = str(info.value)
    assert f"{path}:2:" in msg and "'response'" in msg and "'answer'" in msg


def test_custom_keys_are_honoured(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "Sort: 2 1", "answer": "1 2"}])
    ex = load_sft_examples(path, tok, prompt_key="question", response_key="answer", seq_len=32)
    assert len(ex) == 1


def test_non_object_and_non_string_rows(tmp_path, tok):
    path = write_jsonl(tmp_path / "list.jsonl", ['["p", "r"]'])
    with pytest.raises(DataError, match=r":1: expected a JSON object"):
        load_sft_examples(path, tok, seq_len=32)
    path = write_jsonl(tmp_path / "num.jsonl", [{"prompt": "p", "response": 7}])
    with pytest.raises(DataError, match=r":1: 'response' must be a string"):
        load_sft_examples(path, tok, seq_len=32)


def test_missing_file_names_config_field(tmp_path, tok):
    missing = tmp_path / "absent.jsonl"
    with pytest.raises(DataError, match="data.val_file") as info:
        load_sft_examples(missing, tok, seq_len=32, field_name="data.val_file")
    assert str(missing) in str(info.value) and "does not exist" in str(info.value)


@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_empty_file(tmp_path, tok, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match="no rows"):
        load_sft_examples(path, tok, seq_len=32)


def test_blank_lines_are_ignored(tmp_path, tok):
    good = json.dumps({"prompt": "p", "response": "r"})
    path = write_jsonl(tmp_path / "d.jsonl", [good, "", good])
    assert len(load_sft_examples(path, tok, seq_len=32)) == 2


# ---------------------------------------------------------------- batch plan


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_union_over_ranks_and_microbatches_is_the_global_batch(dp_size):
    n, gbs, mbs, seed = 100, 16, 2, 3
    reference = GlobalBatchPlan(n, gbs, gbs, 0, 1, seed)
    plans = [GlobalBatchPlan(n, gbs, mbs, r, dp_size, seed) for r in range(dp_size)]
    assert plans[0].grad_accum_steps == gbs // (mbs * dp_size)
    for step in [0, 1, 5, 6, 7, 31]:
        union = []
        for plan in plans:
            micro = plan.indices_for_step(step)
            assert len(micro) == plan.grad_accum_steps
            assert all(len(mb) == mbs for mb in micro)
            union.extend(i for mb in micro for i in mb)
        assert union == reference.indices_for_step(step)[0] == reference.global_indices_for_step(step)


def test_steps_differ_and_are_pure():
    plan = GlobalBatchPlan(1000, 8, 4, 0, 1, seed=0)
    assert plan.indices_for_step(0) != plan.indices_for_step(1)
    assert plan.indices_for_step(7) == GlobalBatchPlan(1000, 8, 4, 0, 1, seed=0).indices_for_step(7)
    assert plan.indices_for_step(0) != GlobalBatchPlan(1000, 8, 4, 0, 1, seed=1).indices_for_step(0)


def test_epoch_boundary_is_crossed_seamlessly():
    n, gbs = 10, 4
    plan = GlobalBatchPlan(n, gbs, 2, 0, 1, seed=5)
    stream = [i for step in range(5) for i in plan.global_indices_for_step(step)]
    epoch0, epoch1 = stream[:n], stream[n : 2 * n]
    assert sorted(epoch0) == list(range(n)) and sorted(epoch1) == list(range(n))
    assert epoch0 == torch.randperm(n, generator=torch.Generator().manual_seed(5)).tolist()
    assert epoch1 == torch.randperm(n, generator=torch.Generator().manual_seed(6)).tolist()
    # Step 2 straddles the boundary: the tail of epoch 0 then the head of epoch 1.
    assert plan.global_indices_for_step(2) == epoch0[8:] + epoch1[:2]


def test_global_batch_larger_than_dataset():
    plan = GlobalBatchPlan(3, 8, 4, 0, 1, seed=0)
    batch = plan.global_indices_for_step(0)
    assert len(batch) == 8
    assert sorted(batch[:3]) == sorted(batch[3:6]) == [0, 1, 2]


def test_invalid_sizes_name_the_config_fields():
    with pytest.raises(ValueError) as info:
        GlobalBatchPlan(100, 12, 4, 0, 2, seed=0)
    msg = str(info.value)
    assert "trainer.global_batch_size" in msg and "trainer.micro_batch_size" in msg
    assert "data-parallel size (2)" in msg and "8 or 16" in msg and "micro_batch_size to 3" in msg
    with pytest.raises(ValueError, match="trainer.global_batch_size"):
        GlobalBatchPlan(100, 0, 1, 0, 1, seed=0)
    with pytest.raises(ValueError, match="dp_rank"):
        GlobalBatchPlan(100, 8, 1, 2, 2, seed=0)


# ---------------------------------------------------------------- collation and validation


def _synthetic_examples(n: int) -> SFTExamples:
    # Example i is recognisable from its first token and always has trained targets.
    ids = [[100 + i] + [7] * (1 + i % 3) for i in range(n)]
    targets = [[IGNORE_INDEX] * (len(x) - 2) + [7, IGNORE_INDEX] for x in ids]
    return SFTExamples(input_ids=ids, targets=targets)


def test_collate_pads_to_the_longest_row():
    ex = _synthetic_examples(4)
    batch = collate(ex, [2, 0], seq_len=6, pad_id=0)
    assert batch["input_ids"].dtype == batch["targets"].dtype == torch.long
    assert batch["input_ids"].shape == batch["targets"].shape == (2, 4)
    assert batch["input_ids"].tolist() == [[102, 7, 7, 7], [100, 7, 0, 0]]
    assert batch["targets"][0].tolist() == [-100, -100, 7, -100]
    full = collate(ex, [2, 0], seq_len=6, pad_id=0, multiple=6)
    assert full["input_ids"][0].tolist() == [102, 7, 7, 7, 0, 0]
    assert full["targets"][0].tolist() == [-100, -100, 7, -100, -100, -100]
    with pytest.raises(ValueError, match="seq_len"):
        collate(ex, [2], seq_len=3, pad_id=0)


@pytest.mark.parametrize("n,mbs,dp_size", [(10, 3, 4), (7, 2, 2), (3, 4, 4), (200, 8, 1)])
def test_val_batches_cover_every_example_once_in_lockstep(n, mbs, dp_size):
    ex = _synthetic_examples(n)
    per_rank = [list(val_batches(ex, mbs, r, dp_size, seq_len=8, pad_id=0)) for r in range(dp_size)]
    counts = {len(batches) for batches in per_rank}
    assert len(counts) == 1
    assert len(val_batches(ex, mbs, 0, dp_size, seq_len=8, pad_id=0)) == counts.pop()
    seen = []
    for batches in per_rank:
        for batch in batches:
            assert batch["input_ids"].shape == batch["targets"].shape
            assert batch["input_ids"].shape[0] == mbs and batch["input_ids"].shape[1] <= 8
            for row_ids, row_targets in zip(batch["input_ids"], batch["targets"]):
                if (row_targets != IGNORE_INDEX).any():
                    seen.append(int(row_ids[0]) - 100)
                else:
                    assert (row_ids == 0).all()
    assert sorted(seen) == list(range(n))


# ---------------------------------------------------------------- shipped assets


def test_shipped_datasets_load(tok):
    train = load_sft_examples(DEFAULT_ASSETS_DIR / "tiny_sft_train.jsonl", tok, seq_len=256)
    val = load_sft_examples(DEFAULT_ASSETS_DIR / "tiny_sft_val.jsonl", tok, seq_len=256, field_name="data.val_file")
    assert len(train) == 4000 and len(val) == 200
    assert train.num_truncated == train.num_skipped == 0
    assert max(len(x) for x in train.input_ids) <= 60
    assert sum(f.stat().st_size for f in DEFAULT_ASSETS_DIR.iterdir()) < 1_000_000


def test_generator_is_deterministic_and_matches_shipped_assets(tmp_path):
    spec = importlib.util.spec_from_file_location("make_tiny_data", REPO_ROOT / "scripts" / "make_tiny_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--out", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in DEFAULT_ASSETS_DIR.iterdir())
    for name in SHIPPED_FILES:
        assert (tmp_path / name).read_bytes() == (DEFAULT_ASSETS_DIR / name).read_bytes(), name
