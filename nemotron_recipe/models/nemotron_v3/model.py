"""Nemotron-H in plain PyTorch: Mamba2, attention, MLP and MoE blocks in one residual stack.

Every block is `x + mixer(norm(x))`. Mixers read their head and group counts from the tensors they
receive, never from the config, so a tensor- or context-parallel rank runs the same code on its own
slice of heads and groups.

The Mamba2 input projection and convolution are stored group-major: the rows of `in_proj` are
[z_g | x_g | B_g | C_g | dt_g] for each group g in turn (and the conv channels [x_g | B_g | C_g]),
where Hugging Face checkpoints store [z | x | B | C | dt] for all heads at once. With groups
contiguous, a plain row split of `in_proj` hands each tensor-parallel rank exactly its own groups;
`checkpoint.py` converts between the two layouts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from nemotron_recipe.distributed.expert_parallel import combine, dispatch
from nemotron_recipe.distributed.tensor_parallel import vocab_parallel_cross_entropy

from .cache import AttentionState, DecodeCache, MambaState
from .config import NemotronHConfig
from .context_parallel import context_parallel_attention, context_parallel_conv_and_scan
from .kernels import (
    causal_conv1d_silu,
    conv_step_silu,
    conv_step_weights,
    linear_cross_entropy_sum,
    ssd_scan,
    ssd_scan_final_state,
    ssm_step,
)
from .mtp import shift_for_mtp
from .ops import attention, causal_attention, causal_conv1d
from . import fp8_base
from .nf4 import experts_matmul_nf4
from .norms import gated_group_rms_norm, rms_norm
from .ssd import discretize_dt, ssd_chunked

if TYPE_CHECKING:  # the parallelizer sets the mixers' group
    from nemotron_recipe.distributed.context_parallel import ContextParallel


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor-parallel parameter (the tensor itself when not distributed)."""
    return t.to_local() if isinstance(t, DTensor) else t


