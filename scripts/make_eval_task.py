"""Generate the multiple-choice evaluation task shipped in ``nemotron_recipe/evaluation/tasks``.

`tiny_sft_mc` asks each prompt of the shipped validation set (data/assets/tiny_sft_val.jsonl) with
four answers: the true response and three near misses made the way the task's data was (another
colour, another opposite, a wrong sum or count, the words in another order). Only the answer
differs between the choices, so picking the right one needs what fine-tuning teaches; guessing
scores 25%. Few-shot examples come from the first rows of the
training set, made the same way.

Outputs are committed and byte-for-byte reproducible:

    python scripts/make_eval_task.py            # rewrite the shipped task data
    python scripts/make_eval_task.py --out DIR  # write elsewhere (used by the tests)
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_data import COLOURS, DEFAULT_OUT as ASSETS, OPPOSITES, REPO_ROOT, write_jsonl  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "nemotron_recipe" / "evaluation" / "tasks"
SEED = 20250101
CHOICES = 4
FEWSHOT_ROWS = 32


def _orders(words: list[str], right: list[str], rng: random.Random) -> list[str]:
    """Other orders of `words` than `right`: the given order and its reverse first, then shuffles, and
    (for words with few distinct orders) the right order missing its last or first word."""
    seen, out = {tuple(right)}, []
    candidates = [list(words), list(reversed(words)), sorted(words)]
    for _ in range(50):
        shuffled = list(words)
        rng.shuffle(shuffled)
        candidates.append(shuffled)
    candidates += [right[:-1], right[1:]]
    for c in candidates:
        if tuple(c) not in seen:
            seen.add(tuple(c))
            out.append(" ".join(c))
    return out


def near_misses(prompt: str, response: str, rng: random.Random) -> list[str]:
    """Wrong answers to `prompt` in the form of `response`, most plausible first."""
    if m := re.fullmatch(r"What colour is the (\w+)\?", prompt):
        return [f"The {m[1]} is {c}." for c in sorted(set(COLOURS.values()) - {COLOURS[m[1]]})]
    if m := re.fullmatch(r"What is the opposite of (\w+)\?", prompt):
        return [f"The opposite of {m[1]} is {w}." for w in sorted(set(OPPOSITES.values()) - {OPPOSITES[m[1]], m[1]})]
    if m := re.fullmatch(r"Add (\d+) and (\d+)\.", prompt):
        a, b = int(m[1]), int(m[2])
        return [f"{a} + {b} = {s}." for s in (a + b + d for d in (1, -1, 10, -10, 2, -2)) if s >= 0]
    if m := re.fullmatch(r"Count the words: (.+)", prompt):
        n = len(m[1].split())
        return [f"There are {k} words." for k in (n + 1, n - 1, n + 2, n - 2, n + 3) if k > 0]
    if m := re.fullmatch(r"(?:Reverse the words|Repeat|Sort): (.+)", prompt):
        return _orders(m[1].split(), response.split(), rng)
    raise ValueError(f"no near misses for prompt {prompt!r}: a task kind this script does not know")


def mc_row(row: dict[str, str], rng: random.Random) -> dict[str, object]:
    wrong = near_misses(row["prompt"], row["response"], rng)
    wrong = [w for w in dict.fromkeys(wrong) if w != row["response"]]
    if len(wrong) < CHOICES - 1:
        raise ValueError(f"only {len(wrong)} near misses for {row['prompt']!r}")
    choices = rng.sample(wrong, CHOICES - 1) + [row["response"]]
    rng.shuffle(choices)
    return {"question": row["prompt"], "choices": choices, "gold": choices.index(row["response"])}


def read_jsonl(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    rng = random.Random(SEED)
    test = [mc_row(r, rng) for r in read_jsonl(ASSETS / "tiny_sft_val.jsonl")]
    fewshot = [mc_row(r, rng) for r in read_jsonl(ASSETS / "tiny_sft_train.jsonl")[:FEWSHOT_ROWS]]
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "tiny_sft_mc_test.jsonl", test)
    write_jsonl(args.out / "tiny_sft_mc_fewshot.jsonl", fewshot)
    print(f"wrote {len(test)} test / {len(fewshot)} few-shot rows to {args.out}")


if __name__ == "__main__":
    main()
