"""Runs the tests launch (recipes, torchrun, scripts) fail with a message that names the run and its log.

A test's `subprocess.run(..., timeout=...)` that runs out of time kills the launch's whole process
group (torchrun's workers too, not only torchrun) and fails the test with the command, its run
directory and a log file holding everything the run printed, never a bare `TimeoutExpired`
traceback that hides the run's own output.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
_ORIGINAL_RUN = subprocess.run


def _called_from_tests() -> bool:
    frame = sys._getframe(2)
    return Path(frame.f_code.co_filename).resolve().is_relative_to(TESTS)


def _text(data: bytes | str | None) -> str:
    if isinstance(data, bytes):
        return data.decode("utf-8", "replace")
    return data or ""


def _run_dir(args: list[str]) -> Path | None:
    for arg in args:
        for key in ("hydra.run.dir=", "run_dir="):
            if arg.startswith(key):
                return Path(arg.split("=", 1)[1])
    return None


def _write_log(args: list[str], cwd: str | os.PathLike | None, out: str, err: str) -> Path:
    """The run's output in its run directory (when it names one that exists), else in a temporary file."""
    run_dir = _run_dir(args)
    if run_dir is not None and not run_dir.is_absolute() and cwd is not None:
        run_dir = Path(cwd) / run_dir
    if run_dir is not None and run_dir.is_dir():
        log = run_dir / "output.log"
    else:
        fd, name = tempfile.mkstemp(prefix="test-run-", suffix=".log")
        os.close(fd)
        log = Path(name)
    log.write_text(f"$ {shlex.join(args)}\n--- stdout\n{out}\n--- stderr\n{err}\n")
    return log


def run_with_log(*popenargs, timeout=None, input=None, capture_output=False, check=False, **kwargs):
    """`subprocess.run`, but a timeout in a test fails it naming the run and its log (see the module)."""
    if timeout is None or not _called_from_tests() or "start_new_session" in kwargs or "preexec_fn" in kwargs:
        return _ORIGINAL_RUN(*popenargs, timeout=timeout, input=input, capture_output=capture_output, check=check,
                             **kwargs)
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    args = popenargs[0] if popenargs else kwargs["args"]
    words = [str(a) for a in ([args] if isinstance(args, (str, os.PathLike)) else args)]
    with subprocess.Popen(*popenargs, start_new_session=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launch and every process it started
            out, err = proc.communicate()
            log = _write_log(words, kwargs.get("cwd"), _text(out), _text(err))
            tail = "\n".join((_text(err) or _text(out)).splitlines()[-15:])
            run_dir = _run_dir(words)
            pytest.fail(f"the run `{shlex.join(words)[:300]}`{f' (run dir {run_dir})' if run_dir else ''} did "
                        f"not finish in {timeout:.0f} s and was killed; its output is in {log}. Last lines:\n{tail}",
                        pytrace=False)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        result.check_returncode()
    return result


subprocess.run = run_with_log
