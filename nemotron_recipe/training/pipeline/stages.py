"""A Nemotron-H cut into pipeline stages that keep the model's parameter names.

A stage is a `NemotronHForCausalLM` holding a contiguous run of decoder blocks under their original
indices (`model.layers` becomes a ModuleDict keyed "5", "6", ...), the embedding on the first stage,
and the final norm, `lm_head` and the MTP layers on the last. Nothing is copied: the stages hold the
full model's own modules, and every parameter keeps its name (`model.layers.5.mixer.in_proj.weight`),
so training checkpoints reshard across pipeline sizes and the Hugging Face and LoRA exports read a
pipeline's checkpoint as any other. The model's parallelizer then runs on each stage as on a model.

Between stages travel only the residual stream and, with MTP layers, the shifted tokens' embeddings
(the embedding sits on the first stage, the MTP layers on the last); their gradients travel back.
The side inputs of a micro-batch (targets, document ids, token mask, MTP targets) are the same on
every stage of a data-parallel group, which reads the same examples: each stage takes them from
`StageInputs`. The last stage computes the micro-batch's losses and returns its share of the step's
objective, normalised as the one-stage path does (by the step's trained tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nemotron_recipe.models.nemotron_v3 import NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.lora import adapter_parameters

# What the last stage returns: [its share of the step's objective, main loss sum, MTP loss sum].
LAST_STAGE_OUTPUTS = 3


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The full value of a (possibly tensor-parallel) scalar, keeping its autograd history."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@dataclass
class StageInputs:
    """One step's micro-batches as every local stage reads them, and what the last stage reports.

    Each stage reads the micro-batches in order, one per forward: every torch schedule runs a stage's
    forwards in micro-batch order (an activation-checkpointing recompute runs inside a block, not
    through the stage). `after_forward` is called with a stage after each of its training forwards."""

    batches: list[dict[str, torch.Tensor]] = field(default_factory=list)
    denominator: float = 1.0  # the step's trained tokens, over every data- and context-parallel rank
    loss_chunk_size: int = 0
    mtp_loss_scale: float = 0.0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    after_forward: Callable[[nn.Module], None] | None = None
    cursors: dict[int, int] = field(default_factory=dict)
    sums: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)

    def start(self, batches: list[dict[str, torch.Tensor]], denominator: float) -> None:
        self.batches, self.denominator = batches, max(float(denominator), 1.0)
        self.cursors, self.sums = {}, {}

    def next(self, stage: int) -> tuple[int, dict[str, torch.Tensor]]:
        index = self.cursors.get(stage, 0)
        if index >= len(self.batches):
            raise RuntimeError(f"pipeline stage {stage} ran more forwards than the step has micro-batches "
                               f"({len(self.batches)})")
        self.cursors[stage] = index + 1
        return index, self.batches[index]

    def side(self, batch: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
        value = batch.get(name)
        return None if value is None else value.to(self.device)


class StageDecoder(nn.Module):
    """The decoder part of a stage under the decoder's own names: `embeddings` (first stage only),
    `layers` (this stage's blocks, keyed by their index in the full model), `norm_f` (last stage only)."""

    def __init__(self, full: nn.Module, blocks: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.embeddings = full.embeddings if first else None
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in blocks})
        self.norm_f = full.norm_f if last else None

    def ordered_layers(self) -> list[nn.Module]:
        return [self.layers[k] for k in sorted(self.layers.keys(), key=int)]


