"""Generate text from a model: `python -m recipes.generate PATH --prompt TEXT [options]`.

PATH is a training checkpoint (a `step_N` directory or a run/checkpoints directory; a LoRA checkpoint
uses the base it recorded, adapters unmerged), a Hugging Face model directory (an export of ours or a
released Nemotron-H), or a PEFT adapter directory (its base from adapter_config.json or --base).

Prompts: --prompt (repeatable) and --prompts-file (one prompt a line, or one JSON list of chat
messages a line, which is rendered with the chat template). --chat renders plain prompts as a user
turn (after --system) with the tokenizer's chat template. Sampling is greedy unless --temperature,
--top-p or --top-k is given (--greedy forces greedy). Without --json the completions stream to the
console as they are produced (token by token at --batch-size 1, the default; a batch at a time
otherwise); --json prints one list of {prompt, completion, completion_ids, finish_reason}.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

# Before anything imports torch: OpenMP reads its thread settings once, when torch loads it, and on
# cores other jobs share its spinning threads make decoding steps many times slower.
from nemotron_recipe.training.threads import choose_threads

choose_threads()

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m recipes.generate", description=__doc__.splitlines()[0])
    p.add_argument("path", help="training checkpoint, Hugging Face model directory, or PEFT adapter directory")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="one prompt, or one JSON list of chat messages, per line")
    p.add_argument("--chat", action="store_true", help="render plain prompts with the tokenizer's chat template")
    p.add_argument("--system", help="a system message before each chat prompt (implies --chat)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--greedy", action="store_true", help="take the most likely token (the default)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--compile", action="store_true",
                   help="compile the one-row decoding steps (CPU, --batch-size 1): faster steps after a compile "
                        "of some seconds; on an idle machine OMP_WAIT_POLICY=ACTIVE speeds them up further")
    p.add_argument("--base", help="the base model directory of a PEFT adapter (default: the one it names)")
    p.add_argument("--tokenizer", help="a tokenizer directory or tokenizer.json (default: the model's)")
    p.add_argument("--json", action="store_true", help="print a JSON list of results instead of streaming text")
    return p.parse_args(argv)


def read_prompts(args: argparse.Namespace) -> list[str | list[dict]]:
    """The prompts in order: each --prompt, then each non-empty line of --prompts-file."""
    from nemotron_recipe.generation import GenerationError

    prompts: list[str | list[dict]] = list(args.prompt)
    if args.prompts_file:
        try:
            lines = Path(args.prompts_file).expanduser().read_text().splitlines()
        except OSError as e:
            raise GenerationError(f"--prompts-file {args.prompts_file}: unreadable ({e.strerror}). Fix: give an "
                                  "existing text file, one prompt per line.") from None
        for n, line in enumerate(lines, 1):
            if line.strip().startswith("["):
                try:
                    messages = json.loads(line)
                except ValueError as e:
                    raise GenerationError(f"--prompts-file {args.prompts_file} line {n}: not a JSON message list "
                                          f"({e}). Fix: one JSON list of {{role, content}} objects per line.") from None
                if not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
                    raise GenerationError(f"--prompts-file {args.prompts_file} line {n}: every message needs a role "
                                          "and a content.")
                prompts.append(messages)
            elif line.strip():
                prompts.append(line)
    if not prompts:
        raise GenerationError("no prompt given. Fix: pass --prompt TEXT or --prompts-file FILE.")
    return prompts


def encode(prompts: list[str | list[dict]], tokenizer, chat: bool, system: str | None) -> list[list[int]]:
    """Token ids of each prompt; chat prompts (message lists, or all with --chat) through the template."""
    from nemotron_recipe.generation import GenerationError

    if tokenizer is None:
        raise GenerationError("the model has no tokenizer beside it. Fix: pass --tokenizer DIR.")
    needs_template = chat or any(not isinstance(p, str) for p in prompts)
    if needs_template and not tokenizer.chat_template:
        raise GenerationError("--chat (or a JSON message list prompt) needs a chat template, and this tokenizer has "
                              "none. Fix: pass --tokenizer with a template (an export of a chat fine-tuning run "
                              "writes one), or drop --chat and give plain prompts.")
    ids = []
    for p in prompts:
        if needs_template:
            messages = [{"role": "user", "content": p}] if isinstance(p, str) else p
            if system:
                messages = [{"role": "system", "content": system}, *messages]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            ids.append(tokenizer.encode(p))
    return ids


def generation_config(args: argparse.Namespace, source):
    from nemotron_recipe.generation import GenerationConfig

    sampled = not args.greedy and any(v is not None for v in (args.temperature, args.top_p, args.top_k))
    return GenerationConfig(
        max_new_tokens=args.max_new_tokens, greedy=not sampled,
        temperature=1.0 if args.temperature is None else args.temperature,
        top_p=1.0 if args.top_p is None else args.top_p, top_k=args.top_k or 0, seed=args.seed,
        batch_size=args.batch_size, max_length=source.max_length, compile=args.compile)


def run(args: argparse.Namespace) -> int:
    import torch

    from nemotron_recipe.generation import generate
    from nemotron_recipe.generation.generate import check_prompts
    from nemotron_recipe.generation.loading import resolve

    source = resolve(args.path, base=args.base, tokenizer=args.tokenizer)
    prompts = read_prompts(args)
    config = generation_config(args, source)
    ids = encode(prompts, source.tokenizer, args.chat or args.system is not None, args.system)
    check_prompts(ids, config, source.config.vocab_size)
    device = torch.device(args.device)
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    model = source.load(device, getattr(torch, DTYPES[dtype]))
    if args.json:
        results = generate(model, ids, config, tokenizer=source.tokenizer)
        print(json.dumps([{"prompt": p, "completion": r.text, "completion_ids": r.completion_ids,
                           "finish_reason": r.finish_reason} for p, r in zip(prompts, results)], indent=2))
        return 0
    for start in range(0, len(prompts), config.batch_size):
        batch = range(start, min(start + config.batch_size, len(prompts)))
        live = len(batch) == 1
        if live:
            _show_prompt(prompts[start])
        stream = (lambda _, delta: print(delta, end="", flush=True)) if live else None
        results = generate(model, [ids[i] for i in batch], config, tokenizer=source.tokenizer, stream=stream)
        for i, result in zip(batch, results):
            if not live:
                _show_prompt(prompts[i])
                print(result.text, end="")
            print(f"\n[{result.finish_reason}, {len(result.completion_ids)} tokens]\n", flush=True)
    return 0


def _show_prompt(prompt: str | list[dict]) -> None:
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
    print(f">>> {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    from nemotron_recipe.generation import GenerationError
    from nemotron_recipe.models.nemotron_v3 import CheckpointError, ModelConfigError

    try:
        return run(args)
    except (GenerationError, CheckpointError, ModelConfigError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
