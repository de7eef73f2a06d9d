"""The launch scripts in launch/ and the submitit launcher config.

Dry runs are checked by reading their output back as shell words, so quoting mistakes show up as
wrong arguments. The SLURM script's real mode runs against stand-ins for srun, scontrol and torchrun
that behave like the real ones where it matters: srun signals every process of the step, and the
torchrun agent starts the trainer as a child process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
TORCHRUN_SH = REPO / "launch" / "torchrun.sh"
SLURM_SBATCH = REPO / "launch" / "slurm.sbatch"
# Every shell script the repository ships (the GPU check too: it runs where nobody can fix it mid-run).
SCRIPTS = [TORCHRUN_SH, SLURM_SBATCH, REPO / "benchmarks" / "gpu_check.sh"]
SUBMITIT_YAML = REPO / "conf" / "hydra" / "launcher" / "submitit_slurm.yaml"

# Overrides a shell would mangle if the scripts quoted them carelessly; Hydra reads each as intended.
TRICKY_OVERRIDES = [
    "optim.lr=1e-3",
    "data.train_file=/data/my train.jsonl",
    "logger.wandb.name=\"$USER's run\"",
    "model.pattern=M*M-",
    'logger.wandb.tags=["a b","c"]',
]

_LAUNCH_VARS = {
    "NNODES", "NPROC_PER_NODE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_ID", "NR_RUN_ID",
    "DRY_RUN", "CUDA_VISIBLE_DEVICES",
}


# torchrun.sh counts the processes of a GPU-less launch with the `python` on PATH, which in an
# activated environment is the one running these tests.
_PATH = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("SLURM_")}
    # No GPU is visible unless a test says otherwise, whatever machine runs the tests.
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PATH"] = _PATH
    env.update(extra)
    return env


# Generous: a GPU-less launch composes the config first, which imports torch.
def _run(script: Path, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args],
        env=_clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def _words(line: str) -> list[str]:
    return shlex.split(line, posix=True)


# ------------------------------------------------------------------------------------ static checks
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_syntax(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    proc = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_torchrun_script_is_executable() -> None:
    assert os.access(TORCHRUN_SH, os.X_OK), "launch/torchrun.sh must keep its executable bit"


# ------------------------------------------------------------------------------------ torchrun.sh
@pytest.mark.parametrize("how", ["env", "flag"])
def test_torchrun_single_node_dry_run(how: str) -> None:
    if how == "env":
        proc = _run(TORCHRUN_SH, *TRICKY_OVERRIDES, DRY_RUN="1", NR_RUN_ID="run7")
    else:
        proc = _run(TORCHRUN_SH, "--dry-run", *TRICKY_OVERRIDES, NR_RUN_ID="run7")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    assert _words(lines[0]) == [
        "NR_RUN_ID=run7", "torchrun", "--nnodes", "1", "--nproc-per-node", "1", "--standalone",
        "-m", "recipes.finetune", *TRICKY_OVERRIDES,
    ]


def test_torchrun_default_run_id_is_the_start_time() -> None:
    proc = _run(TORCHRUN_SH, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"NR_RUN_ID=\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", _words(proc.stdout)[0])


def _nproc(words: list[str]) -> int:
    return int(words[words.index("--nproc-per-node") + 1])


@pytest.mark.parametrize(
    ("overrides", "nproc"),
    [
        ([], 1),
        (["mesh=tp2_sp"], 2),
        (["mesh=hsdp"], 2),  # dp_shard=-1 takes whatever is left: nothing
        (["mesh.tp=2", "mesh.cp=2"], 4),
        (["mesh=tp2_sp", "mesh.cp=2"], 4),
        (["mesh.dp_shard=3", "mesh=tp2"], 6),  # the group first, then the keys, whatever their order
    ],
)
def test_torchrun_without_gpus_starts_what_the_mesh_needs(overrides: list[str], nproc: int) -> None:
    proc = _run(TORCHRUN_SH, "--dry-run", *overrides, NR_RUN_ID="run3")
    assert proc.returncode == 0, proc.stderr
    assert _words(proc.stdout) == [
        "NR_RUN_ID=run3", "torchrun", "--nnodes", "1", "--nproc-per-node", str(nproc), "--standalone",
        "-m", "recipes.finetune", *overrides,
    ]


def test_torchrun_mesh_counts_only_where_nothing_else_does() -> None:
    # A bad override shows that nothing was composed: the recipe will report it once started.
    words = _words(_run(TORCHRUN_SH, "--dry-run", "mesh=tp3", CUDA_VISIBLE_DEVICES="0,1").stdout)
    assert _nproc(words) == 2
    words = _words(_run(TORCHRUN_SH, "--dry-run", "mesh=tp3", NPROC_PER_NODE="3").stdout)
    assert _nproc(words) == 3
    env = dict(NNODES="2", MASTER_ADDR="node001", RDZV_ID="job42")
    assert _nproc(_words(_run(TORCHRUN_SH, "--dry-run", "mesh=tp3", **env).stdout)) == 1


@pytest.mark.parametrize(
    ("overrides", "messages"),
    [
        (["mesh=tp3"], ["Could not find 'mesh/tp3'", "tp2_sp"]),  # Hydra lists the options
        (["mesh=tp2", "mesh.tp=two"], ["mesh.tp=two", "could not be converted to Integer"]),
        (["mesh.cp=0"], ["mesh.cp=0: must be >= 1"]),
        (["optim.lr=1e-3,1e-4"], ["Ambiguous value for argument"]),
    ],
)
def test_torchrun_stops_on_overrides_that_do_not_compose(overrides: list[str], messages: list[str]) -> None:
    proc = _run(TORCHRUN_SH, "--dry-run", *overrides)
    assert proc.returncode == 2 and proc.stdout == ""
    for message in [*messages, "launch/torchrun.sh: cannot count the processes", "NPROC_PER_NODE"]:
        assert message in proc.stderr


def test_torchrun_one_process_per_visible_gpu() -> None:
    words = _words(_run(TORCHRUN_SH, "--dry-run", CUDA_VISIBLE_DEVICES="0,1,2,3").stdout)
    assert words[words.index("--nproc-per-node") + 1] == "4"
    words = _words(_run(TORCHRUN_SH, "--dry-run", CUDA_VISIBLE_DEVICES="0,1", NPROC_PER_NODE="3").stdout)
    assert words[words.index("--nproc-per-node") + 1] == "3"


@pytest.mark.parametrize(("node_rank", "is_host"), [(None, None), ("0", "true"), ("3", "false")])
def test_torchrun_multi_node_dry_run(node_rank: str | None, is_host: str | None) -> None:
    env = dict(NNODES="4", NPROC_PER_NODE="8", MASTER_ADDR="node001", MASTER_PORT="29511", RDZV_ID="job42")
    if node_rank is not None:
        env["NODE_RANK"] = node_rank
    proc = _run(TORCHRUN_SH, "--dry-run", "mesh.tp=8", "data.train_file=a b.jsonl", **env)
    assert proc.returncode == 0, proc.stderr
    words = _words(proc.stdout)
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "node001:29511", "--rdzv-id", "job42"]
    if is_host is not None:
        rdzv += ["--rdzv-conf", f"is_host={is_host}"]
    assert words == [
        "NR_RUN_ID=job42", "torchrun", "--nnodes", "4", "--nproc-per-node", "8", *rdzv,
        "-m", "recipes.finetune", "mesh.tp=8", "data.train_file=a b.jsonl",
    ]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (dict(NNODES="2", RDZV_ID="j"), "MASTER_ADDR"),
        (dict(NNODES="2", MASTER_ADDR="node001"), "RDZV_ID"),
        (dict(NNODES="two"), "NNODES"),
        (dict(NPROC_PER_NODE="0"), "NPROC_PER_NODE"),
    ],
)
def test_torchrun_refuses_incomplete_settings(env: dict[str, str], message: str) -> None:
    proc = _run(TORCHRUN_SH, "--dry-run", **env)
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stdout == ""


_SCONTROL = """#!/bin/bash
echo "$*" >> "$FAKE_LOG/scontrol.log"
if [[ $1 == show && $2 == hostnames ]]; then printf "gpu01\\ngpu02\\ngpu03\\n"; fi
"""

# Like slurmstepd (proctrack/cgroup), srun signals every process of the step: torchrun starts each
# trainer in a session of its own, so signalling the step's process group would miss them.
_SRUN = """
import os, signal, subprocess, sys
task = sys.argv[sys.argv.index('bash'):]
proc = None

