"""A DPO step against an SFT step on the same pairs, and DPO's reference=copy against reference=base.

    python -m benchmarks.dpo --preset h1024 --dtype bf16
    python -m benchmarks.dpo --preset h1024 --hidden 512 --pairs 2 --prompt-len 64 --response-len 64

One process, LoRA (rank 8 on the default targets, fp32 adapters over a base stored in `--dtype`). Every
step is forward, backward and an AdamW step on the same batch of `--pairs` pairs (2 x pairs sequences
of prompt + response tokens, the response trained):
- `sft`: the recipe's SFT loss on the chosen and rejected sequences together (`forward_loss_sum`);
- `dpo base`: DPO with the reference the base with the adapters switched off (`BaseReference`): a
  no-grad forward of the 2 x pairs sequences, then the policy's forward and backward (`sequence_logps`,
  `preference_loss`, the objective's own functions);
- `dpo copy`: the same with the reference a frozen copy of the base (`CopyReference`);
- `dpo precomputed`: the same with the reference's log-probs read from a table computed once before
  the timing (`PrecomputedReference`): no reference forward in the step.
The steps alternate within each round, so load on a shared machine falls on all alike; each reports
its median. Parameter memory: the bytes of the distinct parameter and buffer storages the step's
models hold (the policy, plus the copy under reference=copy, plus the table's bytes under precomputed).

Each run appends a row to a table in benchmarks/RESULTS.md with the exact command (`--no-record` to skip).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
import sys

import torch

from benchmarks.results import append_row, measured, mib
from benchmarks.throughput import BENCH_PRESETS, device_name, interleaved_times
from nemotron_recipe.models.nemotron_v3 import PRESETS, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.lora import DEFAULT_TARGETS, LoRASpec, add_adapters, freeze_base, init_adapters
from nemotron_recipe.training.loss import IGNORE_INDEX, forward_loss_sum
from nemotron_recipe.training.objectives.dpo_loss import preference_loss, sequence_logps
from nemotron_recipe.training.objectives.reference import BaseReference, CopyReference, PrecomputedReference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEADER = ("| date (commit) | device | model | base dtype | pairs x (prompt + response) | sft s/step | dpo base s/step | "
          "dpo copy s/step | dpo precomputed s/step | dpo base / sft | copy / base | precomputed / base | "
          "parameter memory: sft / base adds / copy adds / precomputed adds | command |")


def build(cfg, dtype: torch.dtype, seed: int, adapters: bool, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(cfg).to(dtype)
    if adapters:
        add_adapters(model, LoRASpec(rank=8, alpha=32.0, target_modules=tuple(DEFAULT_TARGETS)))
        init_adapters(model, seed)
        freeze_base(model)
        with torch.no_grad():  # a trained adapter, so policy and reference differ as mid-run
            for name, p in model.named_parameters():
                if p.requires_grad:
                    p.normal_(0, 0.02)
    else:
        model.requires_grad_(False).eval()
    return model.to(device)


def pairs_batch(vocab: int, pairs: int, prompt: int, response: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2 * pairs, prompt + response), generator=g)
    ids[pairs:, :prompt] = ids[:pairs, :prompt]  # the halves of a pair share their prompt
    targets = torch.roll(ids, -1, dims=1)
    targets[:, : prompt - 1] = IGNORE_INDEX
    targets[:, -1] = IGNORE_INDEX
    return ids.to(device), targets.to(device)


def precomputed_table(reference: torch.nn.Module, logps, batch: dict[str, torch.Tensor], pairs: int
                      ) -> dict[str, torch.Tensor]:
    """The [pairs, 2] (chosen, rejected) table `reference=precomputed` reads, from the starting weights."""
    with torch.no_grad():
        values = logps(reference, batch).float()
    return {"train": torch.stack([values[:pairs], values[pairs:]], dim=1)}


def held_bytes(*models: torch.nn.Module) -> int:
    seen, total = set(), 0
    for model in models:
        for t in [*model.parameters(), *model.buffers()]:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="h1024")
    parser.add_argument("--hidden", type=int, default=None, help="override hidden_size (a reduced size)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-record", action="store_true")
    return parser.parse_args(argv)


def _steps(args: argparse.Namespace, policy: torch.nn.Module, copy: torch.nn.Module, device: torch.device):
    """One optimizer step of each variant on the same pairs, and the precomputed reference's table."""
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-5)
    ids, targets = pairs_batch(policy.config.vocab_size, args.pairs, args.prompt_len, args.response_len, device)
    batch = {"input_ids": ids, "targets": targets}
    index = torch.arange(args.pairs)

    def logps(model, b):
        return sequence_logps(model(b["input_ids"]).logits, b["targets"])

    def finish():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sft():
        forward_loss_sum(policy, ids, targets, backward_denominator=(targets != IGNORE_INDEX).sum())
        finish()

    def dpo(reference):
        def step():
            ref = reference.logps({**batch, "pair_index": index}, "train").float()
            pol = logps(policy, batch)
            p = args.pairs
            preference_loss(pol[:p], pol[p:], ref[:p], ref[p:], beta=0.1).losses.mean().backward()
            finish()
        return step

    table = precomputed_table(copy, logps, batch, args.pairs)
    steps = {"sft": sft, "dpo base": dpo(BaseReference(policy, logps)), "dpo copy": dpo(CopyReference(copy, logps)),
             "dpo precomputed": dpo(PrecomputedReference(table, device))}
    return steps, table


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)
    cfg = {**PRESETS, **BENCH_PRESETS}[args.preset]
    if args.hidden:
        cfg = dataclasses.replace(cfg, hidden_size=args.hidden)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    policy = build(cfg, dtype, 0, adapters=True, device=device)
    copy = build(cfg, dtype, 0, adapters=False, device=device)
    steps, table = _steps(args, policy, copy, device)
    times, cpu = interleaved_times(steps, device, args.warmup, args.rounds)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    table_bytes = table["train"].numel() * table["train"].element_size()
    memory = {"sft": held_bytes(policy), "dpo base": held_bytes(policy), "dpo copy": held_bytes(policy, copy),
              "dpo precomputed": held_bytes(policy) + table_bytes}
    for k in steps:
        print(f"{k:15s} {med[k]:.3f} s/step (cpu {med_cpu[k]:.3f} s)  parameter memory {memory[k] / 2**20:.1f} MiB")
    ratio = lambda a, b: f"{med[a] / med[b]:.2f}x (cpu {med_cpu[a] / med_cpu[b]:.2f}x)"  # noqa: E731
    adds = lambda k, b: f"+{mib(memory[k] - memory[b])}"  # noqa: E731
    print(f"dpo base / sft: {ratio('dpo base', 'sft')}, parameter memory {adds('dpo base', 'sft')}; "
          f"dpo copy / dpo base: {ratio('dpo copy', 'dpo base')}, {adds('dpo copy', 'dpo base')}; "
          f"dpo precomputed / dpo base: {ratio('dpo precomputed', 'dpo base')}, {adds('dpo precomputed', 'dpo base')}")
    if args.no_record:
        return
    size = args.preset + (f" (hidden {args.hidden})" if args.hidden else "")
    command = "python -m benchmarks.dpo " + shlex.join(argv if argv is not None else sys.argv[1:])
    append_row(HEADER, (
        f"| {measured()} | {device_name(device)} | {size} | {args.dtype} | {args.pairs} x "
        f"({args.prompt_len} + {args.response_len}) | {med['sft']:.3f} | {med['dpo base']:.3f} | "
        f"{med['dpo copy']:.3f} | {med['dpo precomputed']:.3f} | {ratio('dpo base', 'sft')} | "
        f"{ratio('dpo copy', 'dpo base')} | {ratio('dpo precomputed', 'dpo base')} | {mib(memory['sft'])} / "
        f"{adds('dpo base', 'sft')} / {adds('dpo copy', 'dpo base')} / {adds('dpo precomputed', 'dpo base')} | "
        f"`{command}` |"))


if __name__ == "__main__":
    main()
