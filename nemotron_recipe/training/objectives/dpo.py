"""Direct preference optimization over (prompt, chosen, rejected) pairs (docs/dpo.md).

Batches: the batch plan counts pairs (`trainer.global_batch_size` and `micro_batch_size` are pairs),
so both halves of a pair are always in one micro-batch on one data-parallel rank. A micro-batch of B
pairs is one forward of 2B sequences, chosen halves first, padded to their longest (rounded up as
sequence and context parallel split it) and split over the context-parallel ranks like SFT's.

Normalisation: each micro-batch back-propagates (sum of its pair losses) / (pairs in the global
batch), plus `sft_weight` * (its chosen halves' NLL) / (chosen response tokens in the global batch),
so loss and gradients are those of the whole batch on any mesh. A pair's log-probs are summed over
its response tokens on every context-parallel rank before its loss, which each of those ranks then
back-propagates into its own tokens (`dpo_loss._SumOverSequenceRanks`).

Rows: `loss` (the objective: mean pair loss, plus the weighted NLL term), `rewards/chosen`,
`rewards/rejected`, `rewards/margin` (their difference) and `rewards/accuracy` (the share of pairs
whose chosen reward exceeds the rejected one), means over the global batch; validation rows carry
`val_loss` and the same rewards over the validation pairs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nemotron_recipe.data import collate
from nemotron_recipe.data.preference import PreferenceData, PreferencePairs
from nemotron_recipe.models.nemotron_v3.model import MoE
from nemotron_recipe.training.loss import IGNORE_INDEX
from nemotron_recipe.training.objectives.protocol import StepSums
from nemotron_recipe.training.objectives.dpo_loss import preference_loss, sequence_logps
from nemotron_recipe.training.objectives.reference import (
    BaseReference,
    CopyReference,
    PrecomputedReference,
    cache_paths,
    compute_table,
    fingerprint,
    load_cache,
    missing_cache_error,
    save_cache,
)
from nemotron_recipe.training.setup import DataLayout

log = logging.getLogger(__name__)

# The sums a micro-batch reports, in this order (pair-level values counted on one rank per cp group).
SUMS = ("loss", "chosen_reward", "rejected_reward", "correct", "chosen_nll", "pairs")


@dataclass
class DPOStep:
    """A step's global normalisers: its pairs, and its chosen response tokens (for `sft_weight`)."""

    pairs: int
    chosen_tokens: int
    response_tokens: int  # both halves': the step's trained tokens, for the throughput


def _sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def pair_batches(pairs: PreferencePairs, micro_batch_size: int, dp_rank: int, dp_size: int) -> list[tuple]:
    """This rank's share of every pair (`r, r + dp, ...`) as micro-batches of (pair indices, valid):
    every rank gets as many, topped up with a masked repeat of pair 0, so collectives stay in step."""
    shard = list(range(dp_rank, len(pairs), dp_size))
    num = math.ceil(math.ceil(len(pairs) / dp_size) / micro_batch_size)
    out = []
    for b in range(num):
        indices = shard[b * micro_batch_size: (b + 1) * micro_batch_size]
        valid = [True] * len(indices) + [False] * (micro_batch_size - len(indices))
        out.append((indices + [0] * (micro_batch_size - len(indices)), valid))
    return out


