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


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """q [b,hq,l,d], k/v [b,hkv,l,d] (positions aligned); with `document_ids` [b,l] a query sees only
    its own document."""
    if document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    l = q.shape[2]
    causal = torch.ones(l, l, dtype=torch.bool, device=q.device).tril()
    mask = causal & (document_ids[:, :, None] == document_ids[:, None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
