"""Records every MoE routing decision of a fine-tuning run, to compare two runs token by token.

    python scripts/moe_routing_probe.py OUT_DIR [finetune overrides...]
    torchrun --standalone --nproc-per-node 2 scripts/moe_routing_probe.py OUT_DIR mesh.ep=2 [overrides...]
    python scripts/moe_routing_probe.py --compare ONE_DIR OTHER_DIR

Each rank writes `routing_rank{r}.pt`: for every step, MoE block and training sequence (keyed by its
token ids, so the same sequence matches whichever rank or micro-batch ran it), the experts each real
token chose and its top-k margin: the k-th minus the (k+1)-th biased router score, how far the choice
is from a tie. `--compare` prints, step by step, where the two runs chose differently and the margins
there, against the smallest margin elsewhere.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch


def _install(records: dict) -> None:
    from nemotron_recipe.models.nemotron_v3 import model as model_module
    from nemotron_recipe.training.finetune import Trainer

    current: dict = {}
    original_fb, original_moe = Trainer._forward_backward, model_module.MoE.forward

    def forward_backward(self, batch, denominator):
        current.update(step=self.step + 1, ids=batch["input_ids"], mask=batch.get("token_mask"))
        return original_fb(self, batch, denominator)

    def moe_forward(self, hidden, token_mask=None):
        if self.training and torch.is_grad_enabled() and "ids" in current:
            with torch.no_grad():
                tokens = hidden.detach().flatten(0, -2)
                scores, _, idx = self.gate(tokens)
                biased = scores + model_module.local(self.gate.e_score_correction_bias)
                top = biased.topk(self.gate.top_k + 1, dim=-1).values
                margin = (top[:, -2] - top[:, -1]).view(hidden.shape[:2])
                idx = idx.sort(-1).values.view(*hidden.shape[:2], -1)
            ids = current["ids"]
            for b in range(ids.shape[0]):
                real = int((ids[b] != 0).nonzero().max()) + 1 if (ids[b] != 0).any() else 0
                key = tuple(ids[b, :real].tolist())
                records[(current["step"], id(self), key)] = (idx[b, :real].clone(), margin[b, :real].clone())
        return original_moe(self, hidden, token_mask)

    Trainer._forward_backward = forward_backward
    model_module.MoE.forward = moe_forward


def record(out_dir: str, overrides: list[str]) -> None:
    import os

    from hydra import compose, initialize_config_dir

    from nemotron_recipe.training.finetune import run

    records: dict = {}
    _install(records)
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose(config_name="finetune", overrides=[f"run_dir={out_dir}", *overrides])
    run(cfg)
    # Blocks by order of first appearance (module ids differ between processes).
    order = {m: i for i, m in enumerate(dict.fromkeys(k[1] for k in records))}
    rank = int(os.environ.get("RANK", "0"))
    torch.save({(s, order[m], key): v for (s, m, key), v in records.items()}, Path(out_dir) / f"routing_rank{rank}.pt")


def _load(run_dir: str) -> dict:
    merged: dict = {}
    for f in sorted(Path(run_dir).glob("routing_rank*.pt")):
        merged.update(torch.load(f))
    return merged


def compare(a_dir: str, b_dir: str) -> None:
    a, b = _load(a_dir), _load(b_dir)
    common = sorted(set(a) & set(b), key=lambda k: k[0])
    by_step: dict[int, list] = defaultdict(list)
    for key in common:
        (ia, ma), (ib, mb) = a[key], b[key]
        differ = (ia != ib).any(-1)
        by_step[key[0]].append((differ, ma, mb))
    print(f"{len(common)} (step, block, sequence) records in both runs")
    for step in sorted(by_step):
        rows = by_step[step]
        flips = [(ma[d], mb[d]) for d, ma, mb in rows if d.any()]
        smallest = min(float(torch.minimum(ma, mb).min()) for _, ma, mb in rows if ma.numel())
        line = f"step {step:3d}: smallest top-k margin {smallest:.3e}"
        if flips:
            at = torch.cat([torch.maximum(x, y) for x, y in flips])
            line += f"; {int(at.numel())} token(s) route differently, margins there <= {float(at.max()):.3e}"
        print(line)


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        record(sys.argv[1], sys.argv[2:])