class DPOObjective:
    """DPO (sigmoid or IPO loss, optional NLL on the chosen halves) against a reference model."""

    sequences_per_example = 2

    def __init__(self, *, cfg: Any, model: torch.nn.Module, data: PreferenceData, layout: DataLayout,
                 device: torch.device, pad_id: int, seq_len_divisor: int, trainer: Any, **_: Any) -> None:
        o = cfg.objective
        self.cfg, self.model, self.data, self.layout, self.device = cfg, model, data, layout, device
        self.beta, self.loss_type, self.label_smoothing = float(o.beta), o.loss, float(o.label_smoothing)
        self.sft_weight = float(o.sft_weight)
        self.pad_id, self.divisor, self.seq_len = pad_id, seq_len_divisor, cfg.trainer.seq_len
        self.micro_batch_size = cfg.trainer.micro_batch_size
        self.needs_token_mask = any(isinstance(m, MoE) for m in model.modules())
        self.cp_group = layout.cp.group if layout.cp is not None and layout.cp.size > 1 else None
        # Pair-level values are the same on every rank of a context-parallel group: count them once.
        self.keep = 1.0 if layout.cp is None or layout.cp.rank == 0 else 0.0
        self.reference = self._build_reference(o.reference, trainer)

    # ------------------------------------------------------------------ reference
    def _build_reference(self, kind: str, trainer: Any) -> Any:
        if kind == "base":
            return BaseReference(self.model, self.sequence_logps)
        if kind == "copy":
            return CopyReference(trainer.frozen_copy(), self.sequence_logps)
        return PrecomputedReference(self._precomputed(trainer), self.device)

    def _precomputed(self, trainer: Any) -> dict[str, torch.Tensor]:
        """The cached table of this run (or of the run it resumes), else one computed now from the
        starting weights, before any step, and saved by the main rank."""
        splits = {"train": self.data.train, "val": self.data.val}
        prints = {k: fingerprint(v) for k, v in splits.items()}
        resume_from = trainer.checkpointer.resume_from
        paths = cache_paths(Path(self.cfg.run_dir), resume_from)
        cached = load_cache(paths, prints)
        if cached is not None:
            return cached
        if resume_from is not None and trainer.start_step > 0:
            raise missing_cache_error(paths)
        table = {}
        for split, pairs in splits.items():
            if pairs is None:
                continue
            batches = (self._pair_batch(pairs, idx, valid) for idx, valid in
                       pair_batches(pairs, self.micro_batch_size, self.layout.dp_rank, self.layout.dp_size))
            table[split] = compute_table(pairs, batches, lambda b: self.sequence_logps(self.model, b),
                                         lambda t: _sum(t, self.layout.token_group), self.keep, self.device).cpu()
        if trainer.env.is_main:
            save_cache(paths[0], table, prints)
            log.info("reference log-probs of %s pairs computed and cached in %s",
                     {k: v.shape[0] for k, v in table.items()}, paths[0])
        return table

    # ------------------------------------------------------------------ batches
    def _pair_batch(self, pairs: PreferencePairs, indices: list[int], valid: list[bool] | None = None
                    ) -> dict[str, torch.Tensor]:
        """Pairs `indices` as one batch of their chosen then rejected halves, split over cp ranks."""
        rows = list(indices) + [len(pairs) + i for i in indices]
        batch = collate(pairs.sequences, rows, self.seq_len, self.pad_id, self.divisor)
        if self.needs_token_mask:  # the MoE balance loss and expert loads leave padding out
            lengths = torch.tensor([len(pairs.sequences.input_ids[i]) for i in rows])
            batch["token_mask"] = torch.arange(batch["input_ids"].shape[1]) < lengths[:, None]
        batch = {k: self.layout.shard(v) for k, v in batch.items()}
        batch["pair_index"] = torch.tensor(list(indices), dtype=torch.long)
        if valid is not None:
            batch["valid"] = torch.tensor(valid, dtype=torch.bool)
        return batch

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return self._pair_batch(self.data.train, indices)

    def real_tokens(self, indices: list[int]) -> int:
        pairs = self.data.train
        return sum(len(pairs.chosen.input_ids[i]) + len(pairs.rejected.input_ids[i]) for i in indices)

    # ------------------------------------------------------------------ the step
    def sequence_logps(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[2 * pairs] summed response log-probs of the micro-batch's halves under `model`."""
        kwargs = {"token_mask": batch["token_mask"].to(self.device)} if "token_mask" in batch else {}
        logits = model(batch["input_ids"].to(self.device), **kwargs).logits
        return sequence_logps(logits, batch["targets"], self.cp_group)

    def begin_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> DPOStep:
        """The global batch's pairs and chosen response tokens (a collective over the token ranks)."""
        local = torch.zeros(3, dtype=torch.int64, device=self.device)
        for b in micro_batches:
            pairs = b["pair_index"].numel()
            local[0] += int(pairs * self.keep)
            local[1] += int((b["targets"][:pairs] != IGNORE_INDEX).sum())
            local[2] += int((b["targets"] != IGNORE_INDEX).sum())
        pairs, chosen_tokens, response_tokens = _sum(local, self.layout.token_group).tolist()
        return DPOStep(max(pairs, 1), max(chosen_tokens, 1), response_tokens)

    def _terms(self, batch: dict[str, torch.Tensor], split: str) -> tuple[Any, torch.Tensor]:
        reference = self.reference.logps(batch, split).float()
        policy = self.sequence_logps(self.model, batch)
        b = batch["pair_index"].numel()
        terms = preference_loss(policy[:b], policy[b:], reference[:b], reference[b:], beta=self.beta,
                                loss=self.loss_type, label_smoothing=self.label_smoothing)
        return terms, -policy[:b]

    def _sums(self, terms: Any, chosen_nll: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The micro-batch's `SUMS` over the pairs `weight` keeps, counted once per cp group."""
        correct = (terms.chosen_rewards > terms.rejected_rewards).float()
        parts = [terms.losses.detach(), terms.chosen_rewards, terms.rejected_rewards, correct, chosen_nll.detach()]
        values = torch.stack([(p.float() * weight).sum() for p in parts] + [weight.sum()])
        return values * self.keep

    def forward_backward(self, batch: dict[str, torch.Tensor], step: DPOStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Back-propagates the micro-batch's share of the step's objective; returns its loss sum and `SUMS`."""
        terms, chosen_nll = self._terms(batch, "train")
        total = terms.losses.sum() / step.pairs
        if self.sft_weight:
            total = total + self.sft_weight * chosen_nll.sum() / step.chosen_tokens
        total.backward()
        sums = self._sums(terms, chosen_nll, torch.ones_like(terms.losses))
        return sums[0], sums

    def finish_step(self, losses: list[torch.Tensor], extras: list[torch.Tensor], step: DPOStep) -> StepSums:
        total = torch.stack(extras).sum(0)
        return StepSums(total[0], step.response_tokens, (total, step))

    def finite_value(self, sums: StepSums) -> torch.Tensor:
        return sums.extra[0]

    def _metrics(self, total: torch.Tensor, chosen_tokens: int, prefix: str) -> dict[str, float]:
        """Loss and rewards from summed `SUMS` over every rank."""
        values = dict(zip(SUMS, total.tolist()))
        pairs = max(values["pairs"], 1.0)
        loss = values["loss"] / pairs + self.sft_weight * values["chosen_nll"] / max(chosen_tokens, 1)
        chosen, rejected = values["chosen_reward"] / pairs, values["rejected_reward"] / pairs
        row = {f"{prefix}loss": loss}
        if self.sft_weight:
            row[f"{prefix}sft_loss"] = values["chosen_nll"] / max(chosen_tokens, 1)
        return {**row, "rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margin": chosen - rejected,
                "rewards/accuracy": values["correct"] / pairs}

    def row(self, sums: StepSums) -> dict[str, float]:
        total, step = sums.extra
        return self._metrics(_sum(total.clone(), self.layout.token_group), step.chosen_tokens, "")

    @torch.no_grad()
    def validate(self, max_batches: int | None) -> dict[str, float] | None:
        pairs = self.data.val
        if pairs is None:
            return None
        batches = pair_batches(pairs, self.micro_batch_size, self.layout.dp_rank, self.layout.dp_size)
        if max_batches is not None:
            batches = batches[:max_batches]
        total = torch.zeros(len(SUMS), dtype=torch.float32, device=self.device)
        chosen_tokens = torch.zeros((), dtype=torch.float32, device=self.device)
        self.model.eval()
        try:
            for indices, valid in batches:
                batch = self._pair_batch(pairs, indices, valid)
                weight = batch["valid"].float().to(self.device)
                terms, chosen_nll = self._terms(batch, "val")
                total += self._sums(terms, chosen_nll, weight)
                chosen = (batch["targets"][: len(indices)] != IGNORE_INDEX).sum(-1).float().to(self.device)
                chosen_tokens += (chosen * weight).sum()
        finally:
            self.model.train()
        reduced = _sum(torch.cat([total, chosen_tokens[None]]), self.layout.token_group)
        return self._metrics(reduced[:-1], int(reduced[-1].item()), "val_")
