"""Greedy continuation of token prompts: the one function evaluation generates through.

Each step recomputes the whole sequence (no cache), so it is exact and slow; prompts of different
lengths share a batch with right padding, which a causal model never reads before a row's end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


@torch.no_grad()
def greedy_continue(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    stop: Callable[[list[int]], bool] | None = None,
    pad_id: int = 0,
) -> list[list[int]]:
    """Per prompt, the greedily chosen tokens after it: at most `max_new_tokens`, ending after the first
    of `stop_ids`, or once `stop(tokens so far)` is true (stop strings: the caller decodes)."""
    device = next(model.parameters()).device
    rows = [list(p) for p in prompts]
    out: list[list[int]] = [[] for _ in rows]
    live = list(range(len(rows)))
    stops = set(stop_ids)
    for _ in range(max_new_tokens):
        if not live:
            break
        width = max(len(rows[i]) for i in live)
        ids = torch.full((len(live), width), pad_id, dtype=torch.long)
        for j, i in enumerate(live):
            ids[j, : len(rows[i])] = torch.tensor(rows[i])
        logits = model(ids.to(device)).logits
        last = torch.tensor([len(rows[i]) - 1 for i in live], device=device)
        chosen = logits[torch.arange(len(live), device=device), last].argmax(-1).tolist()
        still = []
        for i, token in zip(live, chosen, strict=True):
            rows[i].append(token)
            out[i].append(token)
            if token not in stops and not (stop is not None and stop(out[i])):
                still.append(i)
        live = still
    return out
