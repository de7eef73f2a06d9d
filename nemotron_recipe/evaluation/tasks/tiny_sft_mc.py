"""The data of the `tiny_sft_mc` task, read from the files beside this module (no download)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SPLITS = {"test": "tiny_sft_mc_test.jsonl", "fewshot": "tiny_sft_mc_fewshot.jsonl"}


def load(**_: Any):
    """lm-eval's `custom_dataset`: the task's splits as a DatasetDict (lm-eval passes its metadata, unused)."""
    import datasets

    def rows(name: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (HERE / name).read_text(encoding="utf-8").splitlines()]

    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows(name)) for split, name in SPLITS.items()})
