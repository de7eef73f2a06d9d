"""Checkpoints: exact resume on the same and other meshes, preemption, crash safety, Hugging Face
import straight into the sharded model and export, and clear errors for damaged checkpoints.

The multi-rank runs share launches: one 4-rank job (fsdp 2 x tp 2) and one 2-rank job run several
configs each through tests/distributed/recipe_worker.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from nemotron_recipe.models.nemotron_v3 import PRESETS, CheckpointError, NemotronHConfig, NemotronHForCausalLM, build_meta_model
from nemotron_recipe.models.nemotron_v3.checkpoint import native_to_hf
from nemotron_recipe.training.checkpoint import PUBLISH_DELAY_ENV, complete_checkpoints
from nemotron_recipe.training.finetune import run
from nemotron_recipe.training.hf_io import load_checkpoint_model, load_hf_sharded
from nemotron_recipe.training.optim import lr_factor

from helpers import RUN_BASE, compose_run, metrics_rows, perturb_off_init

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
WORKER = REPO / "tests" / "distributed" / "recipe_worker.py"

TINY = RUN_BASE
# 20 steps whose LR schedule (warmup, then cosine) is still moving at the resume point.
CURVE = [*TINY, "trainer.max_steps=20", "trainer.val_every=10", "optim.warmup_steps=4"]
FSDP2_TP2 = ["mesh.tp=2", "ac=full"]  # activation checkpointing: names must not depend on it


make_cfg = compose_run
rows = metrics_rows


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r}


def max_rel_diff(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in a)


def torchrun(nproc: int, jobs: list[list[str]], cwd: Path, timeout: int = 300) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         str(WORKER), json.dumps(jobs)],
        cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def snapshot(path: Path) -> dict[str, str]:
    """Every file under `path` with a hash of its bytes: proof that nothing was touched."""
    return {
        str(p.relative_to(path)): hashlib.sha1(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*")) if p.is_file()
    }


def hf_tiny_checkpoint(path: Path) -> Path:
    """A `transformers` NemotronH of the tiny preset, saved by `transformers` itself, with norms,
    SSM terms and the router bias moved off their init values so that every tensor matters."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**PRESETS["tiny"].to_hf_dict())).float()
    perturb_off_init(hf)
    hf.save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 4-rank launch (straight, stopped, resumed, pretrained) and one 2-rank launch (resume on fsdp 2)."""
    base = tmp_path_factory.mktemp("ckpt_runs")
    hf_dir = hf_tiny_checkpoint(base / "hf_tiny")
    pretrained = [*TINY, "trainer.max_steps=1", "trainer.val_every=0", f"model.pretrained={hf_dir}"]
    began = time.perf_counter()
    torchrun(4, [
        [*CURVE, *FSDP2_TP2, f"run_dir={base / 'straight'}"],
        [*CURVE, *FSDP2_TP2, f"run_dir={base / 'split'}", "trainer.stop_at_step=10"],
        [*CURVE, *FSDP2_TP2, f"run_dir={base / 'split'}"],
        [*pretrained, "mesh.tp=2", f"run_dir={base / 'pretrained_4'}"],
    ], cwd=base)
    four_rank_s = time.perf_counter() - began
    step10 = base / "split" / "checkpoints" / "step_000010"
    torchrun(2, [[*CURVE, f"checkpoint.resume={step10}", f"run_dir={base / 'fsdp2'}"]], cwd=base)
    return {"base": base, "hf": hf_dir, "pretrained": pretrained, "step10": step10, "four_rank_s": four_rank_s}


@pytest.mark.distributed
def test_stop_and_resume_on_the_same_mesh_is_exact(runs):
    base = runs["base"]
    straight, split = rows(base / "straight"), rows(base / "split")
    # Every row of the stopped run is kept and the resumed run's rows follow: the same rows as
    # the straight run, steps and validation included.
    assert [(r["step"], "loss" in r) for r in split] == [(r["step"], "loss" in r) for r in straight]
    assert max_rel_diff(losses(base / "split"), losses(base / "straight")) <= 1e-6
    val = lambda rs: [r["val_loss"] for r in rs if "val_loss" in r]  # noqa: E731
    assert val(split) == pytest.approx(val(straight), rel=1e-6)
    assert [r["lr"] for r in split if "lr" in r] == pytest.approx([r["lr"] for r in straight if "lr" in r], rel=1e-12)

    summary = json.loads((base / "split" / "summary.json").read_text())
    assert summary["resumed_from"] == 10 and summary["steps"] == 20 and summary["stopped"] is None
    assert [s for s, _ in complete_checkpoints(base / "split" / "checkpoints")] == [10, 20]
    meta = json.loads((runs["step10"] / "meta.json").read_text())
    assert meta["step"] == 10 and meta["world_size"] == 4
    assert meta["mesh"]["tp"] == 2 and meta["mesh"]["dp_shard"] == 2
    assert meta["model"] == json.loads(json.dumps(NemotronHConfig.from_preset("tiny").__dict__))


@pytest.mark.distributed
def test_resume_on_another_mesh_and_on_one_process(runs, tmp_path):
    base = runs["base"]
    straight = losses(base / "straight")
    tail = {s: v for s, v in straight.items() if s > 10}
    assert max_rel_diff(losses(base / "fsdp2"), tail) <= 1e-5
    assert json.loads((base / "fsdp2" / "summary.json").read_text())["mesh"]["tp"] == 1

    summary = run(make_cfg(tmp_path, *CURVE[len(TINY):], f"checkpoint.resume={runs['step10']}",
                           "checkpoint.export_hf=true"))
    assert summary["world_size"] == 1 and summary["resumed_from"] == 10
    assert max_rel_diff(losses(tmp_path), tail) <= 1e-5
    assert (tmp_path / "hf" / "config.json").is_file() and summary["hf_export"] == str(tmp_path / "hf")


@pytest.mark.distributed
def test_parameter_names_do_not_depend_on_mesh_or_activation_checkpointing(runs, tmp_path):
    keys = set(FileSystemReader(str(runs["step10"])).read_metadata().state_dict_metadata)
    assert not any("_checkpoint_wrapped_module" in k for k in keys)
    model = {k for k in keys if k.startswith("model.")}
    expected = {f"model.{k}" for k in NemotronHForCausalLM(NemotronHConfig.from_preset("tiny")).state_dict()}
    assert model == expected
    # Optimizer state is keyed by those names too, one Adam state per parameter.
    assert {k.rsplit(".", 1)[0].removeprefix("optim.state.") for k in keys if k.startswith("optim.state.")} \
        == {k.removeprefix("model.") for k in model if "e_score_correction_bias" not in k}


@pytest.mark.distributed
def test_pretrained_loads_sharded_with_single_process_first_loss(runs, tmp_path):
    run(make_cfg(tmp_path, *runs["pretrained"][len(TINY):]))
    four = losses(runs["base"] / "pretrained_4")
    assert max_rel_diff(four, losses(tmp_path)) <= 1e-5


@pytest.mark.distributed
def test_export_loads_in_transformers_with_equal_logits(runs, tmp_path):
    transformers = pytest.importorskip("transformers")
    checkpoint = runs["base"] / "split" / "checkpoints" / "step_000020"  # saved by 4 ranks
    proc = subprocess.run([sys.executable, "-m", "recipes.export", str(checkpoint), str(tmp_path / "hf")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()}

    ours, meta, _ = load_checkpoint_model(checkpoint)
    assert meta["step"] == 20
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).float().eval()
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(ids).logits.float() - ours(ids).logits).abs().max().item()
    assert diff <= 1e-4


# ---------------------------------------------------------------------------------------- stopping
def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"process ended early ({proc.returncode}): {proc.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def trained(run_dir: Path) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.is_file() and '"loss"' in path.read_text()


@pytest.mark.distributed
def test_sigterm_saves_and_exits_zero_with_ranks_agreeing(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "recipes.finetune", *TINY, "trainer.max_steps=1000", "trainer.val_every=0", f"hydra.run.dir={out}"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for(lambda: trained(out), proc)
        ranks = children(proc.pid)
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGTERM)  # one rank only: the other learns it at the next step boundary
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "signal" and summary["stop_signal"] == "SIGTERM"
    assert 1 <= summary["steps"] < 1000
    (step, path), = complete_checkpoints(out / "checkpoints")
    assert step == summary["steps"] and summary["checkpoint"] == str(path)
    assert json.loads((path / "meta.json").read_text())["world_size"] == 2
    assert max(losses(out)) == step


def test_sigusr1_max_minutes_and_stop_at_step_end_the_run_with_a_checkpoint(tmp_path):
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)

    def send_when_training() -> None:
        while not trained(tmp_path / "usr1"):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)

    threading.Thread(target=send_when_training, daemon=True).start()
    summary = run(make_cfg(tmp_path / "usr1", "trainer.max_steps=1000", "trainer.val_every=0"))
    assert summary["stopped"] == "signal" and summary["stop_signal"] == "SIGUSR1"
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before
    assert [s for s, _ in complete_checkpoints(tmp_path / "usr1" / "checkpoints")] == [summary["steps"]]
    # No final validation for a run that did not finish.
    assert max(r["step"] for r in rows(tmp_path / "usr1") if "val_loss" in r) == 0

    summary = run(make_cfg(tmp_path / "minutes", "trainer.max_steps=1000", "trainer.max_minutes=0.0001"))
    assert summary["stopped"] == "max_minutes" and summary["steps"] == 1
    assert (tmp_path / "minutes" / "checkpoints" / "step_000001" / "meta.json").is_file()

    common = ["trainer.max_steps=6", "trainer.val_every=0", "optim.warmup_steps=2"]
    summary = run(make_cfg(tmp_path / "at", *common, "trainer.stop_at_step=4"))
    assert summary["stopped"] == "stop_at_step" and summary["steps"] == 4
    # The schedule runs to max_steps: step 4's lr is that of a 6-step run, not the end of a 4-step one.
    six = lr_factor(3, warmup_steps=2, max_steps=6, min_lr_ratio=0.1)
    assert six != pytest.approx(lr_factor(3, warmup_steps=2, max_steps=4, min_lr_ratio=0.1))
    assert rows(tmp_path / "at")[-1]["lr"] == pytest.approx(3e-3 * six)
    # Relaunching the same command finds nothing left to do before stop_at_step.
    again = run(make_cfg(tmp_path / "at", *common, "trainer.stop_at_step=4"))
    assert again["stopped"] == "stop_at_step" and again["steps"] == 4 and again["resumed_from"] == 4


def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path):
    out = tmp_path / "run"
    common = ["trainer.max_steps=6", "trainer.val_every=0", "checkpoint.every=2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "recipes.finetune", *TINY, *common, f"run_dir={out}", f"hydra.run.dir={out}"],
        cwd=REPO, env={**os.environ, PUBLISH_DELAY_ENV: "4:300"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        # The shards of step 4 are written; the run now waits before publishing them.
        wait_for(lambda: bool(list((out / "checkpoints").glob("step_000004.tmp-*/.metadata"))), proc)
    finally:
        proc.kill()
        proc.communicate()
    assert [s for s, _ in complete_checkpoints(out / "checkpoints")] == [2]
    written = (out / "metrics.jsonl").read_text()
    killed_losses = losses(out)

    summary = run(make_cfg(out, *common))
    assert summary["resumed_from"] == 2 and summary["steps"] == 6
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000004", "step_000006"]
    # Rows are appended, never rewritten; the steps redone after the crash repeat exactly.
    assert (out / "metrics.jsonl").read_text().startswith(written)
    redone = [r for r in rows(out)[len(written.splitlines()):] if "loss" in r]
    assert [r["step"] for r in redone] == [3, 4, 5, 6]
    assert all(r["loss"] == killed_losses[r["step"]] for r in redone if r["step"] in killed_losses)


# ---------------------------------------------------------------------------------------- errors
@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("small")
    run(make_cfg(run_dir, "trainer.max_steps=2", "trainer.val_every=0"))
    return run_dir


def copy_run(small_run: Path, dest: Path) -> Path:
    shutil.copytree(small_run, dest)
    return dest


@pytest.mark.parametrize("case", ["other_model", "missing_file", "wrong_shapes", "resume_none", "no_meta"])
def test_bad_checkpoints_fail_clearly_and_nothing_is_overwritten(small_run, tmp_path, case):
    run_dir = copy_run(small_run, tmp_path / "run")
    step = run_dir / "checkpoints" / "step_000002"
    overrides = ["trainer.max_steps=4", "trainer.val_every=0"]
    hidden = NemotronHConfig.from_preset("tiny").hidden_size
    if case == "other_model":
        overrides.append("model.hidden_size=64")
        needles = [str(step), "another model", f"hidden_size: {hidden} in the checkpoint, 64 in this run"]
    elif case == "missing_file":
        (step / "__0_0.distcp").unlink()
        needles = [str(step), "missing file", "__0_0.distcp"]
    elif case == "wrong_shapes":
        # meta.json claims the run's model, the tensors are another's.
        meta = json.loads((step / "meta.json").read_text())
        meta["model"]["vocab_size"] = 1024
        (step / "meta.json").write_text(json.dumps(meta))
        overrides.append("model.vocab_size=1024")
        needles = [str(step), "shapes differ", "model.embeddings.weight", f"(512, {hidden}), (1024, {hidden})"]
    elif case == "resume_none":
        overrides.append("checkpoint.resume=none")
        needles = ["already holds checkpoints", "step_000002", "checkpoint.resume=auto"]
    else:
        (step / "meta.json").unlink()
        overrides.append(f"checkpoint.resume={step}")
        needles = [str(step), "not a complete checkpoint"]
    before = snapshot(run_dir)
    with pytest.raises(CheckpointError) as info:
        run(make_cfg(run_dir, *overrides))
    for needle in needles:
        assert needle in str(info.value)
    assert snapshot(run_dir) == before


def test_export_cli_reports_a_damaged_checkpoint(small_run, tmp_path):
    run_dir = copy_run(small_run, tmp_path / "run")
    (run_dir / "checkpoints" / "step_000002" / ".metadata").unlink()
    proc = subprocess.run([sys.executable, "-m", "recipes.export", str(run_dir), str(tmp_path / "hf")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Error:" in proc.stderr and "missing file .metadata" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------------------------------- import
def test_sharded_import_reads_both_layouts_like_the_unsharded_loader(tmp_path):
    from safetensors.torch import save_file

    released = hf_tiny_checkpoint(tmp_path / "released")
    reference = NemotronHForCausalLM.from_pretrained(str(released))
    model = build_meta_model(reference.config)
    load_hf_sharded(model, str(released), "cpu")
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name

    # transformers' in-memory layout: `model.*` names and experts stacked in one tensor.
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    shutil.copy(released / "config.json", stacked / "config.json")
    hf_state = native_to_hf(reference.state_dict(), reference.config)
    out = {}
    for name, value in hf_state.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            continue
        out["model." + name.removeprefix("backbone.") if name.startswith("backbone.") else name] = value
    for name, value in reference.state_dict().items():
        if name.endswith(("experts.up_proj", "experts.down_proj")):
            out[name] = value.contiguous()
    save_file(out, str(stacked / "model.safetensors"))
    model = build_meta_model(reference.config)
    load_hf_sharded(model, str(stacked), "cpu")
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_sharded_import_names_a_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    path = hf_tiny_checkpoint(tmp_path / "hf")
    state = load_file(str(path / "model.safetensors"))
    bias = next(k for k in state if k.endswith("e_score_correction_bias"))
    del state[bias]
    save_file(state, str(path / "model.safetensors"))
    model = build_meta_model(NemotronHConfig.from_hf(str(path)))
    with pytest.raises(CheckpointError, match=r"missing \['model\.layers\.5\.mixer\.gate\.e_score_correction_bias'\]"):
        load_hf_sharded(model, str(path), "cpu")