def descendants(root):
    children = {}
    for entry in os.listdir('/proc'):
        if entry.isdigit():
            try:
                stat = open(f'/proc/{entry}/stat').read()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(')', 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found

def forward(sig, frame):
    for pid in descendants(proc.pid) if proc is not None else []:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

signal.signal(signal.SIGUSR1, forward)
signal.signal(signal.SIGTERM, forward)
proc = subprocess.Popen(task, env=dict(os.environ, SLURM_NODEID='0'), start_new_session=True)
open(os.path.join(os.environ['FAKE_LOG'], 'step.pgid'), 'w').write(str(proc.pid))
rc = proc.wait()
sys.exit(rc if rc >= 0 else 128 - rc)
"""

# The torchrun agent: records how it was started, runs one trainer process and returns its status.
_TORCHRUN = """
import json, os, signal, subprocess, sys
log = os.environ['FAKE_LOG']
json.dump({'argv': sys.argv[1:], 'NR_RUN_ID': os.environ.get('NR_RUN_ID'),
           'NODE_RANK': os.environ.get('NODE_RANK'),
           'usr1_ignored': signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN},
          open(os.path.join(log, 'torchrun.json'), 'w'))
signal.signal(signal.SIGTERM, lambda *_: None)
trainer = subprocess.Popen([sys.executable, os.environ['FAKE_TRAINER']], start_new_session=True)
sys.exit(trainer.wait())
"""

# The trainer: on SIGUSR1 or SIGTERM it "saves" and exits with FAKE_EXIT_ON_SIGNAL. Copies of the
# signal may still be on their way (the script and srun both forward it). The recipe ignores repeats
# while it saves; this stand-in exits at once, and Python's exit would put back the default action,
# which a late copy of SIGUSR1 turns into a death by signal: hence SIG_IGN before it exits.
_TRAINER = """
import os, signal, sys, time
log = os.environ['FAKE_LOG']
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append('USR1'))
signal.signal(signal.SIGTERM, lambda *_: got.append('TERM'))
open(os.path.join(log, 'trainer.pid'), 'w').write(str(os.getpid()))
open(os.path.join(log, 'ready'), 'w').close()
if os.environ['FAKE_MODE'] == 'finish':
    sys.exit(0)
