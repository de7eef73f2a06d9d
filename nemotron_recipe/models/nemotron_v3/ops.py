"""Sequence-mixing primitives shared by the model and its context-parallel path.

Both take optional `document_ids` [b, l]: packed documents (each a contiguous run) never see each
other, exactly as if each had been run alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, document_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Depthwise causal convolution of x [b,c,l] with weight [c,1,k]: no step sees the future, and with
    `document_ids` [b,l] none sees an earlier document either."""
    k = weight.shape[-1]
    if document_ids is None:
        return F.conv1d(F.pad(x, (k - 1, 0)), weight, bias, groups=x.shape[1])
    l = x.shape[-1]
    out = x * weight[:, 0, k - 1, None] if bias is None else torch.addcmul(bias[:, None], x, weight[:, 0, k - 1, None])
    for back in range(1, k):  # the tap that looks `back` steps into the past
        same_doc = (document_ids[:, back:] == document_ids[:, :-back]).to(x.dtype)
        tap = x[..., : l - back] * same_doc[:, None] * weight[:, 0, k - 1 - back, None]
        out = out + F.pad(tap, (back, 0))
    return out


def causal_conv1d_step(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """One step of the depthwise causal convolution, for decoding: `window` [b, C, K] holds the last K
    inputs (oldest first) and is shifted in place to end with x [b, C]; weight [C, K]. Returns the
    conv output [b, C] in fp32 (fp64 for fp64 inputs), as the whole-sequence conv accumulates."""
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    shifted = torch.cat((window[..., 1:], x[..., None]), dim=-1)
    window.copy_(shifted)
    out = torch.linalg.vecdot(shifted.to(ct), weight.to(ct))
    return out if bias is None else out + bias.to(ct)


def flash_can_run(dtype: torch.dtype, head_dim: int, masked: bool) -> bool:
    """Whether CUDA's flash attention kernel takes the call: half precision, head dim at most 256 and
    a multiple of 8, no mask. It is the only CUDA kernel that takes grouped kv heads (`enable_gqa`)."""
    return dtype in (torch.bfloat16, torch.float16) and head_dim <= 256 and head_dim % 8 == 0 and not masked


def expands_kv_heads(device_type: str, dtype: torch.dtype, head_dim: int, masked: bool) -> bool:
    """On CUDA, where flash cannot run (fp32, or a document mask), a grouped-query call would fall to
    the math kernel, which builds the [b, heads, L, L] scores; with the kv heads repeated up to the
    query heads the memory-efficient kernel takes it, in memory linear in L (plus the mask). CPU
    kernels take grouped heads as they are."""
    return device_type == "cuda" and not flash_can_run(dtype, head_dim, masked)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
              expand_kv: bool | None = None) -> torch.Tensor:
    """Causal (`mask` None) or masked (`mask` [b, 1, lq, lk] bool, True = attend) attention of q
    [b,hq,lq,d] over k/v [b,hkv,lk,d]; query head i reads kv head i // (hq // hkv). `expand_kv`
    None decides by `expands_kv_heads`."""
    if expand_kv is None:
        expand_kv = expands_kv_heads(q.device.type, q.dtype, q.shape[-1], mask is not None)
    if expand_kv and k.shape[1] != q.shape[1]:
        r = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=k.shape[1] != q.shape[1])


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None,
    expand_kv: bool | None = None,
) -> torch.Tensor:
    """q [b,hq,l,d], k/v [b,hkv,l,d] (positions aligned); with `document_ids` [b,l] a query sees only
    its own document."""
    if document_ids is None:
        return attention(q, k, v, expand_kv=expand_kv)
    l = q.shape[2]
    causal = torch.ones(l, l, dtype=torch.bool, device=q.device).tril()
    mask = causal & (document_ids[:, :, None] == document_ids[:, None, :])
    return attention(q, k, v, mask[:, None], expand_kv=expand_kv)
