"""The Mamba2 state-space scan in plain PyTorch: the chunked SSD algorithm and a naive reference.

Shapes: b batch, l sequence, h heads, p head dim, g groups (h = g * r heads per group), n state.
Each head shares the B and C of its group, so the scan keeps the group axis instead of repeating B and
C over heads: C·B is computed once per group rather than once per head.

The recurrence, per head, with dt already softplus'ed:
    state_t = exp(dt_t * A) * state_{t-1} + dt_t * outer(x_t, B_t)
    y_t     = state_t @ C_t + D * x_t
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor, limit: tuple[float, float]) -> torch.Tensor:
    """softplus(dt + bias) clamped to `limit` (the config's `time_step_limit`), in fp32. The released
    models set no bound, (0, inf): softplus is already positive, so nothing is clamped."""
    dt = F.softplus(dt.float() + dt_bias.float())
    low, high = limit
    if low > 0.0 or high < math.inf:
        dt = dt.clamp(min=low, max=high)
    return dt


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [b,l,h,p], dt [b,l,h] (discretized), A [h] (negative), B/C [b,l,g,n], D [h] -> y [b,l,h,p] fp32.

    `document_ids` [b,l] marks packed documents (each a contiguous run): the state starts from zero
    at every document's first token, as if each document were scanned alone.
    """
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r = h // g
    q = chunk_size
    pad = (-l) % q
    c = (l + pad) // q

    x, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    D_term = x * D.float()[:, None]
    if pad:
        x, dt, B, C, document_ids = _pad_sequence(pad, x, dt, B, C, document_ids)
    doc = None if document_ids is None else document_ids.view(b, c, q)

    x = x.view(b, c, q, g, r, p)
    dt = dt.view(b, c, q, g, r)
    B = B.view(b, c, q, g, n)
    C = C.view(b, c, q, g, n)
    xdt = x * dt[..., None]

    # Cumulative log-decay inside each chunk, heads last for the [q, q] decay matrices.
    a = (dt * A.float().view(g, r)).permute(0, 1, 3, 4, 2)  # [b,c,g,r,q]
    a_cum = a.cumsum(-1)

    # 1. Within each chunk: a causal, decay-weighted "attention" of C over B.
    y = _within_chunks(C, B, xdt, a_cum, doc)

    # 2. Each chunk's contribution to the state at its end.
    chunk_states = _chunk_end_states(B, xdt, a_cum, doc)

    # 3. The earlier chunks' part: their states carried across chunk boundaries, then read by C.
    y = y + _from_earlier_chunks(C, chunk_states, a_cum, doc)

    y = y.reshape(b, c * q, h, p)[:, :l]
    return y + D_term


def _within_chunks(C: torch.Tensor, B: torch.Tensor, xdt: torch.Tensor, a_cum: torch.Tensor,
                   doc: torch.Tensor | None) -> torch.Tensor:
    """Each position's output from its own chunk's earlier positions (of its document):
    C/B [b,c,q,g,n], xdt [b,c,q,g,r,p], a_cum [b,c,g,r,q] -> [b,c,q,g,r,p]."""
    q = a_cum.shape[-1]
    seg = a_cum[..., :, None] - a_cum[..., None, :]  # [b,c,g,r,q(i),q(j)] = sum of a over (j, i]
    keep = torch.ones(q, q, dtype=torch.bool, device=a_cum.device).tril()
    if doc is not None:
        keep = keep & (doc[..., :, None] == doc[..., None, :])[:, :, None, None]  # same document
    decay = torch.exp(seg.masked_fill(~keep, float("-inf")))
    scores = torch.einsum("bcign,bcjgn->bcgij", C, B)[:, :, :, None] * decay  # [b,c,g,r,i,j]
    return torch.einsum("bcgrij,bcjgrp->bcigrp", scores, xdt)


def _chunk_end_states(B: torch.Tensor, xdt: torch.Tensor, a_cum: torch.Tensor,
                      doc: torch.Tensor | None) -> torch.Tensor:
    """What each chunk's own positions leave in the state at its end: [b,c,g,r,p,n]."""
    decay_to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [b,c,g,r,q]
    if doc is not None:  # only the document still open at the chunk's end carries on
        decay_to_end = decay_to_end * (doc == doc[..., -1:])[:, :, None, None]
    xdt_to_end = xdt * decay_to_end.permute(0, 1, 4, 2, 3)[..., None]
    return torch.einsum("bcjgn,bcjgrp->bcgrpn", B, xdt_to_end)


def _from_earlier_chunks(C: torch.Tensor, chunk_states: torch.Tensor, a_cum: torch.Tensor,
                         doc: torch.Tensor | None) -> torch.Tensor:
    """Each position's output from the chunks before its own (of its document): the state entering
    each chunk, by a short sequential recurrence over the c chunk boundaries, decayed to the position
    and read by C. C [b,c,q,g,n], chunk_states [b,c,g,r,p,n], a_cum [b,c,g,r,q] -> [b,c,q,g,r,p]."""
    chunk_decay = torch.exp(a_cum[..., -1])  # [b,c,g,r]
    if doc is not None:
        # The state entering chunk k belongs to the document open at the end of chunk k-1; it
        # survives chunk k only if that document is still open at chunk k's end.
        doc_in = torch.cat([doc[:, :1, :1], doc[:, :-1, -1:]], dim=1)  # [b,c,1]
        chunk_decay = chunk_decay * (doc[..., -1:] == doc_in)[..., None]
    prev = _states_entering_chunks(chunk_states, chunk_decay)  # [b,c,g,r,p,n]
    y_prev = torch.einsum("bcign,bcgrpn->bcigrp", C, prev)
    decay_from_start = torch.exp(a_cum).permute(0, 1, 4, 2, 3)  # [b,c,q,g,r]
    if doc is not None:
        decay_from_start = decay_from_start * (doc == doc_in)[..., None, None]
    return y_prev * decay_from_start[..., None]


def _pad_sequence(pad: int, x, dt, B, C, document_ids):
    """The sequence padded by `pad` steps to whole chunks. Zero dt on padded steps keeps the state
    unchanged; their outputs are cut off by the caller."""
    x = F.pad(x, (0, 0, 0, 0, 0, pad))
    dt = F.pad(dt, (0, 0, 0, pad))
    B = F.pad(B, (0, 0, 0, 0, 0, pad))
    C = F.pad(C, (0, 0, 0, 0, 0, pad))
    if document_ids is not None:
        document_ids = torch.cat([document_ids, document_ids[:, -1:].expand(-1, pad)], dim=1)
    return x, dt, B, C, document_ids


def _states_entering_chunks(chunk_states: torch.Tensor, chunk_decay: torch.Tensor) -> torch.Tensor:
    """The state entering each chunk: chunk_states [b,c,g,r,p,n] (each chunk's own contribution at its
    end), chunk_decay [b,c,g,r] (how much of the entering state survives the chunk)."""
    state = torch.zeros_like(chunk_states[:, 0])
    states_in = []
    # unbind, not indexing: the backward of c index ops writes c full-size zero-padded gradients,
    # which makes the backward quadratic in the number of chunks; unbind's is one stack.
    for decay_k, states_k in zip(chunk_decay.unbind(1), chunk_states.unbind(1)):
        states_in.append(state)
        state = state * decay_k[..., None, None] + states_k
    return torch.stack(states_in, dim=1)


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """One step of the recurrence, for decoding: `state` [b,h,p,n] (fp32) updated in place, x [b,h,p],
    dt [b,h] (discretized), A [h], B/C [b,g,n], D [h] -> y [b,h,p] in fp32.

    Per group, the heads' rows of the state ([r*p, n]) share B and C: the update is one in-place
    rank-1 `addcmul_` and the read-out one vector-matrix product, with no [b,h,p,n] temporary. The
    read-out multiplies C [1, n] by the rows transposed: CPU's bmm of the rows by a column C [n, 1]
    is many times slower (benchmarks/decode.py's model: 7.7 ms against 0.13 ms at batch 8)."""
    b, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    x, dt = x.float(), dt.float()
    state.mul_(torch.exp(dt * A.float())[..., None, None])  # decay, per (row, head)
    rows = state.view(b * g, (h // g) * p, n)
    rows.addcmul_((x * dt[..., None]).view(b * g, -1, 1), B.float().view(b * g, 1, n))
    y = torch.bmm(C.float().view(b * g, 1, n), rows.transpose(1, 2)).view(b, h, p)
    return torch.addcmul(y, x, D.float()[:, None])


def ssd_naive(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Step-by-step recurrence, the definition the chunked scan must reproduce (tests only)."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r = h // g
    x, dt, A, D = x.double(), dt.double(), A.double(), D.double()
    B = B.double().repeat_interleave(r, dim=2)
    C = C.double().repeat_interleave(r, dim=2)
    state = torch.zeros(b, h, p, n, dtype=torch.float64, device=x.device)
    ys = []
    for t in range(l):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        if document_ids is not None and t > 0:
            decay = decay * (document_ids[:, t] == document_ids[:, t - 1]).double()[:, None, None, None]
        state = state * decay + (dt[:, t, :, None, None] * x[:, t, :, :, None] * B[:, t, :, None, :])
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]) + D[:, None] * x[:, t])
    return torch.stack(ys, dim=1)
