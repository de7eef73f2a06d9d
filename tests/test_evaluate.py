"""Evaluation through lm-eval: `recipes.evaluate` and `eval.tasks` against lm-eval's own Hugging Face
backend on the exported directory, the shipped offline task, and the refusals of bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from nemotron_recipe.evaluation.tasks import SHIPPED_DIR, EvalError, check_tasks
from nemotron_recipe.training.finetune import run
from nemotron_recipe.training.hf_io import export_hf
from recipes.evaluate import main as evaluate_main

from helpers import REPO, RUN_BASE, SMALL_DIMS, compose_run, metrics_rows

lm_eval = pytest.importorskip("lm_eval")

TASK = "tiny_sft_mc"
LIMIT = 6  # examples: 24 scored continuations of 4 choices
LOGLIK_ATOL = 1e-4  # each continuation's log-likelihood, ours against lm-eval's hf backend, fp32
# A model of every block kind (the tiny preset's pattern) small enough to score the task in seconds.
MODEL = [f"model.{k}={v}" for k, v in SMALL_DIMS.items() if k != "vocab_size"]
FAST = [*RUN_BASE, *MODEL, "trainer.max_steps=2", "trainer.val_every=0", "optim.warmup_steps=0"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    """Two steps of full fine-tuning with eval.tasks, exporting its final checkpoint to <run>/hf."""
    run_dir = tmp_path_factory.mktemp("eval_run")
    run(compose_run(run_dir, f"eval.tasks=[{TASK}]", f"eval.limit={LIMIT}", "checkpoint.export_hf=true", base=FAST))
    return run_dir


def hf_backend(path: Path) -> dict:
    """lm-eval's own `hf` model on a Hugging Face directory, the shipped task found by include_path."""
    from lm_eval.tasks import TaskManager

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={path},dtype=float32", tasks=[TASK], limit=LIMIT, device="cpu",
            batch_size=4, log_samples=True, task_manager=TaskManager(include_path=str(SHIPPED_DIR)))


def ours(path: Path, out: Path, *extra: str) -> dict:
    assert evaluate_main([str(path), "--tasks", TASK, "--limit", str(LIMIT), "--batch-size", "3", "--device", "cpu",
                          "--output", str(out), "--log-samples", *extra]) == 0
    return json.loads(out.read_text())


def logliks(results: dict) -> list[float]:
    return [float(score) for sample in sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
            for score, _ in sample["filtered_resps"]]


def assert_same(a: dict, b: dict) -> float:
    """Equal accuracies and log-likelihoods within LOGLIK_ATOL; returns the largest difference."""
    for metric in ("acc,none", "acc_norm,none"):
        assert a["results"][TASK][metric] == b["results"][TASK][metric], metric
    la, lb = logliks(a), logliks(b)
    assert len(la) == len(lb) == 4 * LIMIT
    diff = max(abs(x - y) for x, y in zip(la, lb, strict=True))
    assert diff <= LOGLIK_ATOL, diff
    return diff


def test_checkpoint_scores_as_the_hf_backend_on_its_export(full_run, tmp_path):
    checkpoint = Path(json.loads((full_run / "summary.json").read_text())["checkpoint"])
    mine = ours(checkpoint, tmp_path / "ours.json")
    assert mine["model_kind"] == "checkpoint"
    assert_same(mine, hf_backend(full_run / "hf"))


def test_eval_tasks_log_at_the_end_of_training(full_run, tmp_path):
    rows = [r for r in metrics_rows(full_run) if any(k.startswith("eval/") for k in r)]
    assert len(rows) == 1 and rows[0]["step"] == 2
    summary = json.loads((full_run / "summary.json").read_text())
    cli = ours(full_run, tmp_path / "run.json")
    for metric in ("acc", "acc_norm"):
        key = f"eval/{TASK}/{metric}"
        assert rows[0][key] == summary[key] == cli["results"][TASK][f"{metric},none"]


def test_lora_checkpoint_scores_as_the_hf_backend_on_its_merged_export(tmp_path):
    run_dir = tmp_path / "lora"
    summary = run(compose_run(run_dir, "peft=lora", "peft.base_dtype=fp32", "optim.lr=1e-2", base=FAST))
    checkpoint = Path(summary["checkpoint"])
    merged = export_hf(checkpoint, tmp_path / "merged", merge=True)
    mine = ours(checkpoint, tmp_path / "ours.json")
    assert mine["model_kind"] == "lora checkpoint"
    assert_same(mine, hf_backend(merged))