class PipelineStageModel(NemotronHForCausalLM):
    """Stage `stage_index` of `num_stages`: the blocks `blocks` of `full`, with the embedding on the
    first stage and the final norm, head and MTP layers on the last. Its forward takes the previous
    stage's outputs (the first stage: the input ids) and returns the next stage's inputs, or on the
    last stage [objective share, loss sum, MTP loss sum] (`LAST_STAGE_OUTPUTS`), or, for a batch
    without targets (forward only), the logits."""

    def __init__(self, full: NemotronHForCausalLM, stage_index: int, num_stages: int, blocks: range,
                 inputs: StageInputs) -> None:
        nn.Module.__init__(self)  # the full model's modules, not new ones
        self.config = full.config
        self.stage_index, self.num_stages, self.blocks = stage_index, num_stages, blocks
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.model = StageDecoder(full.model, blocks, first=self.is_first, last=self.is_last)
        self.lm_head = full.lm_head if self.is_last else None
        self.mtp = full.mtp if self.is_last else None
        self.inputs = inputs
        # The MTP layers' embedded inputs come from the first stage, whose embedding they need.
        self.carries_mtp = full.mtp is not None and full.config.effective_mtp_loss_scale > 0

    def extra_repr(self) -> str:
        return f"stage {self.stage_index} of {self.num_stages}, blocks {self.blocks.start}..{self.blocks.stop - 1}"

    def forward(self, *received: torch.Tensor):  # type: ignore[override]
        index, batch = self.inputs.next(self.stage_index)
        side = self.inputs.side
        document_ids, token_mask = side(batch, "document_ids"), side(batch, "token_mask")
        if self.is_first:
            hidden, carried = self.model.embeddings(received[0]), ()
            if self.carries_mtp and self.training:
                shifted = side(batch, "mtp_input_ids")
                carried = (torch.stack([self.model.embeddings(shifted[..., k].contiguous())
                                        for k in range(shifted.shape[-1])], dim=2),)
        else:
            hidden, *carried = received
        for block in self.model.ordered_layers():
            hidden = block(hidden, document_ids=document_ids, token_mask=token_mask)
        if not self.is_last:
            out = (hidden, *carried)
        elif "targets" in batch:
            out = self._losses(index, self.model.norm_f(hidden), carried, batch)
        else:  # forward only, without targets (decoding): the logits, as the whole model gives them
            out = self.lm_head(self.model.norm_f(hidden)).float()
        # After the MTP layers too: their MoE blocks' loads are this micro-batch's only from here on.
        if self.training and torch.is_grad_enabled() and self.inputs.after_forward is not None:
            self.inputs.after_forward(self)
        return out

    def _losses(self, index: int, hidden: torch.Tensor, carried, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The micro-batch's loss sums, recorded for the step's metrics, and its share of the objective:
        (loss sum + mtp_loss_scale x MTP loss sum) / the step's trained tokens."""
        inputs, side = self.inputs, self.inputs.side
        chunk = inputs.loss_chunk_size or 0
        main = _plain(self._head_loss_sum(hidden, side(batch, "targets"), chunk))
        mtp = None
        if carried and self._runs_mtp():
            per_depth = self.mtp(hidden, None, None, side(batch, "document_ids"), side(batch, "token_mask"),
                                 embedded_ids=carried[0])
            targets = side(batch, "mtp_targets")
            mtp = _plain(sum(self._head_loss_sum(h, targets[..., k].contiguous(), chunk)
                             for k, h in enumerate(per_depth)) / len(per_depth))
        total = main if mtp is None else main + inputs.mtp_loss_scale * mtp
        inputs.sums[index] = (main.detach().float(), None if mtp is None else mtp.detach().float())
        zero = torch.zeros((), dtype=torch.float32, device=main.device)
        return torch.stack([(total / inputs.denominator).float(), main.detach().float(),
                            zero if mtp is None else mtp.detach().float()])


def stage_blocks(starts: list[int], num_blocks: int, stage: int) -> range:
    """The blocks of `stage` from the first block of every stage."""
    stop = starts[stage + 1] if stage + 1 < len(starts) else num_blocks
    return range(starts[stage], stop)


def cut_stages(model: NemotronHForCausalLM, starts: list[int], local: list[int],
               inputs: StageInputs) -> list[PipelineStageModel]:
    """The stages `local` (indices into the `len(starts)` stages) of `model`; the blocks of the other
    stages are left out, as is everything else those stages hold."""
    n = model.config.num_layers
    if starts[0] != 0 or any(b <= a for a, b in pairwise(starts)) or starts[-1] >= n:
        raise ValueError(f"stage starts {starts}: must begin at 0 and increase below the {n} blocks")
    return [PipelineStageModel(model, s, len(starts), stage_blocks(starts, n, s), inputs) for s in local]


class PipelineParts(nn.Module):
    """This rank's stages under the full model's names: what the trainer holds as its model.

    Its parameters, buffers and modules are those of the local stages, named as in the full model, so
    the optimizer, checkpoints, the Hugging Face import, router balancing and the non-finite checks see
    a model that lacks only the other ranks' parts. Calling it runs the pipeline (`run`, set by the
    schedule) on one batch, forward only: validation goes through the stages like training does."""

    returns_loss_sums = True  # given targets, its output holds loss_sum and num_tokens, never logits

    def __init__(self, full: NemotronHForCausalLM, stages: list[PipelineStageModel]) -> None:
        super().__init__()
        self.config = full.config
        self.stages = stages  # a plain list: the stages' modules are registered below, once, by name
        first = next((s for s in stages if s.is_first), None)
        last = next((s for s in stages if s.is_last), None)
        self.model = nn.Module()
        if first is not None:
            self.model.embeddings = first.model.embeddings
        self.model.layers = nn.ModuleDict({k: v for s in stages for k, v in s.model.layers.items()})
        if last is not None:
            self.model.norm_f = last.model.norm_f
            self.lm_head = last.lm_head
            self.mtp = last.mtp
        else:
            self.mtp = None
        # Every adapter of the whole model (LoRA): each is drawn at init as on one process (lora.initial_values).
        self.adapter_shapes = {name: tuple(p.shape) for name, p in adapter_parameters(full).items()}
        self.run: Callable[..., object] | None = None

    def train(self, mode: bool = True) -> PipelineParts:
        super().train(mode)
        for stage in self.stages:  # not registered here, and their forwards read their own mode
            stage.train(mode)
        return self

    def forward(self, input_ids: torch.Tensor, **kwargs):
        if self.run is None:
            raise RuntimeError("a pipeline's parts run through its schedule; none is attached yet")
        return self.run(input_ids, **kwargs)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
