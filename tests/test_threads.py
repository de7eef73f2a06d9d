"""CPU threads: the recipe sets OpenMP's passive wait policy before torch loads it, an explicit setting
wins; runs that time out fail naming their run and log (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nemotron_recipe.training.threads import choose_threads

from helpers import REPO


def test_choice_sets_passive_waits_only_where_unset():
    env: dict[str, str] = {}
    assert choose_threads(env).wait_policy == "PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for given in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"NR_THREADS": "torch"}):
        env = dict(given)
        assert choose_threads(env).wait_policy is None and env == given


@pytest.mark.parametrize("recipe", ["finetune", "generate", "evaluate"])
def test_recipe_chooses_before_torch_loads_openmp(recipe):
    """In a process that imports a recipe that computes (training, decoding), OpenMP came up passive and
    torch kept its thread count; the user's own settings pass through."""
    code = (f"import os, recipes.{recipe}, torch; "
            "print(torch.get_num_threads(), os.environ.get('OMP_WAIT_POLICY'), torch.__config__.parallel_info())")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "NR_THREADS")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    threads, policy = proc.stdout.split()[:2]
    assert policy == "PASSIVE" and int(threads) == min(len(os.sched_getaffinity(0)), int(threads))
    assert "OMP_NUM_THREADS : [not set]" in proc.stdout


def test_a_run_that_times_out_fails_naming_its_run_and_log(tmp_path):
    cmd = [sys.executable, "-c", "import time; print('step 1 done', flush=True); time.sleep(120)",
           f"hydra.run.dir={tmp_path}"]
    with pytest.raises(pytest.fail.Exception) as failure:
        subprocess.run(cmd, capture_output=True, text=True, timeout=5)
    message = str(failure.value)
    assert f"(run dir {tmp_path})" in message and f"its output is in {tmp_path / 'output.log'}" in message
    assert "TimeoutExpired" not in message and "step 1 done" in message
    assert "step 1 done" in (tmp_path / "output.log").read_text()
