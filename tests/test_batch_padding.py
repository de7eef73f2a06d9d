"""Batches are padded to their longest row (rounded up to what sequence/context parallel split by),
not to `trainer.seq_len`, and train exactly as if padded to `trainer.seq_len`."""

from __future__ import annotations

import time

import pytest

from nemotron_recipe.data import IGNORE_INDEX, SFTExamples, collate, val_batches
from nemotron_recipe.data.batching import padded_length
from nemotron_recipe.training.objectives import sft as sft_objective
from nemotron_recipe.training.finetune import run

from helpers import compose_run, metrics_rows

LENGTHS = [5, 9, 3, 17]


def _examples(lengths: list[int], packed: bool = False) -> SFTExamples:
    ids = [[100 + i] + [7] * (n - 1) for i, n in enumerate(lengths)]
    targets = [[IGNORE_INDEX] + [7] * (n - 2) + [IGNORE_INDEX] for n in lengths]
    document_lengths = [[n - n // 2, n // 2] for n in lengths] if packed else None
    return SFTExamples(input_ids=ids, targets=targets, document_lengths=document_lengths)


@pytest.mark.parametrize("indices, multiple, expected", [
    ([0, 1], 1, 9), ([0, 1], 4, 12), ([0, 2], 4, 8), ([2], 8, 8), ([0, 3], 4, 20), ([0, 3], 16, 24),
    ([0, 1], 24, 24),  # multiple=seq_len: the full length
])
def test_batch_is_padded_to_its_longest_row_rounded_up(indices, multiple, expected):
    ex = _examples(LENGTHS)
    assert padded_length(ex, indices, 24, multiple) == expected
    batch = collate(ex, indices, 24, pad_id=0, multiple=multiple)
    assert batch["input_ids"].shape == batch["targets"].shape == (len(indices), expected)
    for row, idx in enumerate(indices):
        n = LENGTHS[idx]
        assert batch["input_ids"][row, :n].tolist() == ex.input_ids[idx]
        assert (batch["input_ids"][row, n:] == 0).all() and (batch["targets"][row, n:] == IGNORE_INDEX).all()


def test_packed_padding_is_a_document_of_its_own():
    ex = _examples(LENGTHS, packed=True)
    batch = collate(ex, [0, 1], 24, pad_id=0, multiple=4)
    assert batch["document_ids"].shape == (2, 12)
    assert batch["document_ids"][0].tolist() == [0] * 3 + [1] * 2 + [2] * 7
    assert batch["document_ids"][1].tolist() == [0] * 5 + [1] * 4 + [2] * 3


def test_validation_batches_fill_up_at_their_own_length():
    ex = _examples(LENGTHS)
    batches = list(val_batches(ex, 3, 0, 1, seq_len=24, pad_id=0, multiple=4))
    assert [tuple(b["input_ids"].shape) for b in batches] == [(3, 12), (3, 20)]
    assert (batches[1]["targets"][1:] == IGNORE_INDEX).all()


# ---------------------------------------------------------------------------------------- recipe
SEQ_LEN = 4096
RUN = [f"trainer.seq_len={SEQ_LEN}", "trainer.max_steps=2", "trainer.val_every=1", "data.val_max_batches=1"]


def _timed_run(tmp_path, name: str, monkeypatch, collate_fn) -> tuple[list[dict], list[int], float]:
    """The metrics rows of a run on the shipped data, the lengths its training batches had, and
    its training time."""
    lengths: list[int] = []

    def recording_collate(*args, **kwargs):
        batch = collate_fn(*args, **kwargs)
        lengths.append(batch["input_ids"].shape[1])
        return batch

    monkeypatch.setattr(sft_objective, "collate", recording_collate)
    started = time.perf_counter()
    summary = run(compose_run(tmp_path / name, *RUN))
    seconds = time.perf_counter() - started
    rows = [{k: r[k] for k in ("step", "loss", "grad_norm", "val_loss") if k in r} for r in metrics_rows(tmp_path / name)]
    print(f"{name}: {seconds:.2f}s, summary train_time_s={summary['train_time_s']:.2f}")
    return rows, lengths, seconds


def test_recipe_padded_to_longest_row_trains_as_padded_to_seq_len(tmp_path, monkeypatch):
    def full_collate(examples, indices, seq_len, pad_id, multiple=1):
        return collate(examples, indices, seq_len, pad_id, multiple=seq_len)

    full, full_lengths, full_s = _timed_run(tmp_path, "full", monkeypatch, full_collate)
    dynamic, lengths, dynamic_s = _timed_run(tmp_path, "dynamic", monkeypatch, collate)
    print(f"padded to seq_len {full_s:.2f}s, to the longest row {dynamic_s:.2f}s: {full_s / dynamic_s:.1f}x")
    assert set(full_lengths) == {SEQ_LEN} and max(lengths) < SEQ_LEN // 2
    assert [r.keys() for r in dynamic] == [r.keys() for r in full]
    for got, want in zip(dynamic, full):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), (got["step"], key)