deadline = time.monotonic() + 20
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(log, 'signals'), 'w').write(','.join(got))
sys.exit(int(os.environ['FAKE_EXIT_ON_SIGNAL']) if got else 3)
"""


def _fake_bin(tmp_path: Path) -> Path:
    """Stand-ins for srun, scontrol and torchrun (Linux: srun reads /proc) that record what they do,
    and the trainer script the torchrun stand-in starts (`tmp_path / "trainer.py"`)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = f"#!{sys.executable}\n"
    for exe, text in (("scontrol", _SCONTROL), ("srun", python + _SRUN), ("torchrun", python + _TORCHRUN)):
        (bin_dir / exe).write_text(text)
        (bin_dir / exe).chmod(0o755)
    (tmp_path / "trainer.py").write_text(_TRAINER)
    return bin_dir


def test_torchrun_runs_the_command_it_prints(tmp_path: Path) -> None:
    bin_dir = _fake_bin(tmp_path)
    log = tmp_path / "log"
    log.mkdir()
    env = dict(
        PATH=f"{bin_dir}{os.pathsep}{_PATH}", FAKE_LOG=str(log), FAKE_MODE="finish",
        FAKE_TRAINER=str(tmp_path / "trainer.py"), FAKE_EXIT_ON_SIGNAL="0", NR_RUN_ID="run9",
    )
    printed = _words(_run(TORCHRUN_SH, "--dry-run", *TRICKY_OVERRIDES, **env).stdout)
    proc = _run(TORCHRUN_SH, *TRICKY_OVERRIDES, **env)
    assert proc.returncode == 0, proc.stderr
    ran = json.loads((log / "torchrun.json").read_text())
    assert ["NR_RUN_ID=" + ran["NR_RUN_ID"], "torchrun", *ran["argv"]] == printed


