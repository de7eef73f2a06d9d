"""Fast paths: the Mamba2 causal conv and chunked SSD scan as single autograd nodes (and the Triton
kernels of `mamba_ssm` / `causal_conv1d` on CUDA when they are installed), and the lm_head plus
cross-entropy computed a chunk of tokens at a time.

The plain compositions (`ssd_chunked` in ssd.py, `causal_conv1d` in ops.py) are the reference; these
compute the same function, and tests compare them, and the scan against the step-by-step recurrence.
Hand-written backward passes are what make them fast in eager PyTorch: autograd of the plain scan
saves and revisits many [chunk x chunk]-sized temporaries per head, and its batched matmuls run on
strided views that the CPU BLAS cannot batch; here every product runs on contiguous operands
(head-major within chunks, group-major for the states, so B and C are never copied per head), the
decay matrices are built once and shared by forward and backward, and the state recurrence over
chunks runs outside autograd. The depthwise conv's oneDNN backward is slow on CPU (and
very slow when cores are oversubscribed), so the conv is four shifted multiply-adds.

Shapes: b batch, l sequence, h heads, p head dim, g groups (h = g * r), n state, q chunk, c chunks.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the PyTorch conv and scan accumulate in for inputs of `dtype`: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------- conv
def _shift_masks(document_ids: torch.Tensor | None, kernel: int) -> list[torch.Tensor | None]:
    """For each shift s >= 1: where position t and t - s lie in the same document ([b, l - s, 1])."""
    if document_ids is None:
        return [None] * kernel
    return [None] + [(document_ids[:, s:] == document_ids[:, :-s])[..., None] for s in range(1, kernel)]


class CausalConv1dSiLU(torch.autograd.Function):
    """silu(causal depthwise conv(x)) on x [b, l, C] (channels last), weight [C, K], bias [C] or None.

    Accumulates in fp32 (fp64 for fp64 inputs) whatever the input dtype. With `document_ids` [b, l], no output sees a token
    of an earlier document (as if each document were zero-padded on its own).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, document_ids):
        k = weight.shape[-1]
        ct = _compute_dtype(x.dtype)
        w = weight.to(ct)
        masks = _shift_masks(document_ids, k)
        xc = x.to(ct)  # once: each shifted tap would otherwise cast its own copy of x
        pre = xc * w[:, k - 1]
        for s in range(1, k):
            shifted = xc[:, :-s] if masks[s] is None else xc[:, :-s] * masks[s]
            pre[:, s:].addcmul_(shifted, w[:, k - 1 - s])
        if bias is not None:
            pre += bias.to(ct)
        ctx.save_for_backward(x, weight, pre, document_ids)
        ctx.has_bias = bias is not None
        return F.silu(pre).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, pre, document_ids = ctx.saved_tensors
        k = weight.shape[-1]
        w = weight.to(pre.dtype)
        masks = _shift_masks(document_ids, k)
        g = torch.ops.aten.silu_backward(grad_out.to(pre.dtype), pre)
        xc = x.to(pre.dtype)
        grad_x = g * w[:, k - 1]
        grad_w = torch.empty(weight.shape, dtype=pre.dtype, device=weight.device)
        grad_w[:, k - 1] = (g * xc).sum((0, 1))
        for s in range(1, k):
            g_s = g[:, s:] if masks[s] is None else g[:, s:] * masks[s]
            grad_x[:, :-s].addcmul_(g_s, w[:, k - 1 - s])
            grad_w[:, k - 1 - s] = (g_s * xc[:, :-s]).sum((0, 1))
        grad_b = g.sum((0, 1)).to(weight.dtype) if ctx.has_bias else None
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), grad_b, None


