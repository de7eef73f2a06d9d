"""Generate the tiny synthetic SFT and preference (DPO) data sets and the tokenizer shipped in
``nemotron_recipe/data/assets``.

The data exists so that the whole stack (data, model, parallelism, training loop) can be
exercised end to end on a laptop CPU: a ~2M-parameter model must be able to drive the
response loss well below its initial value within a few hundred optimizer steps. Every
task is therefore templated, short and deterministic given its prompt, while still
requiring the model to read the prompt (copying, reordering, looking up, adding).

Outputs are committed, so generation must be byte-for-byte reproducible:

    python scripts/make_tiny_data.py            # rewrite the shipped assets
    python scripts/make_tiny_data.py --out DIR  # write elsewhere (used by the tests)

A small second set, ``tiny_reasoning_{train,val}.jsonl``, carries the same tasks with a short
``<think>`` trace before each answer, for the reasoning options and ``recipes.preview``.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Iterable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "nemotron_recipe" / "data" / "assets"

SEED = 20240601
NUM_TRAIN = 4000
NUM_VAL = 200
VOCAB_SIZE = 512

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
USER, ASSISTANT = "<|user|>", "<|assistant|>"
# Order fixes the ids: the BPE trainer assigns special tokens the first ids, in this order.
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, USER, ASSISTANT]

WORDS = [
    "cat", "dog", "sun", "box", "tree", "fish", "bird", "star",
    "moon", "cup", "hat", "pen", "car", "bus", "map", "key",
    "lamp", "rock", "ship", "coin", "leaf", "bell", "door", "ring",
]

COLOURS = {
    "banana": "yellow", "lemon": "yellow", "tomato": "red", "cherry": "red",
    "grass": "green", "lime": "green", "sky": "blue", "ocean": "blue",
    "snow": "white", "milk": "white", "coal": "black", "crow": "black",
    "carrot": "orange", "pumpkin": "orange", "plum": "purple", "violet": "purple",
}

OPPOSITES = {
    "hot": "cold", "cold": "hot", "big": "small", "small": "big",
    "up": "down", "down": "up", "fast": "slow", "slow": "fast",
    "open": "closed", "closed": "open", "light": "dark", "dark": "light",
    "early": "late", "late": "early", "full": "empty", "empty": "full",
}


def _pick_words(rng: random.Random) -> list[str]:
    return [rng.choice(WORDS) for _ in range(rng.randint(3, 6))]


def task_reverse(rng: random.Random) -> tuple[str, str]:
    words = _pick_words(rng)
    return f"Reverse the words: {' '.join(words)}", " ".join(reversed(words))


def task_repeat(rng: random.Random) -> tuple[str, str]:
    words = _pick_words(rng)
    return f"Repeat: {' '.join(words)}", " ".join(words)


def task_add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    return f"Add {a} and {b}.", f"{a} + {b} = {a + b}."


def task_sort(rng: random.Random) -> tuple[str, str]:
    digits = [rng.randint(0, 9) for _ in range(rng.randint(3, 7))]
    return f"Sort: {' '.join(map(str, digits))}", " ".join(map(str, sorted(digits)))


def task_count(rng: random.Random) -> tuple[str, str]:
    words = _pick_words(rng)
    return f"Count the words: {' '.join(words)}", f"There are {len(words)} words."


def task_colour(rng: random.Random) -> tuple[str, str]:
    thing = rng.choice(sorted(COLOURS))
    return f"What colour is the {thing}?", f"The {thing} is {COLOURS[thing]}."


def task_opposite(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(sorted(OPPOSITES))
    return f"What is the opposite of {word}?", f"The opposite of {word} is {OPPOSITES[word]}."


TASKS: list[Callable[[random.Random], tuple[str, str]]] = [
    task_reverse, task_repeat, task_add, task_sort, task_count, task_colour, task_opposite,
]


# Lookups over a fixed fact table necessarily recur between splits; every other task is
# combinatorial, so its validation prompts are kept unseen to measure more than memorisation.
FACT_TASKS = {task_colour, task_opposite}


def generate_rows(rng: random.Random, n: int, exclude_prompts: frozenset[str] = frozenset()) -> list[dict[str, str]]:
    rows = []
    while len(rows) < n:
        task = rng.choice(TASKS)
        prompt, response = task(rng)
        if task not in FACT_TASKS and prompt in exclude_prompts:
            continue
        rows.append({"prompt": prompt, "response": response})
    return rows


# Preference pairs (DPO): the chosen response is the task's answer, the rejected one a plausible wrong
# answer or, for a third of the pairs, a lazy one. Drawn from their own stream so the SFT files and
# the tokenizer do not depend on them.
PREFERENCE_SEED = SEED + 1
NUM_PREF_TRAIN = 512
NUM_PREF_VAL = 64
LAZY_ANSWERS = ["I do not know.", "I cannot do that.", "No idea."]


def _wrong_answer(rng: random.Random, prompt: str, answer: str) -> str:
    """A wrong answer of the task `prompt` asks, different from `answer`."""
    words = prompt.split(": ", 1)[-1].split()
    if prompt.startswith(("Reverse", "Sort")):
        wrong = " ".join(words)  # the input unchanged
    elif prompt.startswith("Repeat"):
        wrong = " ".join(reversed(words))
    elif prompt.startswith("Add"):
        head, total = answer.rsplit(" = ", 1)
        wrong = f"{head} = {int(total[:-1]) + rng.choice([-3, -2, -1, 1, 2, 3])}."
    elif prompt.startswith("Count"):
        wrong = f"There are {len(words) + rng.choice([-2, -1, 1, 2])} words."
    elif prompt.startswith("What colour"):
        thing = prompt.removeprefix("What colour is the ").removesuffix("?")
        wrong = f"The {thing} is {rng.choice(sorted(set(COLOURS.values()) - {COLOURS[thing]}))}."
    else:
        word = prompt.removeprefix("What is the opposite of ").removesuffix("?")
        wrong = f"The opposite of {word} is {word}."
    return wrong if wrong != answer else rng.choice(LAZY_ANSWERS)


def generate_pairs(rng: random.Random, n: int, exclude_prompts: frozenset[str] = frozenset()) -> list[dict[str, str]]:
    pairs = []
    for row in generate_rows(rng, n, exclude_prompts):
        lazy = rng.random() < 1 / 3
        rejected = rng.choice(LAZY_ANSWERS) if lazy else _wrong_answer(rng, row["prompt"], row["response"])
        pairs.append({"prompt": row["prompt"], "chosen": row["response"], "rejected": rejected})
    return pairs

REASONING_SEED = 20251215
NUM_REASONING_TRAIN = 400
NUM_REASONING_VAL = 40


def reasoning_for(prompt: str, response: str) -> str:
    """A short worked trace for one templated task, so traces vary with the row and still end in its answer."""
    words = prompt.split(": ", 1)[-1].split()
    if prompt.startswith("Add "):
        a, b = (int(w.rstrip(".")) for w in prompt.split()[1::2])
        return f"Tens first: {a // 10 * 10} + {b // 10 * 10} = {a // 10 * 10 + b // 10 * 10}. Then the ones: {a % 10} + {b % 10}."
    if prompt.startswith("Reverse"):
        return f"Last word first: {words[-1]}, then {words[-2]}, until {words[0]}."
    if prompt.startswith("Sort"):
        return f"Smallest is {min(words)}, largest is {max(words)}."
    if prompt.startswith("Count"):
        return " ".join(f"{w} is {i}." for i, w in enumerate(words, 1))
    if prompt.startswith("Repeat"):
        return f"Copy the {len(words)} words in order."
    subject, value = response.rstrip(".").removeprefix("The ").rsplit(" is ", 1)
    return f"Recall it: {subject} goes with {value}."


def generate_reasoning_rows(rng: random.Random, n: int) -> list[dict[str, str]]:
    """Rows whose responses carry a `<think>` trace before the answer, as reasoning models write them."""
    return [
        {"prompt": prompt, "response": f"<think>\n{reasoning_for(prompt, response)}\n</think>\n{response}"}
        for prompt, response in (rng.choice(TASKS)(rng) for _ in range(n))
    ]


def write_jsonl(path: Path, rows: Iterable[dict[str, str]]) -> None:
    # Explicit newline keeps the bytes identical across platforms.
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=True) + "\n")


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Plain `tokenizer(text)` then starts with BOS, like the sequences the model trains on.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))]
    )
    return tok


def save_hf_tokenizer(tok, out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"trained vocabulary has {tok.get_vocab_size()} entries, expected {VOCAB_SIZE}; "
            "the generated text is too small to support that many merges"
        )
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != expected_id:
            raise RuntimeError(f"special token {token} got id {tok.token_to_id(token)}, expected {expected_id}")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[USER, ASSISTANT],
        model_max_length=1024,
    )
    hf_tok.save_pretrained(str(out_dir))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    args = parser.parse_args(argv)

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    train = generate_rows(rng, NUM_TRAIN)
    val = generate_rows(rng, NUM_VAL, exclude_prompts=frozenset(row["prompt"] for row in train))
    write_jsonl(out / "tiny_sft_train.jsonl", train)
    write_jsonl(out / "tiny_sft_val.jsonl", val)

    # Its own stream: the SFT rows above, and the tokenizer trained on them, stay as they were.
    reasoning_rng = random.Random(REASONING_SEED)
    write_jsonl(out / "tiny_reasoning_train.jsonl", generate_reasoning_rows(reasoning_rng, NUM_REASONING_TRAIN))
    write_jsonl(out / "tiny_reasoning_val.jsonl", generate_reasoning_rows(reasoning_rng, NUM_REASONING_VAL))

    texts = [text for row in train for text in (row["prompt"], row["response"])]
    save_hf_tokenizer(train_tokenizer(texts), out)
    print(f"wrote {len(train)} train / {len(val)} val rows, {NUM_REASONING_TRAIN} / {NUM_REASONING_VAL} rows with "
          f"reasoning traces and a {VOCAB_SIZE}-token tokenizer to {out}")

    pref_rng = random.Random(PREFERENCE_SEED)
    pref_train = generate_pairs(pref_rng, NUM_PREF_TRAIN)
    pref_val = generate_pairs(pref_rng, NUM_PREF_VAL, exclude_prompts=frozenset(row["prompt"] for row in pref_train))
    write_jsonl(out / "tiny_dpo_train.jsonl", pref_train)
    write_jsonl(out / "tiny_dpo_val.jsonl", pref_val)
    print(f"wrote {len(pref_train)} train / {len(pref_val)} val preference pairs to {out}")


if __name__ == "__main__":
    main()
