"""Samples during training: at each validation, a few prompts continued greedily under the training mesh.

Decoding recomputes the whole sequence through the training forward at every new token, so it runs
under any mesh with no cache: the prompts are right-padded to one fixed length (a multiple of the
mesh's sequence divisor, so context and sequence parallel split it as in training), and each row's
next token is read at its last real position, which padding after it cannot reach (attention and the
Mamba scan are causal). Every rank runs the same forwards on the same prompts; the next tokens are
the argmax over the whole vocabulary, gathered from the context-parallel rank that holds the position
and from every vocab shard of a tensor-parallel head, then broadcast from rank 0, so all ranks
continue alike and the ids equal one process's.

What runs the forward is a `Forward`: by default the model on this rank; a pipeline passes its
schedule's, which runs the stages in order and broadcasts the ids its last stage picked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from nemotron_recipe.data import ChatFormatter
from nemotron_recipe.data.examples import IGNORE_INDEX, SFTExamples
from nemotron_recipe.distributed.context_parallel import ContextParallel, shard_sequence, zigzag_positions
from nemotron_recipe.training.loss import is_vocab_sharded

log = logging.getLogger(__name__)

DEFAULT_COUNT = 2  # prompts taken from the validation set when eval.samples is not given

# One decoding step: (this rank's input ids [b, l_local], pick) -> the next token of each row [b], the
# same on every rank that runs it; `pick` turns the training forward's logits into those ids.
Pick = Callable[[torch.Tensor], torch.Tensor]
Forward = Callable[[torch.Tensor, Pick], torch.Tensor]


def model_forward(model: nn.Module) -> Forward:
    """The decoding step of a model held whole (or sharded by FSDP, TP, CP, EP) on this rank."""
    return lambda ids, pick: pick(model(ids).logits)


@dataclass
class Prompt:
    text: str  # as shown: the user's words (no format tokens)
    ids: list[int]  # as the model reads it: the training chat format, ending with the assistant's opening
    reference: str | None = None  # the validation set's answer, when the prompt comes from it


def _pick_positions(logits: torch.Tensor, last: torch.Tensor, length: int, cp: ContextParallel | None) -> torch.Tensor:
    """[b, v] local-vocab logits at each row's global position `last[b]`, from [b, l_local, v] local logits."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    if cp is None or cp.size == 1:
        return logits[rows, last]
    held = zigzag_positions(length, cp.size, cp.rank, logits.device)
    match = held[None, :] == last[:, None]  # [b, l_local]: true at most once per row, on one rank
    picked = logits[rows, match.int().argmax(dim=1)].float()
    picked = torch.where(match.any(dim=1, keepdim=True), picked, torch.full_like(picked, float("-inf")))
    dist.all_reduce(picked, op=dist.ReduceOp.MAX, group=cp.group)
    return picked


def next_tokens(logits: torch.Tensor, last: torch.Tensor, length: int, cp: ContextParallel | None) -> torch.Tensor:
    """The greedy next token of each row: argmax over the whole vocabulary at position `last[b]`.
    `logits` are the training forward's: plain, or a DTensor (vocab-sharded under tensor parallel)."""
    if isinstance(logits, DTensor) and is_vocab_sharded(logits) and len(logits.placements) == 1:
        picked = _pick_positions(logits.to_local(), last, length, cp)
        # The shards' columns put back in vocab order (uneven shards included): the argmax then sees
        # the same values, in the same order, as one process, and breaks ties the same way.
        full = DTensor.from_local(picked, logits.device_mesh, [Shard(1)], run_check=False,
                                  shape=(picked.shape[0], logits.shape[-1]),
                                  stride=(logits.shape[-1], 1)).full_tensor()
    else:
        full = _pick_positions(logits.full_tensor() if isinstance(logits, DTensor) else logits, last, length, cp)
    return full.float().argmax(dim=-1)