def test_torchrun_starts_nothing_when_the_overrides_do_not_compose(tmp_path: Path) -> None:
    bin_dir = _fake_bin(tmp_path)
    log = tmp_path / "log"
    log.mkdir()
    proc = _run(
        TORCHRUN_SH, "mesh=tp2_sp", "mesh.tp=two",
        PATH=f"{bin_dir}{os.pathsep}{_PATH}", FAKE_LOG=str(log), FAKE_MODE="finish",
        FAKE_TRAINER=str(tmp_path / "trainer.py"), FAKE_EXIT_ON_SIGNAL="0",
    )
    assert proc.returncode == 2 and "mesh.tp=two" in proc.stderr
    assert not (log / "torchrun.json").exists()


# ------------------------------------------------------------------------------------ slurm.sbatch
def _parse_slurm_dry_run(stdout: str) -> tuple[list[str], list[str], list[list[str]]]:
    lines = stdout.splitlines()
    exports = _words(lines[0])
    srun = _words(lines[1])
    prefix = "# node "
    nodes = [_words(line.split(" runs: ", 1)[1]) for line in lines[2:] if line.startswith(prefix)]
    assert len(lines) == 2 + len(nodes)
    return exports, srun, nodes


def test_slurm_dry_run_outside_slurm() -> None:
    proc = _run(SLURM_SBATCH, *TRICKY_OVERRIDES, DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    exports, srun, nodes = _parse_slurm_dry_run(proc.stdout)

    assert exports[0] == "export" and "NR_RUN_ID=dryrun" in exports and "RDZV_ID=dryrun" in exports
    assert srun[0] == "srun" and srun[srun.index("--nodes") + 1] == "2"
    script = srun[srun.index("-c") + 1]
    # Expanded on each node, not in the batch script.
    assert "$SLURM_NODEID" in script and 'trap "" USR1' in script
    after = srun[srun.index("-c") + 2:]
    assert after == [
        "launch/torchrun.sh", "checkpoint.resume=auto", "hydra.run.dir=outputs/slurm/dryrun", *TRICKY_OVERRIDES,
    ]
    assert "torchrun" in proc.stdout.splitlines()[1]

    assert len(nodes) == 2
    for rank, words in enumerate(nodes):
        assert words[:2] == ["NR_RUN_ID=dryrun", "torchrun"]
        assert "--standalone" not in words
        assert words[words.index("--rdzv-id") + 1] == "dryrun"
        assert words[words.index("--rdzv-conf") + 1] == f"is_host={'true' if rank == 0 else 'false'}"
        assert words[words.index("-m") + 1:] == [
            "recipes.finetune", "checkpoint.resume=auto", "hydra.run.dir=outputs/slurm/dryrun", *TRICKY_OVERRIDES,
        ]


def test_slurm_dry_run_inside_an_allocation(tmp_path: Path) -> None:
    bin_dir = _fake_bin(tmp_path)
    log = tmp_path / "log"
    log.mkdir()
    proc = _run(
        SLURM_SBATCH, "--dry-run", "mesh.tp=8",
        PATH=f"{bin_dir}{os.pathsep}{_PATH}", FAKE_LOG=str(log),
        SLURM_JOB_ID="4242", SLURM_NNODES="3", SLURM_JOB_NODELIST="gpu[01-03]", SLURM_CPUS_ON_NODE="96",
        CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7",
    )
    assert proc.returncode == 0, proc.stderr
    exports, srun, nodes = _parse_slurm_dry_run(proc.stdout)
    assert {"NR_RUN_ID=4242", "RDZV_ID=4242", "MASTER_ADDR=gpu01", "NNODES=3"} <= set(exports)
    assert srun[srun.index("--cpus-per-task") + 1] == "96"
    assert len(nodes) == 3
    assert all(words[words.index("--rdzv-endpoint") + 1] == "gpu01:29500" for words in nodes)
    assert all(words[words.index("--nproc-per-node") + 1] == "8" for words in nodes)
    assert not (log / "torchrun.json").exists()


def test_slurm_refuses_to_run_outside_slurm() -> None:
    proc = _run(SLURM_SBATCH, "mesh.tp=2")
    assert proc.returncode != 0
    assert "sbatch" in proc.stderr


@dataclass
class _Job:
    proc: subprocess.Popen[str]
    log: Path
    output: str = ""

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def read(self, name: str) -> str:
        return (self.log / name).read_text()

    def requeues(self) -> list[str]:
        path = self.log / "scontrol.log"
        lines = path.read_text().splitlines() if path.exists() else []
        return [line for line in lines if line.startswith("requeue")]


def _start_slurm_job(tmp_path: Path, mode: str, exit_on_signal: int) -> _Job:
    bin_dir = _fake_bin(tmp_path)
    log = tmp_path / "log"
    log.mkdir()
    env = _clean_env(
        PATH=f"{bin_dir}{os.pathsep}{_PATH}", FAKE_LOG=str(log), FAKE_MODE=mode,
        FAKE_TRAINER=str(tmp_path / "trainer.py"), FAKE_EXIT_ON_SIGNAL=str(exit_on_signal),
        SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu[01-02]", SLURM_SUBMIT_DIR=str(REPO),
        CUDA_VISIBLE_DEVICES="0,1",
    )
    proc = subprocess.Popen(
        ["bash", str(SLURM_SBATCH), "optim.lr=1e-3", "data.train_file=a b.jsonl"],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    return _Job(proc, log)


def _stop(job: _Job) -> None:
    for name, kill in (("trainer.pid", os.kill), ("step.pgid", os.killpg)):
        path = job.log / name
        if path.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                kill(int(path.read_text()), signal.SIGKILL)
    if job.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.proc.pid, signal.SIGKILL)
    job.proc.communicate()


# name: (trainer behaviour, signal sent to the batch script once the trainer runs, trainer's exit code)
_SCENARIOS = {
    "finish": ("finish", None, 0),
    "usr1": ("wait", signal.SIGUSR1, 0),
    "usr1_failed_save": ("wait", signal.SIGUSR1, 1),
    "term": ("wait", signal.SIGTERM, 0),
    # Some SLURM setups signal every process of the batch step (srun, a running `sleep`), not only the shell.
    "usr1_batch_step": ("wait", signal.SIGUSR1, 0),
}


@pytest.fixture(scope="module")
def slurm_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, _Job]:
    """Run every scenario at once: the script polls srun once a second, so one at a time is slow."""
    jobs: dict[str, _Job] = {}
    try:
        for name, (mode, _, exit_code) in _SCENARIOS.items():
            jobs[name] = _start_slurm_job(tmp_path_factory.mktemp(name), mode, exit_code)
        waiting = {name for name, (_, sig, _) in _SCENARIOS.items() if sig is not None}
        deadline = time.monotonic() + 30
        while waiting:
            for name in sorted(waiting):
                job = jobs[name]
                assert job.proc.poll() is None, f"{name}: ended before it was signalled"
                if (job.log / "ready").exists():
                    if name == "usr1_batch_step":
                        os.killpg(job.proc.pid, _SCENARIOS[name][1])
                    else:
                        os.kill(job.proc.pid, _SCENARIOS[name][1])
                    waiting.discard(name)
            assert time.monotonic() < deadline, f"trainers never started: {sorted(waiting)}"
            time.sleep(0.02)
        for job in jobs.values():
            job.output, _ = job.proc.communicate(timeout=30)
        return jobs
    finally:
        # Whatever the outcome, leave no stand-in processes behind.
        for job in jobs.values():
            _stop(job)


