"""Decoding steps of a single row as compiled code (`GenerationConfig.compile`), on CPU.

At one row a step reads every weight once and, beside its matmuls, runs some 550 small operations
(norms, the conv and SSM state updates, casts, residual adds), each a separate kernel call. Here the
whole step of a Mamba2 or MLP block, from its norm to its residual add, is one function compiled by
`torch.compile`: the small operations fuse into a few loops, and each projection is written as a
multiply-and-sum over the weight's rows (fp32 sums, as oneDNN's and MKL's kernels accumulate), which
inductor turns into one loop that streams the weight. `python -m benchmarks.decode --compile`
measures it against the eager step and transformers'.

Blocks of one kind share one compiled function (weights and cache tensors are its arguments), so a
model compiles once per block kind, dtype and size, at its first step: some seconds, which a long
generation earns back and a short one does not; hence off by default. Attention and MoE blocks run
eagerly, as do blocks whose projections are not plain CPU `nn.Linear`s (LoRA adapters, NF4, FP8,
sharded weights), and batches of several rows (their steps are matmul-bound; the reordered weights
of packed.py serve them). If compiling fails, a warning says why and every block runs eagerly.

The results equal the eager step's up to the order of fp32 sums.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from nemotron_recipe.models.nemotron_v3.model import Block, mamba_step
from nemotron_recipe.models.nemotron_v3.norms import gated_group_rms_norm, rms_norm

from .packed import packable

log = logging.getLogger(__name__)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [1, in] times weight [out, in] transposed, summed in fp32, in x's dtype: [1, out]."""
    out = (weight.float() * x.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)[None]


def _mamba_block_step(x: torch.Tensor, window: torch.Tensor, state: torch.Tensor, weights: tuple,
                      constants: tuple, sizes: tuple) -> torch.Tensor:
    """`Block.forward` of a Mamba2 block for one decoded token, x [1, 1, d]."""
    norm_w, in_w, in_b, gate_w, out_w, out_b = weights
    norm_eps, r, p, n, gate_group, gate_eps, dt_limit = sizes
    zxbcdt = _linear(rms_norm(x, norm_w, norm_eps).view(1, -1), in_w, in_b).view(1, 1, -1, 2 * r * p + 2 * n + r)
    z, xbc, dt = zxbcdt.split([r * p, r * p + 2 * n, r], dim=-1)
    y = mamba_step(xbc, dt, window, state, constants, p, n, dt_limit)
    y = gated_group_rms_norm(y.flatten(-2), z.flatten(-2), gate_w, gate_group, gate_eps)
    return x + _linear(y.view(1, -1), out_w, out_b).view(x.shape)


def _mlp_block_step(x: torch.Tensor, weights: tuple, norm_eps: float) -> torch.Tensor:
    """`Block.forward` of an MLP block for one decoded token, x [1, 1, d]."""
    norm_w, up_w, up_b, down_w, down_b = weights
    up = _linear(rms_norm(x, norm_w, norm_eps).view(1, -1), up_w, up_b)
    return x + _linear(F.relu(up).square(), down_w, down_b).view(x.shape)


@functools.cache
def _compiled(fn):
    return torch.compile(fn, fullgraph=True, dynamic=False)


def _plain_weight(t: torch.Tensor | None) -> bool:
    return t is None or (type(t.data) is torch.Tensor and t.device.type == "cpu")


def _plain_linear(m: nn.Module) -> bool:
    """A plain `nn.Linear` (no adapter, no subclass) of the kind packed.py reorders: a CPU weight in
    fp32 or bf16 that is an ordinary tensor."""
    return type(m) is nn.Linear and packable(m) and _plain_weight(m.bias)


def _linears(block: nn.Module) -> tuple[nn.Linear, ...] | None:
    """The projections a compiled step of `block` reads, or None where its step stays eager."""
    mixer = block.mixer
    if block.block_type == "mamba" and mixer.context_parallel is None:
        linears = (mixer.in_proj, mixer.out_proj)
        others = (mixer.conv1d.weight, mixer.conv1d.bias, mixer.A_log, mixer.D, mixer.dt_bias, mixer.norm.weight)
    elif block.block_type == "mlp":
        linears, others = (mixer.up_proj, mixer.down_proj), ()
    else:
        return None
    if type(block) is not Block or not all(map(_plain_linear, linears)) \
            or not all(map(_plain_weight, (block.norm.weight, *others))):
        return None
    return linears


def _weights(*tensors: torch.Tensor | None) -> tuple:
    return tuple(None if t is None else t.detach() for t in tensors)


def _block_step(block: Block):
    """The compiled step of `block` as step(x, cache, layer), its weights and sizes read once."""
    m = block.mixer
    if block.block_type == "mlp":
        weights = _weights(block.norm.weight, m.up_proj.weight, m.up_proj.bias, m.down_proj.weight,
                           m.down_proj.bias)
        return lambda x, cache, layer: _compiled(_mlp_block_step)(x, weights, block.norm.eps)
    weights = _weights(block.norm.weight, m.in_proj.weight, m.in_proj.bias, m.norm.weight, m.out_proj.weight,
                       m.out_proj.bias)
    sizes = (block.norm.eps, m.heads_per_group, m.head_dim, m.state_size, m.norm.group_size, m.norm.eps,
             tuple(m.dt_limit))

    def step(x, cache, layer):
        state = cache.layers[layer]
        return _compiled(_mamba_block_step)(x, state.conv, state.ssm, weights,
                                            m.step_constants(cache, layer, x.dtype), sizes)

    return step


class _Steps:
    """The compiled steps of one `generate` call; `failed` once compiling has failed (all run eagerly)."""

    def __init__(self):
        self.failed = False

    def forward(self, block: Block):
        eager, step = block.forward, _block_step(block)

        def forward(x, document_ids=None, token_mask=None, cache=None, layer=-1):
            if self.failed or cache is None or not cache.prefilled or x.shape[0] != 1:
                return eager(x, document_ids, token_mask, cache, layer)
            try:
                return step(x, cache, layer)
            except Exception as e:  # noqa: BLE001 - any compiler failure means: decode eagerly
                self.failed = True
                log.warning("generation compile: torch.compile failed (%s: %s); decoding eagerly",
                            type(e).__name__, next(iter(str(e).splitlines()), ""))
                return eager(x, document_ids, token_mask, cache, layer)

        return forward


@contextlib.contextmanager
def compiled_steps(model: nn.Module, enabled: bool) -> Iterator[list[nn.Linear]]:
    """Inside: one-row decoding steps of the model's Mamba2 and MLP blocks run compiled (see the
    module docstring); yields the linear layers those steps read (a reordered copy of them would go
    unused). `enabled` False takes no block."""
    blocks = [(b, ls) for b in model.modules() if isinstance(b, Block) and (ls := _linears(b))] if enabled else []
    steps = _Steps()
    try:
        for block, _ in blocks:
            block.forward = steps.forward(block)
        yield [linear for _, linears in blocks for linear in linears]
    finally:
        for block, _ in blocks:
            block.__dict__.pop("forward", None)
