"""Packed documents: one row holding several documents gives each document's own losses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nemotron_recipe.models.nemotron_v3 import NemotronHConfig, NemotronHForCausalLM
from nemotron_recipe.models.nemotron_v3.ops import causal_conv1d
from nemotron_recipe.models.nemotron_v3.ssd import ssd_chunked, ssd_naive

from helpers import scan_inputs

# Every block kind; chunk 8 so documents start inside chunks, at chunk edges and span several.
CFG = NemotronHConfig(
    pattern="M*EM-", vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=8,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
)
DOC_LENS = [(5, 11, 8, 13, 3), (24, 1, 15)]  # two rows of 40 tokens


def packed_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids, docs = [], []
    for lens in DOC_LENS:
        ids.append(torch.randint(0, CFG.vocab_size, (sum(lens),), generator=g))
        docs.append(torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)))
    return torch.stack(ids), torch.stack(docs)


def per_token_losses(logits, ids, docs):
    """Next-token loss at every position whose next token is in the same document, else 0."""
    targets = torch.where(docs[:, 1:] == docs[:, :-1], ids[:, 1:], -100)
    targets = F.pad(targets, (0, 1), value=-100)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)


def test_packed_row_equals_documents_run_alone():
    torch.manual_seed(0)
    model = NemotronHForCausalLM(CFG)
    ids, docs = packed_batch()
    packed = per_token_losses(model(ids, document_ids=docs).logits, ids, docs)
    for row, lens in enumerate(DOC_LENS):
        start = 0
        for n in lens:
            alone_ids = ids[row:row + 1, start:start + n]
            alone = per_token_losses(model(alone_ids).logits, alone_ids, torch.zeros_like(alone_ids))
            torch.testing.assert_close(packed[row, start:start + n], alone[0], rtol=1e-5, atol=1e-6)
            start += n
    # Without document ids the same row mixes documents, so the check above can fail.
    mixed = per_token_losses(model(ids).logits, ids, docs)
    assert (mixed - packed).abs().max() > 1e-3


def test_gradients_do_not_cross_documents():
    torch.manual_seed(0)
    model = NemotronHForCausalLM(CFG)
    ids, docs = packed_batch(1)
    emb = model.model.embeddings
    captured = {}
    handle = emb.register_forward_hook(lambda m, i, o: captured.setdefault("h", o.retain_grad() or o))
    logits = model(ids, document_ids=docs).logits
    handle.remove()
    logits[0, 4].sum().backward()  # last token of the first document of row 0
    grad = captured["h"].grad[0].abs().sum(-1)
    assert grad[:5].sum() > 0 and grad[5:].sum() == 0


@pytest.mark.parametrize("seq_len,chunk", [(40, 8), (37, 16)])
def test_scan_resets_state_at_document_starts(seq_len, chunk):
    x, dt, A, B, C, D = scan_inputs(seq_len, torch.Generator().manual_seed(seq_len), h=4, p=3, groups=2)
    docs = torch.stack([torch.arange(seq_len) // 7, torch.arange(seq_len) // 16])
    torch.testing.assert_close(ssd_chunked(x, dt, A, B, C, D, chunk, docs).double(),
                               ssd_naive(x, dt, A, B, C, D, docs), rtol=1e-5, atol=1e-5)


def test_conv_does_not_reach_into_the_previous_document():
    x = torch.randn(1, 3, 10)
    w = torch.randn(3, 1, 4)
    docs = torch.tensor([[0] * 4 + [1] * 6])
    out = causal_conv1d(x, w, None, docs)
    torch.testing.assert_close(out[..., :4], causal_conv1d(x[..., :4], w, None))
    torch.testing.assert_close(out[..., 4:], causal_conv1d(x[..., 4:], w, None))


@pytest.mark.distributed
def test_packed_documents_under_context_parallel(tmp_path):
    worker = Path(__file__).parent / "distributed" / "packing_worker.py"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(worker)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "packed cp=2 matches documents run alone" in proc.stdout
