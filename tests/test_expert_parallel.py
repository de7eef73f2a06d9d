"""Expert parallel: rows sent to their experts' ranks and back give the outputs and gradients of
computing every expert on every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "distributed" / "expert_parallel_worker.py"


@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [2])  # ep 4 runs in test_parallel's four-rank parity cases
def test_dispatch_and_combine_match_every_expert_on_every_rank(tmp_path, ranks):
    out = tmp_path / "ep.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(WORKER), str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = json.loads(out.read_text())["ranks"]
    assert [r["up_shape"][0] for r in results] == [8 // ranks] * ranks
    assert [r["tokens"] for r in results] == [5 + 3 * r for r in range(ranks)]
    # Every rank sends rows to every rank and receives rows from every rank, and the received rows are
    # reordered (source-major to expert-major) on every rank: a wrong reordering cannot pass unseen.
    for r in results:
        assert min(r["send_splits"]) > 0 and min(r["recv_splits"]) > 0, r
        assert r["reordered"], r
    for r, rank in enumerate(results):
        for key in ("out", "x_grad", "up_grad", "down_grad"):
            assert rank[key] < 1e-6, (r, key, rank[key])