@torch.no_grad()
def greedy_continue(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_id: int | None,
    pad_id: int,
    seq_len_divisor: int = 1,
    cp: ContextParallel | None = None,
    device: torch.device | str = "cpu",
    forward: Forward | None = None,
) -> list[tuple[list[int], str]]:
    """Each prompt's greedy continuation (ids, without the EOS) and why it ended ("eos" or "length").

    Called on every rank of the mesh with the same prompts; each rank passes this rank's context-parallel
    group. `forward` runs each step (default: `model_forward(model)`). The model runs in eval mode and
    is put back in training mode after."""
    if not prompts or max_new_tokens <= 0:
        return [([], "length") for _ in prompts]
    longest = max(len(p) for p in prompts) + max_new_tokens
    length = -(-longest // seq_len_divisor) * seq_len_divisor  # one shape for every step
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(list(p), dtype=torch.long)
    ends = torch.tensor([len(p) for p in prompts], device=device)  # next free position of each row
    finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    ended_by_eos = finished.clone()
    forward = forward or model_forward(model)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            pick = partial(next_tokens, last=ends - 1, length=length, cp=cp)
            nxt = forward(shard_sequence(ids, cp), pick)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(nxt, src=0)  # every rank takes the same token, whatever rounding did
            active = ~finished
            rows = active.nonzero().flatten()
            ids[rows, ends[rows]] = nxt[rows]
            ends[rows] += 1
            if eos_id is not None:
                ended_by_eos |= active & (nxt == eos_id)
            finished |= ended_by_eos
            if bool(finished.all()):
                break
    finally:
        model.train(was_training)
    out = []
    for b, p in enumerate(prompts):
        new = ids[b, len(p):int(ends[b])].tolist()
        eos = bool(ended_by_eos[b])
        out.append((new[:-1] if eos else new, "eos" if eos else "length"))
    return out


def validation_prompts(val: SFTExamples | None, tokenizer: Any, count: int = DEFAULT_COUNT) -> list[Prompt]:
    """The first `count` validation examples cut before their first trained token (the reply): the prompt
    exactly as training showed it, and the reply as the reference."""
    prompts: list[Prompt] = []
    if val is None:
        return prompts
    for ids, targets in zip(val.input_ids, val.targets):
        trained = [t for t, target in enumerate(targets) if target != IGNORE_INDEX]
        if not trained:
            continue
        start = trained[0]  # position `start` predicts the reply's first token
        reply = []
        for target in targets[start:]:
            if target == IGNORE_INDEX:
                break
            reply.append(target)
        prompts.append(Prompt(tokenizer.decode(ids[:start + 1], skip_special_tokens=True), list(ids[:start + 1]),
                              tokenizer.decode(reply, skip_special_tokens=True)))
        if len(prompts) == count:
            break
    return prompts


def configured_prompts(texts: Sequence[str], formatter: ChatFormatter) -> list[Prompt]:
    """`eval.samples`: each text a user turn, rendered in the training chat format with the assistant's opening."""
    return [Prompt(text, formatter.encode_prompt([{"role": "user", "content": text}], f"eval.samples[{i}]"))
            for i, text in enumerate(texts)]


class Samples:
    """The run's samples: generated at each validation on every rank, written by the main rank's writer
    (samples.jsonl, the console, a wandb table); the first and last pass of this run go into the summary."""

    def __init__(self, model: nn.Module, prompts: list[Prompt], tokenizer: Any, writer: Any, *, max_new_tokens: int,
                 seq_len_divisor: int, cp: ContextParallel | None, device: torch.device,
                 forward: Forward | None = None) -> None:
        self.model, self.prompts, self.tokenizer, self.writer = model, prompts, tokenizer, writer
        self.forward = forward
        self.max_new_tokens, self.seq_len_divisor, self.cp, self.device = max_new_tokens, seq_len_divisor, cp, device
        self.first: list[dict[str, Any]] | None = None
        self.last: list[dict[str, Any]] | None = None

    def run(self, step: int) -> None:
        if not self.prompts or self.max_new_tokens <= 0:
            return
        results = greedy_continue(
            self.model, [p.ids for p in self.prompts], self.max_new_tokens, eos_id=self.tokenizer.eos_token_id,
            pad_id=self.tokenizer.pad_token_id, seq_len_divisor=self.seq_len_divisor, cp=self.cp, device=self.device,
            forward=self.forward)
        rows = [{"step": step, "prompt": p.text, "completion": self.tokenizer.decode(ids, skip_special_tokens=True),
                 "completion_ids": ids, "finish_reason": why,
                 **({"reference": p.reference} if p.reference is not None else {})}
                for p, (ids, why) in zip(self.prompts, results)]
        self.first = self.first or rows
        self.last = rows
        self.writer.log_samples(rows)

    def summary(self) -> dict[str, Any]:
        return {"first_samples": self.first, "last_samples": self.last}