def test_rolling_loglikelihood_and_greedy_generation_match_the_hf_backend(full_run):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from nemotron_recipe.evaluation.lm import NativeLM
    from nemotron_recipe.training.load import load_for_inference

    loaded = load_for_inference(full_run / "hf")
    # A short context length, so the longest text is scored in several rolling windows.
    mine = NativeLM(loaded.model, loaded.tokenizer, batch_size=3, max_length=24)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = HFLM(pretrained=str(full_run / "hf"), dtype="float32", device="cpu", batch_size=3, max_length=24)
    texts = ["What colour is the cherry? The cherry is red.", "Add 12 and 27. 12 + 27 = 39.", "Sort: 3 1 2"]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate([" ".join(texts), *texts])]
    a, b = mine.loglikelihood_rolling(rolling), theirs.loglikelihood_rolling(rolling)
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= LOGLIK_ATOL
    # Prompts of different lengths in one batch (ours right-padded, theirs left-padded).
    until = {"until": ["</s>", "."], "max_gen_toks": 6, "do_sample": False}
    generate = [Instance("generate_until", {}, (f"<|user|>{t}<|assistant|>", until), i) for i, t in enumerate(texts)]
    texts = mine.generate_until(generate)
    assert texts == theirs.generate_until(generate) and any(texts)


# ------------------------------------------------------------------ bad input
def test_path_that_is_neither_checkpoint_nor_model_is_refused(tmp_path, capsys):
    assert evaluate_main([str(tmp_path), "--tasks", TASK]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "neither a training checkpoint nor a model directory" in err and "Fix:" in err


def local_manager(*include: Path):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[SHIPPED_DIR, *include], include_defaults=False)


def test_unknown_task_lists_the_available_ones():
    with pytest.raises(EvalError, match=r"unknown task\(s\) \['tiny_sft_m'\]\. Available here: \['tiny_sft_mc'\]"):
        check_tasks(local_manager(), ["tiny_sft_m"], offline=True)


def test_task_needing_the_hub_offline_is_refused_and_a_local_copy_runs(tmp_path):
    (tmp_path / "hub_task.yaml").write_text(
        "task: hub_task\ndataset_path: nobody/not_cached\noutput_type: multiple_choice\ntest_split: test\n"
        "doc_to_text: q\ndoc_to_choice: '{{choices}}'\ndoc_to_target: 0\n")
    (tmp_path / "local_task.yaml").write_text(
        "task: local_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: /data/x.jsonl\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: q\ndoc_to_choice: '{{choices}}'\ndoc_to_target: 0\n")
    manager = local_manager(tmp_path)
    with pytest.raises(EvalError, match=r"task hub_task: reads dataset 'nobody/not_cached' from the Hugging Face Hub.*"
                                        r"--include-path"):
        check_tasks(manager, [TASK, "hub_task"], offline=True)
    check_tasks(manager, [TASK, "local_task"], offline=True)
    check_tasks(manager, ["hub_task"], offline=False)  # online, lm-eval downloads it


def test_eval_tasks_are_checked_with_the_config(tmp_path):
    from nemotron_recipe.config import ConfigError, validate_config

    with pytest.raises(ConfigError) as e:
        validate_config(compose_run(tmp_path, f"eval.tasks=[{TASK}]", "checkpoint.save_final=false", "eval.limit=0"))
    assert "eval.limit=0: must be > 0" in str(e.value)
    assert f"eval.tasks=['{TASK}']: they run on the final checkpoint, and checkpoint.save_final=false" in str(e.value)


def test_missing_lm_eval_names_the_extra(monkeypatch):
    import importlib.util

    from nemotron_recipe.evaluation import tasks

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    with pytest.raises(EvalError, match=r"pip install -e '\.\[eval\]'"):
        tasks.require_lm_eval()


def test_training_imports_no_harness():
    code = ("import sys, nemotron_recipe.training.finetune, nemotron_recipe.config, recipes.evaluate; "
            "print([m for m in ('lm_eval',) if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


def test_task_data_is_made_deterministically_from_the_shipped_data(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "make_eval_task.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("tiny_sft_mc_test.jsonl", "tiny_sft_mc_fewshot.jsonl"):
        assert (tmp_path / name).read_bytes() == (SHIPPED_DIR / name).read_bytes()
    rows = [json.loads(line) for line in (SHIPPED_DIR / "tiny_sft_mc_test.jsonl").read_text().splitlines()]
    val = [json.loads(line) for line in (REPO / "nemotron_recipe/data/assets/tiny_sft_val.jsonl").read_text().splitlines()]
    assert [r["question"] for r in rows] == [v["prompt"] for v in val]
    assert all(r["choices"][r["gold"]] == v["response"] and len(set(r["choices"])) == 4 for r, v in zip(rows, val))


def test_shipped_tasks_run_offline_without_probing_the_network(monkeypatch):
    from nemotron_recipe.evaluation import tasks

    for key in tasks.OFFLINE_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(tasks, "hub_reachable", lambda *a: pytest.fail("probed the network for a shipped task"))
    assert tasks.prepare_network([TASK]) is True
    assert all(tasks.os.environ[k] == "1" for k in tasks.OFFLINE_ENV)
    monkeypatch.setattr(tasks, "hub_reachable", lambda *a: False)
    for key in tasks.OFFLINE_ENV:
        monkeypatch.delenv(key)
    assert tasks.prepare_network(["hellaswag"]) is True  # no network: offline, so a cached dataset still loads
