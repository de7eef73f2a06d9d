"""Finished work is never lost: diverged steps are neither taken nor saved, and a damaged or
diverged checkpoint is refused by name before anything is written."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from nemotron_recipe.config import ConfigError
from nemotron_recipe.models.nemotron_v3 import PRESETS, CheckpointError, NemotronHForCausalLM
from nemotron_recipe.training.checkpoint import complete_checkpoints, file_checksums, find_checkpoint
from nemotron_recipe.training.finetune import Trainer, run
from nemotron_recipe.training.hf_io import (
    build_meta_model,
    export_hf,
    load_checkpoint_model,
    load_hf_sharded,
    weight_file_problem,
)
from nemotron_recipe.training.nonfinite import NonFiniteError, NonFiniteGuard
from nemotron_recipe.training.preemption import StopConditions

from helpers import REPO, RUN_BASE, SMALL_DIMS, compose_run, metrics_rows

SHORT = ["trainer.val_every=0", "optim.warmup_steps=0"]
# lr=100 from the first step: step 1 is finite, step 2's loss is NaN.
DIVERGING = [*SHORT, "optim.lr=100", "trainer.max_steps=8"]


def cli(module: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def all_finite(checkpoint: Path) -> bool:
    model, _, _ = load_checkpoint_model(checkpoint)
    return all(bool(t.isfinite().all()) for t in model.state_dict().values() if t.is_floating_point())


def poison_step(monkeypatch: pytest.MonkeyPatch, steps: set[int]) -> None:
    """Makes the loss and the gradients of the given steps (1-based) NaN."""
    original = Trainer._forward_backward

    def forward_backward(self: Trainer, batch: dict, denominator: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        loss, mtp_loss = original(self, batch, denominator)
        if self.step + 1 not in steps:  # self.step counts the steps done before this one
            return loss, mtp_loss
        next(p for p in self.params if p.grad is not None).grad.fill_(float("nan"))
        return torch.full_like(loss, float("nan")), mtp_loss

    monkeypatch.setattr(Trainer, "_forward_backward", forward_backward)


# ---------------------------------------------------------------------------------------- non-finite
def poison_one_gradient(monkeypatch: pytest.MonkeyPatch, steps: set[int], losses: list[float]) -> None:
    """Makes one element of one gradient of the given steps (1-based) infinite; the loss stays as it was
    (its values are appended to `losses`)."""
    original = Trainer._forward_backward

    def forward_backward(self: Trainer, batch: dict, denominator: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        loss, mtp_loss = original(self, batch, denominator)
        if self.step + 1 in steps:
            grad = next(p for p in self.params if p.grad is not None).grad
            (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")
            losses.append(loss.item())
        return loss, mtp_loss

    monkeypatch.setattr(Trainer, "_forward_backward", forward_backward)


def test_nonfinite_stop_exits_1_naming_the_step_and_keeps_every_finite_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = cli("recipes.finetune", *RUN_BASE, *DIVERGING, "checkpoint.every=1", "checkpoint.keep=2",
               f"hydra.run.dir={out}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    error = proc.stderr[proc.stderr.index("Error:"):]
    for needle in ("step 2:", "not finite", "last good checkpoint", "step_000001", "trainer.nonfinite=skip"):
        assert needle in error, error
    assert [s for s, _ in complete_checkpoints(out / "checkpoints")] == [1]
    assert all_finite(out / "checkpoints" / "step_000001")


def test_nonfinite_skip_drops_the_step_counts_it_and_stops_past_the_limit(tmp_path, monkeypatch):
    poison_step(monkeypatch, {2})
    summary = run(compose_run(tmp_path / "skip", *SHORT, "trainer.max_steps=4", "trainer.nonfinite=skip"))
    assert summary["steps"] == 4 and summary["skipped_steps"] == 1
    assert math.isfinite(summary["final_loss"])
    rows = {r["step"]: r for r in metrics_rows(tmp_path / "skip") if "loss" in r}
    assert rows[2].get("skipped") is True and rows[2]["loss"] is None
    assert not any(rows[s].get("skipped") for s in (1, 3, 4))
    assert all_finite(tmp_path / "skip" / "checkpoints" / "step_000004")
    monkeypatch.undo()

    # Every step from 2 on diverges: the third skip is one more than allowed.
    with pytest.raises(NonFiniteError) as info:
        run(compose_run(tmp_path / "limit", *RUN_BASE, *DIVERGING, "trainer.nonfinite=skip",
                        "trainer.max_skipped_steps=2", "checkpoint.every=1"))
    assert "step 4:" in str(info.value) and "trainer.max_skipped_steps=2" in str(info.value)
    # Skipped steps leave the weights as they were: the checkpoints after them are finite too.
    assert [s for s, _ in complete_checkpoints(tmp_path / "limit" / "checkpoints")] == [2, 3]
    assert all_finite(tmp_path / "limit" / "checkpoints" / "step_000003")


def test_parameters_holding_nan_are_never_saved():
    torch.manual_seed(0)
    model = NemotronHForCausalLM(PRESETS["tiny"])
    guard = NonFiniteGuard("stop", 0, torch.device("cpu"))
    guard.check_parameters(model, 3, None)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"step 3: parameters \['lm_head.weight'\]"):
        guard.check_parameters(model, 3, Path("ckpt/step_000002"))


@pytest.fixture(scope="module")
def one_step(tmp_path_factory) -> Path:
    """The checkpoint of a one-step run."""
    run_dir = tmp_path_factory.mktemp("one_step")
    run(compose_run(run_dir, *SHORT, "trainer.max_steps=1"))
    return run_dir / "checkpoints" / "step_000001"


def test_export_refuses_a_checkpoint_holding_nan(tmp_path, one_step):
    good = one_step
    model, _, _ = load_checkpoint_model(good)
    state = model.state_dict()
    state["model.norm_f.weight"][3] = float("nan")
    bad = tmp_path / "bad" / "step_000001"
    dcp.save({"model": state}, checkpoint_id=str(bad), no_dist=True)
    # The same meta.json with the new files' checksums: a checkpoint that verifies but holds NaN.
    meta = json.loads((good / "meta.json").read_text())
    (bad / "meta.json").write_text(json.dumps({**meta, "files": file_checksums(bad)}))
    with pytest.raises(CheckpointError, match=r"non-finite values in \['model.norm_f.weight'\]") as info:
        export_hf(bad, tmp_path / "hf")
    assert str(bad) in str(info.value)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("override, needle", [("trainer.nonfinite=ignore", "trainer.nonfinite='ignore'"),
                                              ("trainer.max_skipped_steps=-1", "trainer.max_skipped_steps=-1")])
def test_nonfinite_settings_are_checked(tmp_path, override, needle):
    with pytest.raises(ConfigError, match=needle):
        run(compose_run(tmp_path, override))
    assert not (tmp_path / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------------------- stops
def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics_rows(run_dir) if "loss" in r}


def test_ctrl_c_saves_and_the_resumed_run_repeats_the_uninterrupted_losses(tmp_path):
    common = [*SHORT, "trainer.max_steps=20", "optim.warmup_steps=4"]
    before = signal.getsignal(signal.SIGINT)

    def interrupt_when_training() -> None:
        while not (tmp_path / "split" / "metrics.jsonl").is_file() or '"loss"' not in (
                tmp_path / "split" / "metrics.jsonl").read_text():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_when_training, daemon=True).start()
    summary = run(compose_run(tmp_path / "split", *common))
    assert summary["stopped"] == "signal" and summary["stop_signal"] == "SIGINT" and summary["steps"] < 20
    assert signal.getsignal(signal.SIGINT) == before
    assert [s for s, _ in complete_checkpoints(tmp_path / "split" / "checkpoints")] == [summary["steps"]]

    resumed = run(compose_run(tmp_path / "split", *common))
    assert resumed["resumed_from"] == summary["steps"] and resumed["steps"] == 20
    run(compose_run(tmp_path / "straight", *common))
    assert losses(tmp_path / "split") == pytest.approx(losses(tmp_path / "straight"), rel=1e-6)


def test_a_second_ctrl_c_aborts_but_torchruns_forwarded_copy_does_not(monkeypatch):
    stop = StopConditions(max_minutes=None, started=time.perf_counter(), device=torch.device("cpu"))
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # within the window: torchrun's copy of the same Ctrl-C
        assert stop.poll() == "signal" and stop.received == "SIGINT"
        monkeypatch.setattr(StopConditions, "REPEAT_WINDOW_S", 0.0)
        with pytest.raises(KeyboardInterrupt, match="second Ctrl-C"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        stop.restore()


def test_resuming_with_max_steps_at_or_below_the_checkpoint_step_is_refused(tmp_path):
    run(compose_run(tmp_path, *SHORT, "trainer.max_steps=2"))
    written = (tmp_path / "metrics.jsonl").read_text()
    for max_steps in (2, 1):
        with pytest.raises(CheckpointError) as info:
            run(compose_run(tmp_path, *SHORT, f"trainer.max_steps={max_steps}"))
        for needle in ("step_000002", "saved at step 2", f"trainer.max_steps={max_steps}", "above 2"):
            assert needle in str(info.value)
    assert (tmp_path / "metrics.jsonl").read_text() == written


def torchrun_recipe(out: Path, *overrides: str, cwd: Path) -> subprocess.Popen:
    """A 2-rank recipe launch in its own process group, as a terminal gives it: a Ctrl-C of the group
    reaches torchrun and every rank."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "recipes.finetune", *RUN_BASE, *overrides, f"hydra.run.dir={out}"],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def finished(proc: subprocess.Popen) -> str:
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    return err