def test_slurm_job_that_finishes_is_not_requeued(slurm_jobs: dict[str, _Job]) -> None:
    job = slurm_jobs["finish"]
    assert job.returncode == 0, job.output
    assert job.requeues() == []
    started = json.loads(job.read("torchrun.json"))
    assert started["NR_RUN_ID"] == "4242" and started["NODE_RANK"] == "0"
    argv = started["argv"]
    assert argv[argv.index("-m"):] == [
        "-m", "recipes.finetune", "checkpoint.resume=auto", "hydra.run.dir=outputs/slurm/4242",
        "optim.lr=1e-3", "data.train_file=a b.jsonl",
    ]
    assert argv[argv.index("--rdzv-endpoint") + 1] == "gpu01:29500"
    assert argv[argv.index("--nproc-per-node") + 1] == "2"


def test_slurm_time_limit_signal_reaches_the_trainer_and_requeues(slurm_jobs: dict[str, _Job]) -> None:
    job = slurm_jobs["usr1"]
    assert job.returncode == 0, job.output
    assert job.read("signals") == "USR1"
    # The agent survived the signal that the trainer acted on.
    assert json.loads(job.read("torchrun.json"))["usr1_ignored"] is True
    assert job.requeues() == ["requeue 4242"]


def test_slurm_signal_to_the_whole_batch_step_still_requeues(slurm_jobs: dict[str, _Job]) -> None:
    job = slurm_jobs["usr1_batch_step"]
    assert job.returncode == 0, job.output
    assert job.read("signals").startswith("USR1")
    assert job.requeues() == ["requeue 4242"]