# Under torch.compile the conv above compiles poorly: each tap's weight-gradient sum becomes its own
# pass over the sequence that recomputes the SiLU gradient, and loads of a weight column [C, K][:, j]
# are strided. The version below is written for the compiler: x is saved zero-padded at the front,
# so every tap reads an offset of one buffer over the same range and the compiler fuses all K
# weight-gradient sums into one pass; the weights enter as a [K, C] copy made by an op the compiler
# cannot inline (`conv_taps`), so each tap's weights load contiguously. fwd + bwd of an h1024
# block's conv (4 x 512 tokens, 3072 channels, bf16, 2 threads): 22 ms against 41 ms compiled from
# the eager version (`benchmarks/compile_ab.py` measures the whole step).
@torch.library.custom_op("nemotron_recipe::conv_taps", mutates_args=())
def conv_taps(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [C, K] -> its taps [K, C] in `dtype`, contiguous (a new tensor, never a view)."""
    return weight.t().to(dtype).contiguous()


@conv_taps.register_fake
def _(weight, dtype):
    return weight.new_empty(weight.shape[1], weight.shape[0], dtype=dtype)


def _conv_taps_setup(ctx, inputs, output):
    ctx.weight_dtype = inputs[0].dtype


def _conv_taps_backward(ctx, grad):
    return grad.t().to(ctx.weight_dtype), None


conv_taps.register_autograd(_conv_taps_backward, setup_context=_conv_taps_setup)


def _tap_masks(document_ids: torch.Tensor | None, kernel: int) -> list[torch.Tensor | None]:
    """For tap j (shift s = kernel - 1 - j): where position t and t - s lie in the same document,
    [b, l, 1], read from ids padded at the front like x (padded positions meet zeros in x anyway)."""
    if document_ids is None:
        return [None] * kernel
    l = document_ids.shape[1]
    padded = F.pad(document_ids, (kernel - 1, 0))
    return [(document_ids == padded[:, j:j + l])[..., None] for j in range(kernel - 1)] + [None]


def _taps_pre(x_padded: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None,
              masks: list[torch.Tensor | None]) -> torch.Tensor:
    """The conv before its SiLU, in taps' dtype: sum over taps j of x_padded[:, j:j+l] * taps[j]."""
    k, l = taps.shape[0], x_padded.shape[1] - taps.shape[0] + 1
    pre = None
    for j in range(k):
        term = x_padded[:, j:j + l].to(taps.dtype) * taps[j]
        term = term if masks[j] is None else term * masks[j]
        pre = term if pre is None else pre + term
    return pre if bias is None else pre + bias.to(taps.dtype)


class TracedCausalConv1dSiLU(torch.autograd.Function):
    """`CausalConv1dSiLU` written for torch.compile (see above): x [b, l, C], taps [K, C] from
    `conv_taps` (in the compute dtype), bias [C] or None, document_ids [b, l] or None. Saves x padded
    at the front and recomputes the conv in backward (K multiply-adds per element)."""

    @staticmethod
    def forward(ctx, x, taps, bias, document_ids):
        k = taps.shape[0]
        x_padded = F.pad(x, (0, 0, k - 1, 0))
        pre = _taps_pre(x_padded, taps, bias, _tap_masks(document_ids, k))
        ctx.save_for_backward(x_padded, taps, bias, document_ids)
        return F.silu(pre).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x_padded, taps, bias, document_ids = ctx.saved_tensors
        k, l = taps.shape[0], grad_out.shape[1]
        masks = _tap_masks(document_ids, k)
        g = torch.ops.aten.silu_backward(grad_out.to(taps.dtype), _taps_pre(x_padded, taps, bias, masks))
        tapped = [g if masks[j] is None else g * masks[j] for j in range(k)]  # g where tap j reached
        grad_taps = torch.stack([(tapped[j] * x_padded[:, j:j + l].to(taps.dtype)).sum((0, 1))
                                 for j in range(k)])
        grad_x = None
        for j in range(k):  # output t + s read input t through tap j (s = k - 1 - j)
            s = k - 1 - j
            term = F.pad(tapped[j], (0, 0, 0, s))[:, s:] * taps[j]
            grad_x = term if grad_x is None else grad_x + term
        grad_bias = None if bias is None else g.sum((0, 1)).to(bias.dtype)
        return grad_x.to(x_padded.dtype), grad_taps, grad_bias, None


def _optional_kernel(module: str, name: str):
    """`module.name`, or None when it cannot be imported. A wheel built for another torch, CUDA or
    Python fails with OSError (undefined symbol) or RuntimeError rather than ImportError; any
    failure means the PyTorch path, and the reason is logged once (callers cache the result)."""
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as err:  # noqa: BLE001 - a broken extension may raise anything on import
        if isinstance(err, ModuleNotFoundError) and err.name == module.split(".")[0]:
            logger.info("%s is not installed; using the PyTorch path", err.name)
        else:
            logger.warning("%s.%s is installed but cannot be used (%s: %s); using the PyTorch path instead",
                           module, name, type(err).__name__, err)
        return None


@functools.cache
def _cuda_conv():
    return _optional_kernel("causal_conv1d", "causal_conv1d_fn")


_KERNEL_DEVICES = ("cuda",)  # where the installed conv kernel runs (tests add "cpu" with a fake kernel)


def _conv_kernel_input(x: torch.Tensor) -> torch.Tensor | None:
    """x [b, l, C] laid out as `causal_conv1d_fn` takes it in its channels-last mode: the transposed
    view [b, C, l] with channels contiguous and the batch and time strides multiples of 8. A view
    that breaks this (a rank's one group sliced out of the input projection, or a context-parallel
    rank's virtual groups) is copied. (The kernel's output and input gradient are `empty_like` the
    input, which keeps its stride order, so they are channels-last too.) None when the kernel cannot
    take C channels (C % 8 != 0)."""
    if x.shape[-1] % 8:
        return None
    if x.stride(-1) != 1 or x.stride(1) % 8 or x.stride(0) % 8:
        x = x.contiguous()
    return x.transpose(1, 2)


def causal_conv1d_silu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, document_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """x [b, l, C], weight [C, 1, K] or [C, K] -> silu(causal depthwise conv) [b, l, C] in x's dtype."""
    weight = weight.reshape(weight.shape[0], -1).to(x.dtype).contiguous()
    bias = None if bias is None else bias.to(x.dtype)
    if x.device.type in _KERNEL_DEVICES and _cuda_conv() is not None and (x_t := _conv_kernel_input(x)) is not None:
        seq_idx = None if document_ids is None else document_ids.to(torch.int32).contiguous()
        return _cuda_conv()(x_t, weight, bias, seq_idx=seq_idx, activation="silu").transpose(1, 2)
    if torch.compiler.is_compiling():
        return TracedCausalConv1dSiLU.apply(x, conv_taps(weight, _compute_dtype(x.dtype)), bias, document_ids)
    return CausalConv1dSiLU.apply(x, weight, bias, document_ids)


# ---------------------------------------------------------------------------------------- scan
def _head_major(t: torch.Tensor, c: int, q: int, dtype: torch.dtype) -> torch.Tensor:
    """[b, c*q, h, *] -> [b, h, c, q, *], contiguous, in `dtype`."""
    b, _, h = t.shape[:3]
    return t.transpose(1, 2).to(dtype).contiguous().view(b, h, c, q, *t.shape[3:])


def _natural(t: torch.Tensor, length: int) -> torch.Tensor:
    """[b, h, c, q, *] -> [b, length, h, *] (a view)."""
    b, h, c, q = t.shape[:4]
    return t.view(b, h, c * q, *t.shape[4:]).transpose(1, 2)[:, :length]


# Tokens (summed over the batch) one block of the scan covers, on every device. The scan's
# temporaries are several times the size of x: past a few tens of MB they fall out of the CPU's
# caches and every elementwise pass slows down, and on a GPU one block over a whole long sequence
# holds them all at once (about 1 GB per Mamba layer at 8k tokens for the 8B model). Block by block,
# with the state carried across, the cost per token stays flat in the sequence length and the
# temporaries are those of one block.
SCAN_BLOCK_TOKENS = 2048


def _mm(a: torch.Tensor, b: torch.Tensor, md: torch.dtype, ct: torch.dtype) -> torch.Tensor:
    """a @ b with both operands in `md`, the result in `ct` (callers pass `md` where the result only
    feeds an fp32 sum). With bf16 inputs the scan's products take bf16 operands (the BLAS
    accumulates in fp32, as the GPU kernels do), which on CPUs with bf16 matmul runs these small
    batched products several times faster; the decays, the state recurrence and every sum stay in
    fp32. Operands already in `md` are not copied."""
    return (_operand(a, md) @ _operand(b, md)).to(ct)


def _operand(t: torch.Tensor, md: torch.dtype) -> torch.Tensor:
    """t in `md`, a transposed view cast as its transpose: the same strides eagerly, but compiled
    code would otherwise write the cast copy transposed, element by element."""
    if t.dtype == md or t.stride(-1) == 1:
        return t.to(md)
    return t.mT.to(md).mT


def _group_major(t: torch.Tensor, g: int, md: torch.dtype) -> torch.Tensor:
    """[b,h,c,q,p] -> [b,g,c,q,r*p], contiguous, in `md`: the heads sharing a group's B and C side
    by side, so each state product is one matmul per group and chunk (K or N = r*p) instead of r
    matmuls on a broadcast (copied) B or C."""
    b, h, c, q, p = t.shape
    t = t.view(b, g, h // g, c, q, p).permute(0, 1, 3, 4, 2, 5)
    return torch.empty(t.shape, dtype=md, device=t.device).copy_(t).view(b, g, c, q, -1)


def _head_view(t: torch.Tensor, h: int) -> torch.Tensor:
    """[b,g,c,q,r*p] -> [b,g,r,c,q,p] (a strided view; head-major once reshaped to [b,h,c,q,p])."""
    b, g, c, q, _ = t.shape
    return t.view(b, g, c, q, h // g, -1).permute(0, 1, 4, 2, 3, 5)


def _scan_block_forward(x, dt, A, B, C, D, q, doc, doc_before, state_in, md):
    """One block of whole chunks, natural layout in: x [b,t,h,p], dt [b,t,h], B/C [b,t,g,n],
    doc [b,t] or None (`doc_before` [b,1]: the document open before the block), state_in [b,h,p,n];
    `md` the dtype of the matmul operands (see `_mm`).
    Returns (y [b,t,h,p] (a view), state after the block, tensors for backward)."""
    b, t, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r, c = h // g, t // q
    ct = state_in.dtype
    xh = _head_major(x, c, q, ct)  # [b,h,c,q,p]
    dth = _head_major(dt, c, q, ct)  # [b,h,c,q], contiguous: a view of dt would alias the op's input
    Bg, Cg = _head_major(B, c, q, md), _head_major(C, c, q, md)  # [b,g,c,q,n], only ever matmul operands
    X = xh * dth[..., None]
    s = (dth * A.to(ct)[:, None, None]).cumsum(-1)  # log-decay from the chunk's start, [b,h,c,q]

    keep = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
    w = (s[..., -1:] - s).exp_()  # decay from each step to the chunk's end
    gamma = s[..., -1].exp()  # decay across the whole chunk, [b,h,c]
    E = s.exp()  # decay from the chunk's start to each step
    if doc is not None:
        d = doc.view(b, 1, c, q)
        doc_in = torch.cat([doc_before.view(b, 1, 1, 1), d[:, :, :-1, -1:]], dim=2)  # open when a chunk starts
        keep = keep & (d[..., :, None] == d[..., None, :])
        w = w * (d == d[..., -1:])
        gamma = gamma * (d[..., -1] == doc_in[..., 0])
        E = E * (d == doc_in)
    L = (s[..., :, None] - s[..., None, :]).masked_fill_(~keep, float("-inf")).exp_()  # [b,h,c,q,q]
    CB = _mm(Cg, Bg.transpose(-1, -2), md, ct)  # [b,g,c,q,q]

    # Within each chunk: y = (L * C.B) @ (x * dt).
    Y = _mm((L.view(b, g, r, c, q, q) * CB[:, :, None]).view(b, h, c, q, q), X, md, ct)

    # Each chunk's state at its end, [b,g,c,r*p,n], then the state entering each chunk (a short
    # recurrence over chunks, states kept group-major: [b,g,r,p,n] is [b,h,p,n]).
    # S in fp32: the recurrence adds it to the fp32 state (a bf16 S would be cast chunk by chunk).
    S = _mm(_group_major(X * w[..., None], g, md).transpose(-1, -2), Bg, md, ct).view(b, g, c, r, p, n)
    decay = gamma.view(b, g, r, c, 1, 1)
    state = state_in.view(b, g, r, p, n)
    P = torch.empty(b, g, c, r, p, n, dtype=md, device=x.device)  # written chunk by chunk, no stack
    for k in range(c):
        P[:, :, k] = state
        state = torch.addcmul(S[:, :, k], state, decay[:, :, :, k])
    P = P.view(b, g, c, r * p, n)

    # The carried-in state read out by C, and the skip term.
    Z = _mm(Cg, P.transpose(-1, -2), md, ct)  # [b,g,c,q,r*p]
    Y.view(b, g, r, c, q, p).addcmul_(_head_view(Z, h), E.view(b, g, r, c, q, 1))
    Y.addcmul_(xh, D.to(ct)[:, None, None, None])
    return _natural(Y, t), state.view(b, h, p, n), (xh, dth, Bg, Cg, L, CB, w, gamma, E, P)


def _scan_block_backward(gy, A, D, saved, grad_state_out):
    """Gradients of one block given gy [b,t,h,p] and the gradient of the state leaving the block;
    returns (gx, gdt, gA, gB, gC, gD, gradient of the state entering the block), all in fp32."""
    xh, dth, Bg, Cg, L, CB, w, gamma, E, P = saved
    b, h, c, q, p = xh.shape
    g, n = Bg.shape[1], Bg.shape[-1]
    r, t, ct, md = h // g, c * q, xh.dtype, Bg.dtype
    gY = _head_major(gy, c, q, ct)  # [b,h,c,q,p]
    gYm = gY.to(md)
    X = xh * dth[..., None]

    # Read-out of the carried-in states: Y += E * (C @ P^T), group-major.
    Z = _head_view(_mm(Cg, P.transpose(-1, -2), md, ct), h)  # [b,g,r,c,q,p] view
    Eg = E.view(b, g, r, c, q, 1)
    gs = (gY.view(b, g, r, c, q, p) * Z).sum(-1).mul_(Eg[..., 0]).view(b, h, c, q)  # gradient of the log-decays s
    gZ = _group_major(gY * E[..., None], g, md)  # [b,g,c,q,r*p]
    gP = _mm(gZ.transpose(-1, -2), Cg, md, ct).view(b, g, c, r, p, n)  # fp32, as S in forward
    gC = _mm(gZ, P, md, ct)  # [b,g,c,q,n]

    # The recurrence P[k+1] = gamma[k] P[k] + S[k], backwards over chunks (carried in fp32).
    decay = gamma.view(b, g, r, c, 1, 1)
    gS = torch.empty(b, g, c, r, p, n, dtype=md, device=xh.device)
    carried = grad_state_out.view(b, g, r, p, n)
    for k in range(c - 1, -1, -1):
        gS[:, :, k] = carried
        carried = torch.addcmul(gP[:, :, k], carried, decay[:, :, :, k])
    # <gS[k], P[k]> (d/d gamma[k] of gamma[k] P[k]) for every chunk at once, a product of the two
    # matmul-dtype operands like the others (fp32 with fp32 inputs): no per-chunk cast of P.
    dots = _mm(gS.view(b, g, c, r, 1, p * n), P.view(b, g, c, r, p * n, 1), md, ct).view(b, g, c, r)
    gs.view(b, g, r, c, q)[..., -1] += dots.transpose(2, 3).mul_(gamma.view(b, g, r, c))

    # Chunk states S = (X * w)^T @ B.
    gSm = gS.view(b, g, c, r * p, n)
    gXw = _head_view(_mm(Bg, gSm.transpose(-1, -2), md, ct), h).reshape(b, h, c, q, p)
    gB = _mm(_group_major(X * w[..., None], g, md), gSm, md, ct)  # [b,g,c,q,n]
    gw = (gXw * X).sum(-1).mul_(w)
    gs -= gw
    gs[..., -1] += gw.sum(-1)
    gX = gXw.mul_(w[..., None])

    # Within chunks: Y = M @ X with M = L * C.B.
    M = (L.view(b, g, r, c, q, q) * CB[:, :, None]).view(b, h, c, q, q)
    gX += _mm(M.transpose(-1, -2), gYm, md, ct)
    gM = _mm(gYm, X.transpose(-1, -2), md, ct)  # [b,h,c,q,q]
    gCB = (gM * L).view(b, g, r, c, q, q).sum(2).to(md)
    gM.mul_(M)  # gradient of the exponent s_i - s_j of L
    gs += gM.sum(-1)
    gs -= gM.sum(-2)
    gC += _mm(gCB, Bg, md, ct)
    gB += _mm(gCB.transpose(-1, -2), Cg, md, ct)

    # s = cumsum(dt * A) within chunks, X = x * dt, and the skip term D * x.
    ga = gs.flip(-1).cumsum(-1).flip(-1)
    gdt = ga * A.to(ct)[:, None, None] + (gX * xh).sum(-1)
    gA = (ga * dth).sum((0, 2, 3))
    gD = (gY * xh).sum((0, 2, 3, 4))
    gx = gX.mul_(dth[..., None]).addcmul_(gY, D.to(ct)[:, None, None, None])
    return (_natural(gx, t), gdt.view(b, h, t).transpose(1, 2), gA, _natural(gB, t), _natural(gC, t), gD,
            carried.reshape(b, h, p, n))


def _scan_blocks(batch: int, total: int, q: int) -> list[tuple[int, int]]:
    """(start, end) of each block of whole chunks the scan covers at once (`SCAN_BLOCK_TOKENS`)."""
    block = max(q, SCAN_BLOCK_TOKENS // max(batch, 1) // q * q)
    return [(start, min(start + block, total)) for start in range(0, total, block)]


def _pad_to_chunks(x, dt, B, C, document_ids, q):
    """Pads the sequence to whole chunks; zero dt on padded steps keeps the state unchanged."""
    b, l = x.shape[:2]
    pad = (-l) % q
    if not pad:
        return x, dt, B, C, document_ids
    x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
    dt = F.pad(dt, (0, 0, 0, pad))
    if document_ids is not None:
        document_ids = torch.cat([document_ids, document_ids[:, -1:].expand(b, pad)], dim=1)
    return x, dt, B, C, document_ids


def _scan_forward(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    document_ids: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """The forward of `SSDChunkScan`: [y, then per block the tensors its backward reads]."""
    y, saved, _ = _scan_forward_with_state(x, dt, A, B, C, D, chunk_size, document_ids, out_dtype)
    return [y, *saved]


def _scan_forward_with_state(x, dt, A, B, C, D, chunk_size, document_ids, out_dtype=None):
    """(y, per block the tensors backward reads, the state after the last step [b,h,p,n]). y is in
    `out_dtype` (default: the compute dtype): each block's head-major result is written into it
    once, the layout change and the cast in one pass."""
    b, l, h, p = x.shape
    n = B.shape[3]
    q = chunk_size
    ct = _compute_dtype(x.dtype)
    md = torch.bfloat16 if x.dtype == torch.bfloat16 else ct
    x, dt, B, C, document_ids = _pad_to_chunks(x, dt, B, C, document_ids, q)
    y = torch.empty(b, l, h, p, dtype=out_dtype or ct, device=x.device)
    state = torch.zeros(b, h, p, n, dtype=ct, device=x.device)
    saved = []
    for start, end in _scan_blocks(b, x.shape[1], q):
        doc = doc_before = None
        if document_ids is not None:
            doc = document_ids[:, start:end]
            doc_before = document_ids[:, max(start - 1, 0):max(start, 1)]
        y_blk, state, tensors = _scan_block_forward(
            x[:, start:end], dt[:, start:end], A, B[:, start:end], C[:, start:end], D, q, doc, doc_before, state, md)
        kept = min(end, l) - start  # padded steps are cut off
        y[:, start:start + kept] = y_blk[:, :kept]
        saved.extend(tensors)
    return y, saved, state


def _scan_forward_op(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    document_ids: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """`_scan_forward` under an op's contract: no output shares storage with an input (with one head
    or one group the head-major layout of x, dt, B or C can be the input itself; those are copied)."""
    outputs = _scan_forward(x, dt, A, B, C, D, chunk_size, document_ids, out_dtype)
    inputs = {t.untyped_storage()._cdata for t in (x, dt, A, B, C, D, document_ids) if t is not None}
    return [t.clone() if t.untyped_storage()._cdata in inputs else t for t in outputs]


# One dispatcher op, so that selective activation checkpointing can name the scan and keep its
# outputs (the products the hand-written backward reads). A dispatch-level policy sees the aten ops
# inside an autograd.Function's forward, and would otherwise cache the scan's inner matmuls, which
# the scan then updates in place. Compiled code traces `_scan_forward` itself instead: as an opaque
# op the compiled scan (forward and backward) ran a quarter slower, its elementwise work unfused.
# On fake tensors the op runs the same code to give its shapes.
ssd_scan_forward = torch.library.custom_op("nemotron_recipe::ssd_scan_forward", _scan_forward_op, mutates_args=())
ssd_scan_forward.register_fake(_scan_forward_op)

# The model's own ops whose outputs `ac=selective` keeps besides matmuls and attention. The scan is
# the costliest op to recompute. (On CUDA, mamba_ssm's Triton scan is no dispatcher op: selective
# checkpointing recomputes it.)
SELECTIVE_AC_SAVED_OPS = frozenset({torch.ops.nemotron_recipe.ssd_scan_forward.default})


class SSDChunkScan(torch.autograd.Function):
    """`ssd_chunked` as one autograd node (see ssd.py for the algorithm and the shapes).

    Computes in fp32 (fp64 for fp64 inputs), block by block of whole chunks (`SCAN_BLOCK_TOKENS`);
    with bf16 inputs the batched products take bf16 operands (`_mm`). The output is in `out_dtype`
    (None: the compute dtype). Gradients are written in their inputs' dtypes as each block's are
    laid back out, with no fp32 copy of the whole sequence's. The forward runs as the custom op
    `ssd_scan_forward` (traced as plain code under torch.compile).
    Saved for backward: fp32 copies of x and dt, B and C (in the matmul dtype), the masked decay
    matrices L [b,h,c,q,q] and C.B [b,g,c,q,q], and the states entering each chunk (in the matmul
    dtype); everything else is recomputed.
    """

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, chunk_size, document_ids, out_dtype=None):
        scan = _scan_forward if torch.compiler.is_compiling() else torch.ops.nemotron_recipe.ssd_scan_forward
        y, *saved = scan(x, dt, A, B, C, D, chunk_size, document_ids, out_dtype)
        b, l, h, p = x.shape
        total = l + (-l) % chunk_size
        ctx.bounds = _scan_blocks(b, total, chunk_size)
        ctx.save_for_backward(A, D, *saved)
        ctx.shape = (b, l, total, h, p, B.shape[2], B.shape[3])
        ctx.dtypes = (x.dtype, dt.dtype, B.dtype, C.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        A, D, *flat = ctx.saved_tensors
        per_block = len(flat) // len(ctx.bounds)
        blocks = [flat[i:i + per_block] for i in range(0, len(flat), per_block)]
        b, l, total, h, p, g, n = ctx.shape
        ct = blocks[0][0].dtype
        x_dtype, dt_dtype, B_dtype, C_dtype = ctx.dtypes
        if total > l:  # (each block's head-major layout casts grad_y to fp32)
            grad_y = F.pad(grad_y, (0, 0, 0, 0, 0, total - l))
        gx = torch.empty(b, total, h, p, dtype=x_dtype, device=grad_y.device)
        gdt = torch.empty(b, total, h, dtype=dt_dtype, device=grad_y.device)
        gB = torch.empty(b, total, g, n, dtype=B_dtype, device=grad_y.device)
        gC = torch.empty(b, total, g, n, dtype=C_dtype, device=grad_y.device)
        gA = torch.zeros(h, dtype=ct, device=grad_y.device)
        gD = torch.zeros(h, dtype=ct, device=grad_y.device)
        carried = torch.zeros(b, h, p, n, dtype=ct, device=grad_y.device)
        for (start, end), tensors in zip(reversed(ctx.bounds), reversed(blocks)):
            bx, bdt, bA, bB, bC, bD, carried = _scan_block_backward(grad_y[:, start:end], A, D, tensors, carried)
            gx[:, start:end], gdt[:, start:end], gB[:, start:end], gC[:, start:end] = bx, bdt, bB, bC
            gA += bA
            gD += bD
        return gx[:, :l], gdt[:, :l], gA.to(A.dtype), gB[:, :l], gC[:, :l], gD.to(D.dtype), None, None, None


@functools.cache
def _triton_scan():
    return _optional_kernel("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")


def triton_scan_available() -> bool:
    """Whether `mamba_ssm`'s Triton SSD kernels can be used (installed and a GPU visible)."""
    return torch.cuda.is_available() and _triton_scan() is not None


# The PyTorch scan's chunk length by device type, at most the model's `chunk_size` (None: the
# default, `cpu_chunk_size` on CPU and the model's own elsewhere). The result does not depend on it
# (up to rounding); set it to tune a device: `benchmarks.profile_step --scan-chunk` measures one.
SCAN_CHUNK_SIZE: dict[str, int | None] = {}


def scan_chunk_size(x: torch.Tensor, B: torch.Tensor, chunk_size: int) -> int:
    """The chunk length the PyTorch scan of x [b,l,h,p], B [b,l,g,n] runs with on x's device."""
    tuned = SCAN_CHUNK_SIZE.get(x.device.type)
    if tuned is not None:
        return max(1, min(int(tuned), chunk_size))
    if x.device.type == "cpu":
        return cpu_chunk_size(chunk_size, x.shape[-1], B.shape[-1])
    return chunk_size


def cpu_chunk_size(chunk_size: int, head_dim: int, state_size: int) -> int:
    """Chunk length for the scan on CPU, at most the model's. The result does not depend on it (up
    to rounding), only the cost: within-chunk work grows with the chunk, and the per-chunk states
    ([head_dim x state_size] per head) with the number of chunks. Measured on CPU (fwd + bwd), 32
    was fastest for states up to 64 x 64 and 64 for 64 x 128 and larger."""
    return min(chunk_size, 32 if head_dim * state_size <= 4096 else 64)


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    document_ids: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`ssd_chunked`'s contract (dt already discretized): the Triton kernels on CUDA when installed
    (output in x's dtype), else `SSDChunkScan` (output in `out_dtype`, default fp32; a caller that
    casts the result anyway saves a pass by naming its dtype here)."""
    triton = _triton_scan_call(x, document_ids)
    if triton is not None:
        return triton(x, dt, A, B, C, chunk_size, D=D)
    return SSDChunkScan.apply(x, dt, A, B, C, D, scan_chunk_size(x, B, chunk_size), document_ids, out_dtype)


def _triton_scan_call(x: torch.Tensor, document_ids: torch.Tensor | None):
    """`mamba_chunk_scan_combined` with the packed documents bound as its `seq_idx` (int32, as the
    kernels take them) when it runs here (x on CUDA, mamba_ssm installed), else None."""
    if not (x.is_cuda and _triton_scan() is not None):
        return None
    seq_idx = None if document_ids is None else document_ids.to(torch.int32).contiguous()
    return functools.partial(_triton_scan(), seq_idx=seq_idx)


# ---------------------------------------------------------------------------------------- decoding
def ssd_scan_final_state(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ssd_scan` without autograd, also returning the state after the last step [b,h,p,n] in fp32:
    the prefill of incremental decoding. With `document_ids` the state is the last document's alone."""
    triton = _triton_scan_call(x, document_ids)
    if triton is not None:
        y, state = triton(x, dt, A, B, C, chunk_size, D=D, return_final_states=True)
        return y, state.float()
    y, _, state = _scan_forward_with_state(x, dt, A, B, C, D, scan_chunk_size(x, B, chunk_size), document_ids)
    return y, state.float()


@functools.cache
def _cuda_conv_update():
    return _optional_kernel("causal_conv1d", "causal_conv1d_update")


@functools.cache
def _cuda_state_update():
    return _optional_kernel("mamba_ssm.ops.triton.selective_state_update", "selective_state_update")


def _conv_step_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype a conv step computes in: the inputs' in `causal_conv1d_update`, fp32 (fp64 for fp64
    inputs) in the PyTorch step, as the whole-sequence conv accumulates."""
    if device.type in _KERNEL_DEVICES and _cuda_conv_update() is not None:
        return dtype
    return _compute_dtype(dtype)


def conv_step_weights(weight: torch.Tensor, bias: torch.Tensor | None,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The conv's weight [C, 1, K] and bias as `conv_step_silu` takes them for inputs of `dtype`:
    [C, K] and [C], rounded to `dtype` first, as the whole-sequence conv takes them
    (`causal_conv1d_silu`), then held in the dtype the step computes in (cast once, not per step)."""
    ct = _conv_step_dtype(weight.device, dtype)
    weight = weight.reshape(weight.shape[0], -1).to(dtype).to(ct).contiguous()
    return weight, None if bias is None else bias.to(dtype).to(ct)


def conv_step_silu(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """One decoding step of silu(causal depthwise conv): x [b, C] the new input, `window` [b, C, K]
    the last K inputs (oldest first), shifted in place to end with x; weight [C, K] and bias [C] from
    `conv_step_weights`. Returns [b, C] in x's dtype. `causal_conv1d_update` on CUDA when installed,
    else `ops.causal_conv1d_step`."""
    from .ops import causal_conv1d_step  # ops holds the plain reference, as for the whole-sequence conv

    if weight.dim() == 3 or weight.dtype != _conv_step_dtype(x.device, x.dtype):
        weight, bias = conv_step_weights(weight, bias, x.dtype)
    if x.device.type in _KERNEL_DEVICES and _cuda_conv_update() is not None:
        return _cuda_conv_update()(x, window, weight, bias, activation="silu")
    return F.silu(causal_conv1d_step(x, window, weight, bias)).to(x.dtype)


def ssm_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """One decoding step of the scan: `state` [b,h,p,n] fp32 updated in place, x [b,h,p], dt [b,h]
    (discretized), A [h], B/C [b,g,n], D [h] -> y [b,h,p] fp32. mamba_ssm's `selective_state_update`
    on CUDA when installed, else `ssd.ssd_step`."""
    from .ssd import ssd_step

    if x.device.type in _KERNEL_DEVICES and _cuda_state_update() is not None:
        h, p, n = x.shape[1], x.shape[2], B.shape[-1]
        # The kernel takes per-(head, dim) dt, A and D; broadcast views (stride 0) cost no copies.
        y = _cuda_state_update()(state, x.float(), dt.float()[..., None].expand(-1, -1, p),
                                 A.float()[:, None, None].expand(h, p, n), B.float(), C.float(),
                                 D=D.float()[:, None].expand(h, p), dt_softplus=False)
        return y.float()
    return ssd_step(state, x, dt, A, B, C, D)


# ---------------------------------------------------------------------------------------- loss
class LinearCrossEntropySum(torch.autograd.Function):
    """sum(cross_entropy(hidden @ weight.T, targets)) over `chunk_size` rows at a time.

    With a large vocabulary the [tokens, vocab] logits, their fp32 copy and their gradient are the
    largest tensors of a step. Here each chunk's logits live only while that chunk is processed: its
    gradients with respect to `hidden` and `weight` are computed right away (softmax minus one-hot,
    two matmuls) and kept, and backward only scales them by the incoming gradient, so the work is
    the plain path's three matmuls and nothing is recomputed.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, ignore_index):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if want_h else None
        # Summed over chunks in fp32, so low-precision weights lose nothing to the chunking.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        for start in range(0, hidden.shape[0], chunk_size):
            h, t = hidden[start:start + chunk_size], targets[start:start + chunk_size]
            # The plain path's numerics: logits in the model's dtype, the loss in fp32.
            log_probs = F.linear(h, weight).float().log_softmax(-1)
            total += F.nll_loss(log_probs, t, ignore_index=ignore_index, reduction="sum")
            if want_h or want_w:
                keep = (t != ignore_index)[:, None]
                grad = log_probs.exp_()
                grad.scatter_add_(1, t.clamp(min=0)[:, None], -keep.to(grad.dtype))
                grad = grad.mul_(keep).to(hidden.dtype)
                if want_h:
                    grad_h[start:start + chunk_size] = grad @ weight
                if want_w:
                    grad_w += grad.t() @ h
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = grad_h * grad_total.to(grad_h.dtype)
        if grad_w is not None:
            grad_w = (grad_w * grad_total).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None


def linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of cross-entropies of hidden @ weight.T against `targets`, number of counted targets),
    with only `chunk_size` tokens' logits in memory at a time. hidden [..., d], targets [...].
    Plain tensors only: a vocab-sharded head's logits take `training.loss.cross_entropy_sum`."""
    if isinstance(weight, DTensor) or isinstance(hidden, DTensor):
        raise TypeError("linear_cross_entropy_sum takes plain tensors; vocab-sharded (DTensor) logits take "
                        "nemotron_recipe.training.loss.cross_entropy_sum")
    flat_targets = targets.to(hidden.device).flatten()
    loss = LinearCrossEntropySum.apply(hidden.flatten(0, -2), weight, flat_targets, max(int(chunk_size), 1),
                                       ignore_index)
    return loss, (flat_targets != ignore_index).sum()