class _KeepFP32:
    """Parameters and buffers named in `fp32_params` (dotted paths below the module) follow
    `.to(device)` but never a dtype cast: the SSM terms and the router lose stability and routing in bf16."""

    fp32_params: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        tensors = dict(self.named_parameters()) | dict(self.named_buffers())
        keep = {id(tensors[name]) for name in self.fp32_params if name in tensors}

        def fn_keep_dtype(t):
            out = fn(t)
            if id(t) in keep and out.dtype != t.dtype:
                return t.to(device=out.device)
            return out

        return super()._apply(fn_keep_dtype, recurse)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    fused = True  # one autograd node (norms.py); False runs the plain composition below

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and (out := rms_norm(x, self.weight, self.eps)) is not None:
            return out
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class GatedGroupRMSNorm(nn.Module):
    """rmsnorm_per_group(y * silu(z)) * weight; groups never straddle tensor-parallel ranks."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    fused = True  # one autograd node (norms.py); False runs the plain composition below

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if self.fused and (out := gated_group_rms_norm(y, z, local(self.weight), self.group_size, self.eps)) is not None:
            return out
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        h = h.unflatten(-1, (-1, self.group_size))
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return local(self.weight) * h.to(dtype)


class Mamba2Mixer(_KeepFP32, nn.Module):
    # The conv too: the mixer reads its weight directly, so it shares the fp32 terms' FSDP unit.
    fp32_params = ("A_log", "D", "dt_bias", "conv1d.weight", "conv1d.bias")
    context_parallel: ContextParallel | None = None  # set by the parallelizer
    # The conv and scan as single autograd nodes (kernels.py); False runs the plain compositions,
    # the reference they are tested against.
    fast_ops: bool = True

    def __init__(self, config: NemotronHConfig):
        super().__init__()
        h, p, g, n = config.mamba_num_heads, config.mamba_head_dim, config.n_groups, config.ssm_state_size
        self.head_dim, self.state_size = p, n
        self.heads_per_group = h // g
        self.d_group = self.heads_per_group * p
        self.conv_group = self.d_group + 2 * n
        self.chunk_size = config.chunk_size
        self.dt_limit = config.time_step_limit

        self.in_proj = nn.Linear(config.hidden_size, g * (self.d_group + self.conv_group + self.heads_per_group),
                                 bias=config.use_bias)
        self.conv1d = nn.Conv1d(g * self.conv_group, g * self.conv_group, config.conv_kernel,
                                groups=g * self.conv_group, bias=config.use_conv_bias)
        self.A_log = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.D = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.norm = GatedGroupRMSNorm(h * p, self.d_group, config.layer_norm_epsilon)
        self.out_proj = nn.Linear(h * p, config.hidden_size, bias=config.use_bias)

    def forward(self, hidden: torch.Tensor, document_ids: torch.Tensor | None = None,
                cache: DecodeCache | None = None, layer: int = -1) -> torch.Tensor:
        """With `cache` (decoding, see cache.py): the first call is the prefill, which stores this
        block's conv window and state at `cache.layers[layer]`; later calls take one new token each."""
        zxbcdt = self.in_proj(hidden).unflatten(-1, (-1, self.d_group + self.conv_group + self.heads_per_group))
        z, xbc, dt = zxbcdt.split([self.d_group, self.conv_group, self.heads_per_group], dim=-1)
        if cache is not None:
            y = self._prefill(xbc, dt, cache, layer) if not cache.prefilled else self._step(xbc, dt, cache, layer)
        elif self.context_parallel is None:
            y = self.conv_and_scan(xbc, dt, document_ids=document_ids)
        else:
            y = context_parallel_conv_and_scan(self, xbc, dt, self.context_parallel, document_ids)
        y = self.norm(y.flatten(-2), z.flatten(-2))
        return self.out_proj(y)

    def conv_and_scan(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        channels: torch.Tensor | None = None,
        heads: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal conv and scan over whole sequences: xbc [b,l,g,r*p+2n], dt [b,l,g,r] -> y [b,l,g,r*p].

        Context parallel hands a rank a subset of heads: `channels` and `heads` then pick their conv
        channels and SSM parameters out of this rank's (group-major) parameters. `document_ids`
        [b,l] keeps packed documents apart: neither the conv nor the state crosses a boundary.
        """
        r = dt.shape[-1]
        weight, bias = local(self.conv1d.weight), self.conv1d.bias
        bias = None if bias is None else local(bias)
        A_log, D, dt_bias = local(self.A_log), local(self.D), local(self.dt_bias)
        if channels is not None:
            weight, bias = weight[channels], None if bias is None else bias[channels]
            A_log, D, dt_bias = A_log[heads], D[heads], dt_bias[heads]

        g = xbc.shape[2]
        if self.fast_ops:
            xbc = causal_conv1d_silu(xbc.flatten(2), weight, bias, document_ids)
        else:
            xbc = causal_conv1d(xbc.flatten(2).transpose(1, 2), weight.to(xbc.dtype),
                                None if bias is None else bias.to(xbc.dtype), document_ids)
            xbc = F.silu(xbc).transpose(1, 2)
        x, B, C = xbc.unflatten(-1, (g, -1)).split([r * self.head_dim, self.state_size, self.state_size], dim=-1)

        dt = discretize_dt(dt.flatten(2), dt_bias, self.dt_limit)
        x = x.unflatten(-1, (r, self.head_dim)).flatten(2, 3)
        if self.fast_ops:  # the scan writes its result in the model's dtype: no fp32 copy to cast
            y = ssd_scan(x, dt, -torch.exp(A_log.float()), B, C, D, self.chunk_size, document_ids, xbc.dtype)
        else:
            y = ssd_chunked(x, dt, -torch.exp(A_log.float()), B, C, D, self.chunk_size, document_ids)
        return y.to(xbc.dtype).unflatten(2, (g, r)).flatten(-2)

    def _ssm_params(self):
        bias = self.conv1d.bias
        return (local(self.conv1d.weight), None if bias is None else local(bias), local(self.A_log), local(self.D),
                local(self.dt_bias))

    def _prefill(self, xbc: torch.Tensor, dt: torch.Tensor, cache: DecodeCache, layer: int) -> torch.Tensor:
        """`conv_and_scan` of the prompts, keeping the conv window and the final SSM state."""
        l, g = xbc.shape[1:3]
        r, k = dt.shape[-1], self.conv1d.kernel_size[0]
        weight, bias, A_log, D, dt_bias = self._ssm_params()
        flat = xbc.flatten(2)
        # The last k inputs, padding zeroed: a row shorter than the kernel starts from zeros, as the
        # whole-sequence conv does at a document's start.
        window = (flat[:, -k:] * cache.valid[:, max(l - k, 0):l, None]).transpose(1, 2)
        window = F.pad(window, (k - window.shape[-1], 0)).contiguous()
        document_ids = cache.document_ids(l)
        xbc = causal_conv1d_silu(flat, weight, bias, document_ids)
        x, B, C = xbc.unflatten(-1, (g, -1)).split([r * self.head_dim, self.state_size, self.state_size], dim=-1)
        dt = discretize_dt(dt.flatten(2), dt_bias, self.dt_limit)
        y, state = ssd_scan_final_state(x.unflatten(-1, (r, self.head_dim)).flatten(2, 3), dt,
                                        -torch.exp(A_log.float()), B, C, D, self.chunk_size, document_ids)
        cache.layers[layer] = MambaState(conv=window, ssm=state)
        return y.to(xbc.dtype).unflatten(2, (g, r)).flatten(-2)

    def step_constants(self, cache: DecodeCache, layer: int, dtype: torch.dtype) -> tuple:
        """What this block's decoding steps take from its weights, made at the cache's first step (the
        weights do not change while one cache decodes): the conv's weight and bias as `conv_step_silu`
        takes them for inputs of `dtype`, A = -exp(A_log), D and dt_bias, in fp32."""
        if cache.step_constants[layer] is None:
            weight, bias, A_log, D, dt_bias = self._ssm_params()
            cache.step_constants[layer] = (*conv_step_weights(weight, bias, dtype), -torch.exp(A_log.float()),
                                           D.float(), dt_bias.float())
        return cache.step_constants[layer]

    def _step(self, xbc: torch.Tensor, dt: torch.Tensor, cache: DecodeCache, layer: int) -> torch.Tensor:
        state = cache.layers[layer]
        return mamba_step(xbc, dt, state.conv, state.ssm, self.step_constants(cache, layer, xbc.dtype),
                          self.head_dim, self.state_size, self.dt_limit)


def mamba_step(xbc: torch.Tensor, dt: torch.Tensor, window: torch.Tensor, state: torch.Tensor, constants: tuple,
               head_dim: int, state_size: int, dt_limit: tuple[float, float]) -> torch.Tensor:
    """One new token per row through the conv and the scan: xbc [b,1,g,r*p+2n], dt [b,1,g,r] -> y
    [b,1,g,r*p]. `window` and `state` (a `MambaState`'s) are updated in place; `constants` come from
    `Mamba2Mixer.step_constants`. Tensors and numbers only, so compiled decoding
    (generation/compiled.py) runs this same code."""
    b, _, g = xbc.shape[:3]
    r = dt.shape[-1]
    weight, bias, A, D, dt_bias = constants
    xbc = conv_step_silu(xbc.flatten(1), window, weight, bias)
    x, B, C = xbc.unflatten(-1, (g, -1)).split([r * head_dim, state_size, state_size], dim=-1)
    dt = discretize_dt(dt.flatten(1), dt_bias, dt_limit)
    y = ssm_step(state, x.reshape(b, g * r, head_dim), dt, A, B, C, D)
    return y.to(xbc.dtype).view(b, 1, g, r * head_dim)


class Attention(nn.Module):
    """Grouped-query attention without positional encoding (NoPE)."""

    def __init__(self, config: NemotronHConfig):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(d, config.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, config.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, config.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, d, bias=False)

    context_parallel: ContextParallel | None = None  # set by the parallelizer

    def forward(self, hidden: torch.Tensor, document_ids: torch.Tensor | None = None,
                cache: DecodeCache | None = None, layer: int = -1) -> torch.Tensor:
        """With `cache` (decoding): the prefill stores the keys and values at `cache.layers[layer]`,
        later calls append theirs and attend over every real position so far."""
        q, k, v = (proj(hidden).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        if cache is not None:
            out = self._cached(q, k, v, cache, layer)
        elif self.context_parallel is not None:
            out = context_parallel_attention(q, k, v, self.context_parallel, document_ids)
        else:
            out = causal_attention(q, k, v, document_ids)
        return self.o_proj(out.transpose(1, 2).flatten(2))

    @staticmethod
    def _cached(q, k, v, cache: DecodeCache, layer: int) -> torch.Tensor:
        start, new = cache.length, q.shape[2]
        if not cache.prefilled:
            shape = (k.shape[0], k.shape[1], cache.capacity, k.shape[3])
            cache.layers[layer] = AttentionState(k.new_empty(shape), v.new_empty(shape))
        kv = cache.layers[layer]
        kv.key[:, :, start:start + new] = k
        kv.value[:, :, start:start + new] = v
        if not cache.prefilled:  # padding is a document of its own, which no real query sees
            return causal_attention(q, k, v, cache.document_ids(new))
        keys, values = kv.key[:, :, :start + new], kv.value[:, :, :start + new]
        mask = cache.keys_mask(new)
        dtype = q.dtype
        if q.device.type == "cpu" and dtype == torch.bfloat16:
            # CPU's bf16 attention kernel takes about 3x as long as its fp32 one for a query row, casts
            # included (and the fp32 sums are the more exact).
            q, keys, values = q.float(), keys.float(), values.float()
        if mask is None:  # every cached position is real: one query row sees them all, no mask to build
            out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=keys.shape[1] != q.shape[1])
        else:
            out = attention(q, keys, values, mask)
        return out.to(dtype)



class MLP(nn.Module):
    """down(relu(up(x))^2): squared ReLU, not gated."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


def top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the `k` largest values of each row; exact ties go to the lower index. `topk` leaves
    ties to the kernel, and saturated sigmoid scores (exactly 1.0) or masked groups tie exactly, so
    the choice would depend on the device and the kernel; a stable sort does not."""
    return values.sort(dim=-1, descending=True, stable=True).indices[..., :k]


class Router(_KeepFP32, nn.Module):
    """Sigmoid scores; experts chosen with a load-balancing bias, weighted by the unbiased scores.

    Group-limited routing: a token first keeps the `topk_group` expert groups whose two best biased
    scores sum highest, then takes its top-k experts inside them. Exact ties go to the lower expert
    index (`top_indices`); near-ties are as float rounding leaves them (docs/moe-routing.md).
    """

    fp32_params = ("weight", "e_score_correction_bias")

    def __init__(self, config: NemotronHConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [t, d] -> (every expert's score [t, E], weights [t, k] fp32, expert indices [t, k])."""
        scores = F.linear(x.float(), local(self.weight).float()).sigmoid()
        biased = scores + local(self.e_score_correction_bias)
        if self.n_group > 1:
            per_group = biased.unflatten(-1, (self.n_group, -1))
            group_score = per_group.topk(2, dim=-1).values.sum(-1)
            kept = torch.zeros_like(group_score, dtype=torch.bool)
            kept.scatter_(1, top_indices(group_score, self.topk_group), True)
            biased = per_group.masked_fill(~kept[..., None], float("-inf")).flatten(1)
        idx = top_indices(biased, self.top_k)
        weights = scores.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return scores, weights * self.scaling, idx


def sequence_balance_loss(scores: torch.Tensor, idx: torch.Tensor, rows: int, token_mask: torch.Tensor | None,
                          sequence_group: dist.ProcessGroup | None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss sum_i f_i P_i, summed over the `rows` sequences whose
    tokens `scores` [rows * t, E] and `idx` [rows * t, k] hold (before the coefficient and the mean
    over sequences). f_i = E / (k T) * (tokens routed to expert i), P_i = mean over the T tokens of
    expert i's share of the token's scores; `token_mask` [rows, t] leaves padding out.

    `sequence_group`: the ranks holding the other parts of the same sequences (context parallel,
    sequence-parallel tp). f and T count the whole sequence (summed over the group, no gradient); P
    sums this rank's tokens only, so the group's results add up to the loss, and so do their gradients."""
    experts, k = scores.shape[-1], idx.shape[-1]
    mask = (torch.ones(rows, scores.shape[0] // rows, device=scores.device) if token_mask is None
            else token_mask.reshape(rows, -1).to(scores.dtype))
    shares = (scores / scores.sum(-1, keepdim=True)).view(rows, -1, experts)
    share_sums = (shares * mask[..., None]).sum(1)  # [rows, E]
    with torch.no_grad():
        chosen = torch.zeros_like(scores).scatter_(1, idx, 1.0).view(rows, -1, experts)
        stats = torch.cat([(chosen * mask[..., None]).sum(1), mask.sum(1, keepdim=True)], dim=-1)
        if sequence_group is not None:
            dist.all_reduce(stats, group=sequence_group)
        tokens = stats[:, experts:].clamp_min(1)
        fraction = stats[:, :experts] * experts / (k * tokens)
    return (fraction * share_sums / tokens).sum()


class _AddLossGradient(torch.autograd.Function):
    """Returns `out` unchanged; backward also sends `weight` as the gradient of `loss`, so a block adds
    `weight * loss` to the objective without the loss travelling through the model's return value."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight, ctx.dtype, ctx.device = weight, loss.dtype, loss.device
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.weight, dtype=ctx.dtype, device=ctx.device), None


def _grouped_mm_supported(rows: torch.Tensor, up: torch.Tensor) -> bool:
    """`F.grouped_mm` runs on CPU in fp32, bf16 and fp16; on CUDA its kernels need bf16, Hopper or
    newer. Both need rows of both operands 16-byte aligned (CPU: torch 2.9 to 2.13 refuse others)."""
    if not hasattr(F, "grouped_mm"):
        return False
    if torch.compiler.is_compiling() and rows.dtype != torch.bfloat16:
        return False  # the op's shape function (used while tracing) accepts bf16 only
    if rows.device.type == "cpu":
        aligned = rows.shape[-1] * rows.element_size() % 16 == 0 and up.shape[1] * up.element_size() % 16 == 0
        return aligned and rows.dtype == up.dtype and rows.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return (rows.is_cuda and rows.dtype == up.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(rows.device) >= (9, 0)
            and rows.shape[-1] % 8 == 0 and up.shape[1] % 8 == 0)


def expert_matmul(rows: torch.Tensor, weight: torch.Tensor, groups: torch.Tensor | list[int]) -> torch.Tensor:
    """rows [t, in] sorted by expert times each expert's weight [E, out, in]^T -> [t, out]. `groups`:
    each expert's end row (int32 tensor: one grouped GEMM) or row count (list: a matmul per expert)."""
    if isinstance(groups, torch.Tensor):
        return F.grouped_mm(rows, weight.transpose(-2, -1), offs=groups)
    parts = [F.linear(part, weight[e]) for e, part in enumerate(rows.split(groups)) if groups[e]]
    # No rows at all (an expert-parallel rank nobody routed to): still a product with the weight, so
    # its gradient is zeros, as on the ranks that had rows.
    return torch.cat(parts) if parts else F.linear(rows, weight[0])


class Experts(nn.Module):
    """Routed ReLU^2 experts stored as stacked weights: up [E, I, D], down [E, D, I], where D is the
    latent size under LatentMoE and the hidden size otherwise.

    Under expert parallel (the parallelizer sets `ep_group`) each rank holds E / ep of them and rows
    travel to their experts' ranks and back. `tokens_per_expert` holds the rows each expert was
    routed in the last forward (this rank's tokens; its real ones where a token mask was given),
    which load balancing reads."""

    def __init__(self, config: NemotronHConfig):
        super().__init__()
        e, d, i = config.n_routed_experts, config.moe_hidden_size, config.moe_intermediate_size
        self.num_experts = e
        self.up_proj = nn.Parameter(torch.empty(e, i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        self.ep_group: dist.ProcessGroup | None = None
        self.register_buffer("tokens_per_expert", torch.zeros(e, dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [t, d]; each token's rows sorted by expert so every expert runs one dense matmul. Every
        token is computed; `token_mask` [t] (real tokens true) keeps padding out of the loads."""
        flat_idx = idx.flatten()
        order = flat_idx.argsort(stable=True)
        token = order // idx.shape[1]
        # Counted on the device: bincount reads the largest index back to the host (a sync per layer,
        # with or without minlength).
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat_idx.device).scatter_add_(
            0, flat_idx, torch.ones_like(flat_idx))
        if token_mask is None:
            self.tokens_per_expert.copy_(counts)
        else:
            real = token_mask.reshape(-1, 1).expand_as(idx).flatten().long()
            self.tokens_per_expert.zero_().scatter_add_(0, flat_idx, real)
        rows = x[token]
        if self.ep_group is None:
            routed = self.run_experts(rows, counts)
        else:
            sent = dispatch(rows, counts, self.ep_group)
            routed = combine(self.run_experts(sent.rows, sent.counts), sent)
        routed = routed * weights.flatten()[order, None]
        return torch.zeros(x.shape, dtype=routed.dtype, device=x.device).index_add_(0, token, routed).to(x.dtype)

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts this rank holds on `rows`, sorted by expert with `counts[e]` rows for expert e."""
        up, down = local(self.up_proj), local(self.down_proj)
        lora = self._modules.get("lora")  # per-expert LoRA adapters (lora.py), when fine-tuned with LoRA
        # One grouped GEMM per projection where supported: no per-expert launches and no host sync on
        # the counts; otherwise one matmul per expert.
        if "up_proj" in getattr(self, "nf4_shapes", {}):  # dequantized in the rows' dtype
            up = rows.new_empty(0, *self.nf4_shapes["up_proj"][1:])
        elif fp8_base.is_kept(self, "up_proj"):
            up = rows.new_empty(0, *up.shape[1:])
        groups = counts.cumsum(0).to(torch.int32) if _grouped_mm_supported(rows, up) else counts.tolist()
        hidden = self._matmul("up_proj", rows, local(self.up_proj), groups)
        if lora is not None and "up_proj" in lora:
            hidden = lora["up_proj"](hidden, rows, groups)
        hidden = F.relu(hidden).square()
        routed = self._matmul("down_proj", hidden, down, groups)
        if lora is not None and "down_proj" in lora:
            routed = lora["down_proj"](routed, hidden, groups)
        return routed

    def _matmul(self, proj: str, rows: torch.Tensor, weight: torch.Tensor, groups) -> torch.Tensor:
        """An NF4 base (nf4.py) stores `proj` [E, out, in] as [E*out, in] and dequantizes it per GEMM."""
        if proj in getattr(self, "nf4_shapes", {}):
            return experts_matmul_nf4(rows, weight, self.nf4_shapes[proj], groups, expert_matmul)
        if fp8_base.is_kept(self, proj):  # an FP8 checkpoint's weights kept as the base (fp8_base.py)
            return fp8_base.experts_matmul(rows, weight, fp8_base.scale_of(self, proj), groups, expert_matmul)
        return expert_matmul(rows, weight, groups)


class MoE(nn.Module):
    """Router, routed experts and a shared expert. LatentMoE (`moe_latent_size`): the router and the
    shared expert read the hidden state, the routed experts a projection of it to the latent size,
    whose sum goes back to the hidden size through one more projection."""

    def __init__(self, config: NemotronHConfig):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)
        # The sequence-wise balance loss: the trainer sets its weight (coefficient / sequences per step)
        # and reads `balance_loss`, this rank's part of it in the last forward; the parallelizer sets
        # `sequence_group` where a sequence's tokens are split over ranks.
        self.balance_loss_weight = 0.0
        self.balance_loss: torch.Tensor | None = None
        self.sequence_group: dist.ProcessGroup | None = None
        self.shared_experts = MLP(config.hidden_size, config.moe_shared_expert_intermediate_size, config.mlp_bias)
        self.latent = config.moe_latent_size is not None
        if self.latent:
            d, latent = config.hidden_size, config.moe_latent_size
            self.fc1_latent_proj = nn.Linear(d, latent, bias=config.mlp_bias)
            self.fc2_latent_proj = nn.Linear(latent, d, bias=config.mlp_bias)

    def forward(self, hidden: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [b, t, d]; `token_mask` [b, t] (real tokens true, padding false) keeps padding out of
        the expert loads and the balance loss; every token is computed either way."""
        tokens = hidden.flatten(0, -2)
        scores, weights, idx = self.gate(tokens)
        # The loads balancing reads count real tokens only, as on any mesh.
        mask = None if token_mask is None else token_mask.flatten()
        if self.latent:
            routed = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(tokens), weights, idx, mask))
        else:
            routed = self.experts(tokens, weights, idx, mask)
        out = routed.view_as(hidden) + self.shared_experts(hidden)
        if self.balance_loss_weight and self.training and torch.is_grad_enabled():
            loss = sequence_balance_loss(scores, idx, hidden.shape[0], token_mask, self.sequence_group)
            self.balance_loss = loss.detach()
            out = _AddLossGradient.apply(out, loss, self.balance_loss_weight)
        return out


_MIXERS = {"mamba": Mamba2Mixer, "attention": Attention, "moe": MoE}


class Block(nn.Module):
    def __init__(self, config: NemotronHConfig, block_type: str):
        super().__init__()
        self.block_type = block_type
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        if block_type == "mlp":
            self.mixer = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        else:
            self.mixer = _MIXERS[block_type](config)

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None,
                token_mask: torch.Tensor | None = None, cache: DecodeCache | None = None,
                layer: int = -1) -> torch.Tensor:
        if cache is not None and self.block_type in ("mamba", "attention"):
            return x + self.mixer(self.norm(x), cache=cache, layer=layer)
        if self.block_type in ("mamba", "attention"):
            return x + self.mixer(self.norm(x), document_ids=document_ids)
        if self.block_type == "moe" and token_mask is not None:
            return x + self.mixer(self.norm(x), token_mask=token_mask)
        return x + self.mixer(self.norm(x))  # per-token mixers need no document boundaries


# ------------------------------------------------------------------------------- multi-token prediction
# Depth k (1-based, `num_nextn_predict_layers` of them) sees, at position t, the hidden state the
# previous depth left there (the main model's final-norm output for k = 1) and the embedding of token
# t+k, and predicts token t+1+k through the model's own `lm_head`:
#     h_k = blocks_k(eh_proj([enorm(embed(token[t+k])) | hnorm(h_{k-1})]))
# `blocks_k` is one block per character of `mtp_pattern`; the first carries the fusion (`enorm`,
# `hnorm`, `eh_proj`), the last a `final_layernorm`. The layers of all depths sit in one flat list,
# `mtp.layers.{depth * len(mtp_pattern) + j}`, the names released checkpoints use. Their inputs come
# from `mtp.shift_for_mtp`.
class MTPLayer(Block):
    """A block of an MTP depth: the fusion of embedding and hidden state before it (first block of a
    depth), a final norm after it (last block of a depth)."""

    def __init__(self, config: NemotronHConfig, block_type: str, *, fuses: bool, final_norm: bool):
        super().__init__(config, block_type)
        d, eps = config.hidden_size, config.layer_norm_epsilon
        self.fuses, self.has_final_norm = fuses, final_norm
        if fuses:
            self.enorm = RMSNorm(d, eps)
            self.hnorm = RMSNorm(d, eps)
            self.eh_proj = nn.Linear(2 * d, d, bias=False)
        if final_norm:
            self.final_layernorm = RMSNorm(d, eps)

    def forward(
        self, x: torch.Tensor, document_ids: torch.Tensor | None = None, embedded: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Fusion and final norm run inside this module's call, so FSDP has gathered their weights.
        if self.fuses:
            x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(x)], dim=-1))
        x = super().forward(x, document_ids=document_ids, token_mask=token_mask)
        return self.final_layernorm(x) if self.has_final_norm else x


class MultiTokenPrediction(nn.Module):
    def __init__(self, config: NemotronHConfig):
        super().__init__()
        per_depth = len(config.mtp_pattern)
        self.depths, self.per_depth = config.num_nextn_predict_layers, per_depth
        self.layers = nn.ModuleList(
            MTPLayer(config, kind, fuses=i % per_depth == 0, final_norm=i % per_depth == per_depth - 1)
            for i, kind in enumerate(config.mtp_block_types)
        )

    def forward(
        self,
        hidden: torch.Tensor,
        shifted_ids: torch.Tensor,
        embed: Callable[[torch.Tensor], torch.Tensor],
        document_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        embedded_ids: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """hidden [b, l, d] (the main model's output), shifted_ids [b, l, depths] (`shift_for_mtp`)
        -> each depth's hidden states [b, l, d]. `token_mask`: the main sequence's real tokens, which
        MoE blocks count their loads over (positions, like the padding, are the main sequence's).
        `embedded_ids` [b, l, depths, d]: the shifted ids already embedded, where the embedding lives
        elsewhere (a pipeline's first stage); `shifted_ids` and `embed` are then not used."""
        out = []
        for depth in range(self.depths):
            if embedded_ids is not None:
                embedded = embedded_ids[:, :, depth]
            else:
                embedded = embed(shifted_ids[..., depth].contiguous())
            for j in range(self.per_depth):
                layer = self.layers[depth * self.per_depth + j]
                hidden = layer(hidden, document_ids=document_ids, token_mask=token_mask,
                               embedded=embedded if j == 0 else None)
            out.append(hidden)
        return out


class NemotronHModel(nn.Module):
    def __init__(self, config: NemotronHConfig):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, kind) for kind in config.block_types)
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, document_ids: torch.Tensor | None = None,
                token_mask: torch.Tensor | None = None, cache: DecodeCache | None = None) -> torch.Tensor:
        """With `cache`: the final hidden state of the last position only, [b, 1, d]."""
        h = self.embeddings(input_ids)
        if cache is not None and not cache.prefilled:
            token_mask = cache.token_mask(input_ids.shape[1])
        for i, block in enumerate(self.layers):
            if cache is None:
                h = block(h, document_ids=document_ids, token_mask=token_mask)
            else:
                h = block(h, token_mask=token_mask, cache=cache, layer=i)
        return self.norm_f(h if cache is None else h[:, -1:])


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None  # with `targets` and `loss_chunk_size` (then no logits)
    num_tokens: torch.Tensor | None = None
    # Training with MTP layers: the MTP cross-entropies summed over tokens, averaged over depths.
    mtp_loss_sum: torch.Tensor | None = None


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each position's logits against the next label (-100: not trained).
    Vocab-sharded (tensor-parallel) logits are never gathered: the loss runs on their shards."""
    if isinstance(logits, DTensor):
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)  # aligned with the logits
        return vocab_parallel_cross_entropy(logits, targets).sum() / (targets != -100).sum()
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


class LMHead(nn.Linear):
    """The output projection. Given `targets` and a `chunk_size` it returns (loss sum, trained tokens)
    instead of logits, chunk by chunk, so the [tokens, vocab] logits never exist at once. The loss
    runs inside this module's call so that FSDP has gathered the weight for it. A tensor-parallel
    (DTensor) weight always gives logits, vocab-sharded, whose loss is the caller's."""

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None, chunk_size: int = 0):
        if targets is None or not chunk_size or isinstance(self.weight, DTensor) or isinstance(hidden, DTensor):
            return super().forward(hidden)
        return linear_cross_entropy_sum(hidden, self.weight, targets, chunk_size)


class NemotronHForCausalLM(nn.Module):
    def __init__(self, config: NemotronHConfig):
        super().__init__()
        self.config = config
        self.model = NemotronHModel(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = None
        if config.num_nextn_predict_layers:
            self.mtp = MultiTokenPrediction(config)
        self.reset_parameters()

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        loss_chunk_size: int = 0,
        mtp_input_ids: torch.Tensor | None = None,
        mtp_targets: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        cache: DecodeCache | None = None,
    ) -> CausalLMOutput:
        """`labels` as in Hugging Face: aligned with `input_ids`, shifted here, -100 ignored.
        `document_ids` [b,l] marks packed documents, which then never see each other.

        `targets` (pre-shifted, as the recipe's batches hold them) with `loss_chunk_size` > 0: the
        output holds `loss_sum` and `num_tokens` of the chunked loss and no logits, unless the head
        is tensor-parallel (then the logits, as without them).

        With MTP layers and a non-zero `mtp_loss_scale`, a training forward given `labels` or
        `targets` also runs them: the output's `mtp_loss_sum`, and with `labels` a loss of
        main + mtp_loss_scale * mtp_loss_sum / (main's trained tokens). `mtp_input_ids` and
        `mtp_targets` [b, l, depths] (`mtp.shift_for_mtp` of the whole sequences) are required when
        the sequence is split over context-parallel ranks; otherwise they are made here.
        `token_mask` [b, l] (false at padding) keeps padding out of the MoE balance loss.

        `cache` (incremental decoding, cache.py; no MTP, no loss): the first call prefills the
        left-padded prompts `input_ids` [b, L] whose real tokens `cache` marks, later calls take the
        next token of each row [b, 1]; either returns the logits of the last position [b, 1, vocab]
        and advances the cache."""
        if cache is not None:
            return self._decode(input_ids, cache)
        hidden = self.model(input_ids, document_ids, token_mask)
        if labels is not None and targets is None and self._runs_mtp():
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        mtp_loss_sum = None
        if targets is not None and self._runs_mtp():
            mtp_loss_sum = self._mtp_loss_sum(hidden, input_ids, targets, document_ids, mtp_input_ids, mtp_targets,
                                              loss_chunk_size, token_mask=token_mask)
        if targets is not None and loss_chunk_size:
            out = self.lm_head(hidden, targets=targets, chunk_size=loss_chunk_size)
            if isinstance(out, tuple):
                return CausalLMOutput(logits=None, loss_sum=out[0], num_tokens=out[1], mtp_loss_sum=mtp_loss_sum)
            logits = out.float()
        else:
            logits = self.lm_head(hidden).float()
        loss = None if labels is None else causal_lm_loss(logits, labels)
        if loss is not None and mtp_loss_sum is not None:
            trained = (labels[:, 1:] != -100).sum().clamp(min=1)
            loss = loss + self.config.effective_mtp_loss_scale * mtp_loss_sum / trained
        return CausalLMOutput(logits=logits, loss=loss, mtp_loss_sum=mtp_loss_sum)

    def _decode(self, input_ids: torch.Tensor, cache: DecodeCache) -> CausalLMOutput:
        new = input_ids.shape[1]
        if cache.prefilled:
            if new != 1:
                raise ValueError(f"decoding takes one token per row a step; got input_ids of shape "
                                 f"{tuple(input_ids.shape)} after the prefill")
            cache.begin_step(new)
        logits = self.lm_head(self.model(input_ids, cache=cache)).float()
        cache.advance(new)
        return CausalLMOutput(logits=logits)

    def _runs_mtp(self) -> bool:
        """MTP layers run in training only, and not at all with a zero loss scale (their weights are kept)."""
        return self.mtp is not None and self.training and self.config.effective_mtp_loss_scale > 0

    def _mtp_loss_sum(self, hidden, input_ids, targets, document_ids, mtp_input_ids, mtp_targets, chunk_size,
                      token_mask=None):
        """The MTP depths' token-summed cross-entropies through the shared head, averaged over depths."""
        if mtp_input_ids is None or mtp_targets is None:
            if any(getattr(m, "context_parallel", None) is not None for m in self.modules()):
                raise ValueError("context parallel MTP needs mtp_input_ids and mtp_targets made from the whole "
                                 "sequences (mtp.shift_for_mtp) before they are split over the cp ranks")
            mtp_input_ids, mtp_targets = shift_for_mtp(input_ids, targets, self.mtp.depths, document_ids)
        per_depth = self.mtp(hidden, mtp_input_ids, self.model.embeddings, document_ids, token_mask)
        total = sum(self._head_loss_sum(h, mtp_targets[..., k].contiguous(), chunk_size)
                    for k, h in enumerate(per_depth))
        return total / len(per_depth)

    def _head_loss_sum(self, hidden: torch.Tensor, targets: torch.Tensor, chunk_size: int) -> torch.Tensor:
        out = self.lm_head(hidden, targets=targets, chunk_size=chunk_size)
        if isinstance(out, tuple):
            return out[0]
        logits = out.float()
        if isinstance(logits, DTensor):  # vocab-sharded: the loss runs on the shards
            return vocab_parallel_cross_entropy(logits, targets).sum()
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten().to(logits.device), ignore_index=-100,
                               reduction="sum")

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every weight from the current torch RNG state, in module order, so one seed gives
        the same model on every rank whatever the mesh."""
        cfg = self.config
        std = cfg.initializer_range
        # Residual-branch outputs shrink with depth so the stream's variance stays bounded at init.
        out_std = std / math.sqrt(cfg.num_layers) if cfg.rescale_prenorm_residual else std
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_out = name.endswith(("out_proj", "o_proj", "down_proj"))
                nn.init.normal_(module.weight, std=out_std if is_out else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.Conv1d):
                module.reset_parameters()
            elif isinstance(module, (RMSNorm, GatedGroupRMSNorm)):
                nn.init.ones_(module.weight)
            elif isinstance(module, Router):
                nn.init.normal_(module.weight, std=std)
                module.e_score_correction_bias.zero_()
            elif isinstance(module, Experts):
                nn.init.normal_(module.up_proj, std=std)
                nn.init.normal_(module.down_proj, std=out_std)
            elif isinstance(module, Mamba2Mixer):
                heads = module.A_log.numel()
                module.A_log.copy_(torch.log(torch.arange(1, heads + 1, dtype=torch.float32)))
                module.D.fill_(1.0)
                # dt log-uniform in [time_step_min, time_step_max]; dt_bias is its softplus inverse.
                lo, hi = math.log(cfg.time_step_min), math.log(cfg.time_step_max)
                dt = torch.exp(torch.rand(heads) * (hi - lo) + lo).clamp(min=cfg.time_step_floor)
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @classmethod
    def from_pretrained(cls, path: str, **config_overrides) -> NemotronHForCausalLM:
        from .checkpoint import load_pretrained

        return load_pretrained(cls, path, **config_overrides)

    def save_pretrained(self, path: str) -> None:
        from .checkpoint import save_pretrained

        save_pretrained(self, path)


def build_meta_model(config: NemotronHConfig) -> NemotronHForCausalLM:
    """The model's structure without storage: parameters and buffers on the meta device."""
    with torch.device("meta"):
        return NemotronHForCausalLM(config)