@pytest.mark.distributed
def test_ctrl_c_of_a_torchrun_group_saves_and_the_resumed_run_repeats_the_uninterrupted_losses(tmp_path):
    common = [*SHORT, "trainer.max_steps=40", "optim.warmup_steps=4", "checkpoint.save_final=false"]
    out = tmp_path / "split"
    proc = torchrun_recipe(out, *common, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").is_file() and '"loss"' in (out / "metrics.jsonl").read_text()):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=180)  # torchrun's own agent exits 1 on SIGINT; the ranks save
    finally:
        proc.kill()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "signal" and summary["stop_signal"] == "SIGINT", err[-3000:]
    assert summary["steps"] < 40, "the run ended before Ctrl-C reached it"
    (step, path), = complete_checkpoints(out / "checkpoints")
    assert step == summary["steps"] and json.loads((path / "meta.json").read_text())["world_size"] == 2

    finished(torchrun_recipe(out, *common, cwd=tmp_path))
    assert json.loads((out / "summary.json").read_text())["resumed_from"] == step
    finished(torchrun_recipe(tmp_path / "straight", *common, cwd=tmp_path))
    split, straight = losses(out), losses(tmp_path / "straight")
    assert sorted(split) == sorted(straight) == list(range(1, 41))
    assert split == pytest.approx(straight, rel=1e-6)


# ---------------------------------------------------------------------------------------- export
def stale_sharded_export(out: Path) -> None:
    """What an older sharded export leaves: an index and the shards it names."""
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    weight_map = {"model.embeddings.weight": "model-00001-of-00002.safetensors"}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_export_refuses_a_non_empty_dir_and_overwrite_replaces_the_old_model_files(tmp_path, one_step):
    out = tmp_path / "hf"
    out.mkdir()
    stale_sharded_export(out)
    with pytest.raises(CheckpointError, match="not empty") as info:
        export_hf(one_step, out)
    assert "--overwrite" in str(info.value)
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00002.safetensors", "model.safetensors.index.json"]

    proc = cli("recipes.export", str(one_step), str(out), "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (out / "model.safetensors.index.json").exists() and not (out / "model-00001-of-00002.safetensors").exists()
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_pretrained_refuses_an_index_that_disagrees_with_the_single_file(tmp_path, one_step):
    out = export_hf(one_step, tmp_path / "hf")
    assert weight_file_problem(out) is None
    index = {"metadata": {}, "weight_map": {"model.embeddings.weight": "model.safetensors"}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weight_file_problem(out) is None  # an index of the single file agrees with it
    stale_sharded_export(out)
    with pytest.raises(ConfigError) as info:
        run(compose_run(tmp_path / "run", *SHORT, "trainer.max_steps=1", f"model.pretrained={out}"))
    for needle in (f"model.pretrained={str(out)!r}", "model.safetensors.index.json", "--overwrite"):
        assert needle in str(info.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    model = build_meta_model(load_checkpoint_model(one_step)[0].config)
    with pytest.raises(CheckpointError, match="holds both model.safetensors and"):
        load_hf_sharded(model, str(out), "cpu")


# ---------------------------------------------------------------------------------------- integrity
def flip_byte(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0xFF
    file.write_bytes(bytes(data))


def test_a_flipped_byte_is_named_and_resume_auto_falls_back_to_the_intact_checkpoint(tmp_path, caplog):
    common = [*SHORT, "trainer.max_steps=3", "checkpoint.every=1", "checkpoint.keep=0"]
    run(compose_run(tmp_path / "straight", *common))
    split = tmp_path / "split"
    run(compose_run(split, *common, "trainer.stop_at_step=2"))
    damaged = split / "checkpoints" / "step_000002"
    meta = json.loads((damaged / "meta.json").read_text())
    assert set(meta["files"]) == {p.name for p in damaged.iterdir() if p.name != "meta.json"}
    data_file = damaged / "__0_0.distcp"
    flip_byte(data_file, data_file.stat().st_size // 2)

    for attempt in (lambda: export_hf(damaged, tmp_path / "hf"),
                    lambda: run(compose_run(split, *common, f"checkpoint.resume={damaged}"))):
        with pytest.raises(CheckpointError) as info:
            attempt()
        assert str(damaged) in str(info.value) and "__0_0.distcp" in str(info.value)
        assert "checksum" in str(info.value)
    assert not (tmp_path / "hf").exists()

    with caplog.at_level("WARNING"):
        summary = run(compose_run(split, *common))
    assert summary["resumed_from"] == 1 and summary["steps"] == 3
    assert any("skipping step_000002" in r.getMessage() and "__0_0.distcp" in r.getMessage() for r in caplog.records)
    resumed = {r["step"]: r["loss"] for r in metrics_rows(split) if "loss" in r}  # the later rows win
    assert resumed == pytest.approx(losses(tmp_path / "straight"), rel=1e-6)


# ---------------------------------------------------------------------------------------- lineage and lock
def test_a_branch_keeps_both_lineages_and_resume_auto_continues_the_newest(tmp_path, caplog):
    out = tmp_path / "run"
    common = [*SHORT, "checkpoint.every=1"]
    run(compose_run(out, *common, "trainer.max_steps=4", "checkpoint.keep=2"))
    ckpts = out / "checkpoints"
    first = json.loads((ckpts / "step_000004" / "meta.json").read_text())
    assert first["parent"].endswith("step_000003") and first["lineage"] == first["run_id"]

    # A branch from step 3: its step 4 lands beside the other lineage's, and keep=1 prunes only its own.
    run(compose_run(out, *common, "trainer.max_steps=4", "checkpoint.keep=1",
                    f"checkpoint.resume={ckpts / 'step_000003'}"))
    branch = json.loads(next(ckpts.glob("step_000004-*")).joinpath("meta.json").read_text())
    assert branch["lineage"] != first["lineage"] and branch["parent"] == str(ckpts / "step_000003")
    assert sorted(p.name for _, p in complete_checkpoints(ckpts)) == [
        "step_000003", "step_000004", f"step_000004-{branch['lineage']}"]

    with caplog.at_level("INFO"):
        summary = run(compose_run(out, *common, "trainer.max_steps=5", "checkpoint.keep=1"))
    assert summary["resumed_from"] == 4
    assert any(f"step_000004-{branch['lineage']} of lineage {branch['lineage']}" in r.getMessage()
               for r in caplog.records)
    assert sorted(p.name for _, p in complete_checkpoints(ckpts)) == ["step_000003", "step_000004", "step_000005"]
    assert json.loads((ckpts / "step_000005" / "meta.json").read_text())["lineage"] == branch["lineage"]


def test_a_checkpoint_dir_given_to_export_or_resume_means_the_newest_lineages_newest_checkpoint(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for i, (name, lineage) in enumerate([("step_000003", "a" * 12), ("step_000005", "a" * 12), ("step_000004-" + "b" * 12, "b" * 12)]):
        (ckpts / name).mkdir(parents=True)
        (ckpts / name / "meta.json").write_text(json.dumps({"lineage": lineage}))
        os.utime(ckpts / name / "meta.json", ns=(i * 10**9, i * 10**9))
    # Lineage b branched from step 3 and saved last: its step 4 is newer than a's step 5.
    assert find_checkpoint(tmp_path) == find_checkpoint(ckpts) == ckpts / ("step_000004-" + "b" * 12)
    assert find_checkpoint(ckpts / "step_000005") == ckpts / "step_000005"


def test_checkpoints_without_a_lineage_are_one_of_their_own(tmp_path):
    out = tmp_path / "run"
    run(compose_run(out, *SHORT, "trainer.max_steps=2", "checkpoint.every=1", "checkpoint.keep=0"))
    ckpts = out / "checkpoints"
    for _, path in complete_checkpoints(ckpts):  # as written before lineages were recorded
        meta = json.loads((path / "meta.json").read_text())
        for key in ("run_id", "lineage", "parent"):
            del meta[key]
        (path / "meta.json").write_text(json.dumps(meta))
    summary = run(compose_run(out, *SHORT, "trainer.max_steps=4", "checkpoint.every=1", "checkpoint.keep=1"))
    assert summary["resumed_from"] == 2
    assert [p.name for _, p in complete_checkpoints(ckpts)] == ["step_000001", "step_000002", "step_000004"]


def test_a_second_run_on_the_same_dir_is_refused_and_a_dead_runs_lock_taken_over(tmp_path, caplog):
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    lock = ckpts / ".lock"
    holder = {"host": socket.gethostname(), "pid": os.getppid(), "started": "2020-01-01T00:00:00+00:00"}
    lock.write_text(json.dumps(holder))
    with pytest.raises(CheckpointError) as info:
        run(compose_run(tmp_path / "run", *SHORT, "trainer.max_steps=1"))
    for needle in ("in use by another run", str(lock), f"pid {os.getppid()}", "another checkpoint.dir"):
        assert needle in str(info.value), info.value
    assert json.loads(lock.read_text()) == holder and not complete_checkpoints(ckpts)

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({**holder, "pid": dead.pid}))
    with caplog.at_level("WARNING"):
        summary = run(compose_run(tmp_path / "run", *SHORT, "trainer.max_steps=1"))
    assert summary["steps"] == 1 and not lock.exists()
    assert any(f"lock of pid {dead.pid}" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------- disk
def test_a_disk_without_room_is_refused_before_the_first_step_and_stale_tmp_removed(tmp_path, monkeypatch):
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "step_000001.tmp-0123456789ab").mkdir(parents=True)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    with pytest.raises(CheckpointError) as info:
        run(compose_run(tmp_path / "run", *SHORT, "trainer.max_steps=1"))
    for needle in ("no space left", str(ckpts), "needed", "0.0 MiB free", "Fix:"):
        assert needle in str(info.value), info.value
    assert not list(ckpts.glob("*.tmp-*")) and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("failure", [
    OSError(errno.ENOSPC, "No space left on device"),
    CheckpointException("save failed", {0: (RuntimeError("[enforce fail at inline_container.cc:595] . unexpected pos"), "")}),
])
def test_a_full_disk_during_a_save_says_no_space_left(tmp_path, monkeypatch, failure):
    def full(*args, **kwargs):
        raise failure

    monkeypatch.setattr(dcp, "save", full)
    with pytest.raises(CheckpointError) as info:
        run(compose_run(tmp_path / "run", *SHORT, "trainer.max_steps=1"))
    assert "no space left" in str(info.value) and "free now" in str(info.value), info.value
    assert not list((tmp_path / "run" / "checkpoints").glob("*.tmp-*"))


def test_a_finite_loss_with_a_non_finite_gradient_is_not_taken(tmp_path, monkeypatch):
    """The guard reads the gradient as well as the loss: a step whose loss is finite but one of whose
    gradients is not is dropped like a diverged one, and no weight takes the infinite value."""
    guard = NonFiniteGuard("skip", 10, torch.device("cpu"))
    for norm in (float("inf"), float("nan")):
        assert not guard.step_is_finite(torch.tensor(2.5), torch.tensor(norm))
    assert guard.step_is_finite(torch.tensor(2.5), torch.tensor(1.0))
    losses: list[float] = []
    poison_one_gradient(monkeypatch, {2}, losses)
    small = [f"model.{k}={v}" for k, v in {**SMALL_DIMS, "vocab_size": 512}.items()]
    summary = run(compose_run(tmp_path, *SHORT, *small, "trainer.max_steps=3", "trainer.nonfinite=skip"))
    assert len(losses) > 0 and all(math.isfinite(v) for v in losses)
    assert summary["skipped_steps"] == 1
    rows = {r["step"]: r for r in metrics_rows(tmp_path) if "loss" in r}
    assert rows[2].get("skipped") is True and not any(rows[s].get("skipped") for s in (1, 3))
    assert all_finite(tmp_path / "checkpoints" / "step_000003")