def test_slurm_failed_save_is_not_requeued(slurm_jobs: dict[str, _Job]) -> None:
    job = slurm_jobs["usr1_failed_save"]
    assert job.returncode == 1, job.output
    assert job.read("signals") == "USR1"
    assert job.requeues() == []


def test_slurm_sigterm_is_passed_on_but_never_requeues(slurm_jobs: dict[str, _Job]) -> None:
    job = slurm_jobs["term"]
    assert job.returncode == 0, job.output
    assert job.read("signals") == "TERM"
    assert job.requeues() == []


# ------------------------------------------------------------------------------------ submitit
def test_submitit_launcher_config_parses() -> None:
    cfg = OmegaConf.load(SUBMITIT_YAML)
    assert cfg._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert cfg.nodes == 1 and cfg.tasks_per_node == 1 and cfg.gpus_per_node == 1
    assert cfg.partition is None
    assert cfg.max_num_timeout > 0 and cfg.signal_delay_s > 0 and cfg.timeout_min > 0
    assert any("NR_RUN_ID" in line for line in OmegaConf.to_container(cfg.setup))


def _compose_hydra(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    import nemotron_recipe.config  # noqa: F401  (registers the nr_run_id resolver)

    with warnings.catch_warnings():
        # With the plugin installed, Hydra notes that this file shares its name with the plugin's schema.
        warnings.simplefilter("ignore", UserWarning)
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            return compose("finetune", overrides=overrides, return_hydra_config=True)


def test_submitit_launcher_only_when_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "submitit" not in str(_compose_hydra([]).hydra.launcher._target_)

    monkeypatch.setenv("NR_RUN_ID", "sweep3")
    launcher = _compose_hydra(["hydra/launcher=submitit_slurm", "hydra.launcher.partition=batch"]).hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.partition == "batch"
    assert OmegaConf.to_container(launcher.setup, resolve=True) == ["export NR_RUN_ID=sweep3"]


def test_submitit_plugin_accepts_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher.submitit_launcher")
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate

    monkeypatch.setenv("NR_RUN_ID", "sweep4")
    cfg = _compose_hydra(["hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=30"])
    hydra_config = HydraConfig.instance()
    previous = hydra_config.cfg
    hydra_config.set_config(cfg)  # the plugin reads the sweep settings from here
    try:
        launcher = instantiate(cfg.hydra.launcher)
    finally:
        hydra_config.cfg = previous
    assert type(launcher).__name__ == "SlurmLauncher"
    assert launcher.params["timeout_min"] == 30 and launcher.params["max_num_timeout"] > 0
    assert launcher.params["setup"] == ["export NR_RUN_ID=sweep4"]
    assert launcher.params["submitit_folder"].endswith("/sweep4/.submitit/%j")
