"""Training checkpoints: sharded save, exact resume on any mesh, crash-safe publication.

Layout under `checkpoint.dir` (default `<run_dir>/checkpoints`):

    step_000010/
        .metadata, __<rank>_0.distcp   torch.distributed.checkpoint (DCP): model, optimizer, RNG
        meta.json                       step, world size, mesh, model config, LR schedule, data,
                                        and the size and CRC-32 of every other file

Every rank writes its own shards into `step_000010.tmp-<id>/`. Once all ranks are done, rank 0
writes meta.json and renames the directory to its final name. Readers trust only a final name
holding meta.json, so a run killed mid-save leaves the previous checkpoint as the newest complete
one, and the partial directory is removed at the next successful save. A checkpoint is verified
against meta.json's checksums before it is loaded or exported, so a damaged file is named instead of
loading silently; `resume=auto` then falls back to the newest checkpoint that verifies.

Model and optimizer go through `get_state_dict`/`set_state_dict`: tensors are keyed by parameter
names that do not depend on the mesh (activation-checkpoint wrappers are stripped, optimizer state
is keyed by those names rather than by parameter position) and stored as pieces of the global
tensors, so DCP reshards them onto whatever mesh loads them, a single process included. The data
position is the step alone: the batch plan is a pure function of it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import errno
import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from nemotron_recipe.models.nemotron_v3 import CheckpointError, NemotronHConfig

log = logging.getLogger(__name__)

META = "meta.json"
FORMAT_VERSION = 1
TMP_MARK = ".tmp-"
# `step_N`, or `step_N-<lineage>` when another lineage already holds `step_N` (a branch).
_FINAL_NAME = re.compile(r"^step_(\d+)(?:-[0-9a-f]{12})?$")
LOCK = ".lock"
# Between creating a lock and writing its record a run takes microseconds; an unreadable lock younger
# than this may be one being written.
_LOCK_WRITE_GRACE_S = 2.0
# The lineage of checkpoints written before lineages were recorded: they count as one of their own.
LEGACY_LINEAGE = "unrecorded"
# Adam's two moments in fp32 per parameter element, on top of the parameters themselves.
OPTIMIZER_BYTES_PER_ELEMENT = 8
# Flattened optimizer state names each hyperparameter per parameter name, so the layout of the
# param groups on the saving side never has to match the loading side's.
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# A LoRA run saves and loads its adapters (and buffers) only: the frozen base comes from model.pretrained
# or the seed, and meta.json's `peft.base` says which. Its optimizer's param groups are the same on every
# mesh (adapters only), so they are saved once per group rather than once per tensor, which for many
# small adapters would be most of the checkpoint.
ADAPTER_STATE_DICT_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)

# "STEP:SECONDS": sleep that long after the shards of step STEP are written and before they are
# published, so a test can kill a run in the one window where a checkpoint is half done.
PUBLISH_DELAY_ENV = "NR_CHECKPOINT_PUBLISH_DELAY"

T = TypeVar("T")


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def _step_of(path: Path) -> int:
    return int(_FINAL_NAME.match(path.name).group(1))


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every published checkpoint under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = _FINAL_NAME.match(path.name)
        if m and path.is_dir() and (path / META).is_file():
            found.append((int(m.group(1)), path))
    return sorted(found)


def lineage_of(path: Path) -> str:
    """The lineage recorded in `path`'s meta.json; an unreadable one counts as unrecorded (verification
    names the damage when that checkpoint is chosen)."""
    try:
        return json.loads((path / META).read_text()).get("lineage") or LEGACY_LINEAGE
    except (OSError, ValueError, AttributeError):
        return LEGACY_LINEAGE


def checkpoints_by_lineage(root: Path) -> dict[str, list[Path]]:
    """The published checkpoints under `root` grouped by lineage, each group oldest step first, and the
    groups ordered by when each last saved (the newest lineage last). Recency is meta.json's write
    time, not the step: a branch from an older checkpoint has lower steps than the run it left."""
    groups: dict[str, list[Path]] = {}
    for _, path in complete_checkpoints(root):
        groups.setdefault(lineage_of(path), []).append(path)

    def last_write(paths: list[Path]) -> int:
        return max((p / META).stat().st_mtime_ns for p in paths)

    return dict(sorted(groups.items(), key=lambda item: last_write(item[1])))


# ---------------------------------------------------------------------------------------- lock
def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _read_lock(lock: Path) -> dict[str, Any]:
    try:
        holder = json.loads(lock.read_text())
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def _lock_holder(lock: Path) -> dict[str, Any] | None:
    """The run recorded in `lock`, or None when it records none (garbage, cut short, emptied). A lock
    created this instant may not hold its record yet, so a young unreadable one is read again."""
    deadline = time.monotonic() + _LOCK_WRITE_GRACE_S
    while True:
        holder = _read_lock(lock)
        if "host" in holder and "pid" in holder:
            return holder
        try:
            young = time.time() - lock.stat().st_mtime < _LOCK_WRITE_GRACE_S
        except OSError:
            young = False
        if not young or time.monotonic() > deadline:
            return None
        time.sleep(0.1)


def acquire_lock(root: Path) -> Path:
    """Creates `root/.lock` (host, pid, start time) so that no second run writes into `root` while this
    one does: two runs would delete each other's saves. A lock of a dead process on this host is taken
    over with a warning, and so is one that names no run (unreadable); any other existing lock is refused,
    naming its holder. Also the first proof
    that `root` is writable, before any heavy work."""
    lock = root / LOCK
    mine = {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        root.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _lock_holder(lock)
                if holder is None:
                    log.warning("checkpoint.dir %s: the lock file %s names no run (its content cannot be read); "
                                "taking it over as stale", root, lock)
                    lock.unlink(missing_ok=True)
                    continue
                stale = holder.get("host") == mine["host"] and isinstance(holder.get("pid"), int) \
                    and not _process_alive(holder["pid"])
                if not stale:
                    raise CheckpointError(
                        f"checkpoint.dir={str(root)!r} is in use by another run (lock {lock}: host "
                        f"{holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {holder.get('started', '?')}); "
                        "two runs writing into one directory delete each other's checkpoints. Fix: wait for that run "
                        "or give this one another checkpoint.dir; if no run uses the directory any more, delete the lock."
                    ) from None
                log.warning("checkpoint.dir %s: taking over the lock of pid %s on %s, which is no longer running",
                            root, holder["pid"], holder["host"])
                lock.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(mine, f)
            return lock
    except OSError as e:
        raise CheckpointError(
            f"checkpoint.dir={str(root)!r} is not writable ({e.strerror or e}). Fix: make it writable or set "
            "checkpoint.dir to a directory this run may write to."
        ) from None
    raise CheckpointError(f"{lock}: another run took the lock while this one was taking over a stale one.")


def release_lock(lock: Path) -> None:
    """Removes `lock` if this process holds it; never another run's."""
    if _read_lock(lock).get("pid") == os.getpid() and _read_lock(lock).get("host") == socket.gethostname():
        lock.unlink(missing_ok=True)


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory itself, or the newest complete one inside `path` or `path/checkpoints`:
    the highest step of the lineage that saved last, as `resume=auto` picks it (a branch from an
    older checkpoint has lower steps than the run it left)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"{p}: does not exist. Fix: point at a `step_N` checkpoint directory or its parent.")
    if (p / META).is_file():
        return p
    lineages = checkpoints_by_lineage(p) or checkpoints_by_lineage(p / "checkpoints")
    if lineages:
        newest = list(lineages.values())[-1][-1]
        if len(lineages) > 1:
            log.info("%s holds %d lineages; taking %s, the newest checkpoint of the one that saved last",
                     p, len(lineages), newest.name)
        return newest
    raise CheckpointError(
        f"{p}: not a complete checkpoint (a `step_N` directory holding {META}; a `{TMP_MARK}` directory is "
        "an interrupted save) and no directory inside holds one."
    )


def read_meta(path: Path) -> dict[str, Any]:
    file = path / META
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {META}, so not a complete checkpoint.") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: unreadable ({e}).") from None
    missing = [k for k in ("format", "step", "world_size", "model", "scheduler") if k not in meta]
    if missing:
        raise CheckpointError(f"{file}: lacks {missing}; not written by this recipe or damaged.")
    if meta["format"] != FORMAT_VERSION:
        raise CheckpointError(f"{file}: format {meta['format']}, this code reads format {FORMAT_VERSION}.")
    return meta


def file_checksums(path: Path) -> dict[str, dict[str, int]]:
    """Size and CRC-32 of every file of the checkpoint directory `path` but meta.json."""
    sums = {}
    for file in sorted(path.iterdir()):
        if file.name == META or not file.is_file():
            continue
        crc = 0
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                crc = zlib.crc32(chunk, crc)
        sums[file.name] = {"size": file.stat().st_size, "crc32": crc}
    return sums


def verify_checksums(path: Path, meta: dict[str, Any]) -> None:
    """Every file meta.json lists is there with its size and checksum; raises naming the first that is
    not. Checkpoints written before checksums were recorded pass unchecked."""
    listed = meta.get("files")
    if listed is None:
        return
    for name, want in listed.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: missing file {name}; the checkpoint is damaged.")
        if file.stat().st_size != want["size"]:
            raise CheckpointError(
                f"{path}: file {name} holds {file.stat().st_size} bytes, meta.json recorded {want['size']}; "
                "the checkpoint is damaged."
            )
    got = file_checksums(path)
    for name, want in listed.items():
        if got[name]["crc32"] != want["crc32"]:
            raise CheckpointError(
                f"{path}: file {name} does not match its checksum in meta.json; the checkpoint is damaged "
                "(resume an earlier checkpoint)."
            )


def _as_json(values: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(values))


def check_model_config(path: Path, meta: dict[str, Any], model_config: NemotronHConfig) -> None:
    """Refuse a checkpoint of another model before any tensor is read. A field added to the model config
    after the checkpoint was saved counts as its default (the only value models had then); the dtypes of
    the weight files a model came from are not part of what it is."""
    defaults = {f.name: f.default for f in dataclasses.fields(NemotronHConfig) if f.default is not dataclasses.MISSING}
    # Both sides as meta.json holds them (tuples as lists), so that only values are compared.
    saved = {k: v for k, v in _as_json({**defaults, **meta["model"]}).items() if k != "weight_dtypes"}
    ours = {k: v for k, v in _as_json(dataclasses.asdict(model_config)).items() if k != "weight_dtypes"}
    diffs = {k: (saved.get(k), v) for k, v in ours.items() if saved.get(k) != v}
    diffs |= {k: (saved[k], None) for k in saved.keys() - ours.keys()}
    if diffs:
        listed = ", ".join(f"{k}: {a!r} in the checkpoint, {b!r} in this run" for k, (a, b) in sorted(diffs.items()))
        raise CheckpointError(
            f"{path}: saved for another model ({listed}). Fix: resume with the model settings it was saved "
            "with, or train afresh with checkpoint.resume=none and a checkpoint.dir of its own."
        )


# The group of rank 0 alone while it reads a checkpoint for the others (`rank0_reads`).
_RANK0_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar("rank0_group", default=None)


@contextlib.contextmanager
def rank0_reads() -> Iterator[None]:
    """Called on every rank around work in which rank 0 alone reads a checkpoint (`load_here`): opens
    the group of rank 0 alone for it (creating a group takes every rank of the default group)."""
    group = dist.new_group([0]) if dist.is_initialized() and dist.get_world_size() > 1 else None
    token = _RANK0_GROUP.set(group)
    try:
        yield
    finally:
        _RANK0_GROUP.reset(token)


def load_here(state: dict[str, Any], path: Path) -> None:
    """`dcp.load` of `state` from `path` by this process alone. DCP then wants a process group of this
    process only: the default group when its world is this process, rank 0's own group inside
    `rank0_reads`, else one opened for the read (DCP's mode without any group warns that it assumes one)."""
    group = _RANK0_GROUP.get()
    if group is not None or (dist.is_initialized() and dist.get_world_size() == 1):
        dcp.load(state, checkpoint_id=str(path), process_group=group)
        return
    if dist.is_initialized():  # a rank of a larger world outside `rank0_reads`
        raise RuntimeError("load_here: a rank of a larger world reads a checkpoint alone only inside rank0_reads")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dcp.load(state, checkpoint_id=str(path))
    finally:
        dist.destroy_process_group()


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's index of the checkpoint, after checking that every data file it names is there in full."""
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path}: missing file .metadata (the DCP index); the checkpoint is damaged.")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any unreadable index is the same problem
        raise CheckpointError(f"{path}: unreadable .metadata ({type(e).__name__}: {e}).") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(name for name in needed if not (path / name).is_file())
    if missing:
        raise CheckpointError(f"{path}: missing file(s) {missing}; the checkpoint is damaged.")
    short = sorted(name for name, size in needed.items() if (path / name).stat().st_size < size)
    if short:
        raise CheckpointError(f"{path}: truncated file(s) {short}; the checkpoint is damaged.")
    return metadata


def check_tensors(path: Path, metadata: Metadata, state: dict[str, dict[str, Any]]) -> None:
    """Every tensor `state` expects is in the checkpoint with its global shape (DTensors report theirs)."""
    saved = metadata.state_dict_metadata
    missing, bad = [], []
    for top, part in state.items():
        for name, value in part.items():
            if not isinstance(value, torch.Tensor):
                continue
            key = f"{top}.{name}"
            if key not in saved:
                missing.append(key)
            elif isinstance(saved[key], TensorStorageMetadata) and tuple(saved[key].size) != tuple(value.shape):
                bad.append((key, tuple(saved[key].size), tuple(value.shape)))
    if bad:
        raise CheckpointError(
            f"{path}: tensor shapes differ from the model's (name, checkpoint, model): {bad[:6]}"
            f"{' ...' if len(bad) > 6 else ''}"
        )
    if missing:
        raise CheckpointError(f"{path}: missing tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}")


def _describe_base(base: dict[str, Any]) -> str:
    return base.get("pretrained") or f"preset {base.get('preset')} drawn from seed {base.get('seed')}"


def _rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Make a directory invisible to readers at once (rename), then delete it."""
    doomed = path.with_name(f"{path.name}{TMP_MARK}removing-{uuid.uuid4().hex[:8]}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


class Checkpointer:
    """Finds, loads and writes this run's checkpoints; every method is called on every rank.

    Decisions that read the file system (which checkpoint to resume, where to write) are taken on
    rank 0 and broadcast, so all ranks act on the same answer, or raise the same error.
    """

    def __init__(
        self,
        cfg: Any,
        run_dir: Path,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        mesh_shape: dict[str, int],
        model_config: NemotronHConfig,
    ) -> None:
        c = cfg.checkpoint
        self.root = Path(c.dir).expanduser() if c.dir else run_dir / "checkpoints"
        self.every, self.keep = c.every, c.keep
        self.max_steps = cfg.trainer.max_steps
        # An export reads the final checkpoint, so asking for one implies saving it.
        self.save_final = c.save_final or c.export_hf
        self.rank, self.world_size, self.device = rank, world_size, device
        peft = getattr(cfg, "peft", None)
        self.adapters_only = peft is not None and peft.method != "none"
        self.options = ADAPTER_STATE_DICT_OPTIONS if self.adapters_only else STATE_DICT_OPTIONS
        self.base_meta = {
            "format": FORMAT_VERSION,
            "world_size": world_size,
            "mesh": mesh_shape,
            "model": dataclasses.asdict(model_config),
            "tokenizer": str(Path(cfg.data.tokenizer).expanduser().resolve()),
            # What decides the examples of each step; a resume with other values warns.
            "data": {
                **{k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k != "val_max_batches"},
                "seed": cfg.seed,
                "global_batch_size": cfg.trainer.global_batch_size,
                "seq_len": cfg.trainer.seq_len,
            },
            "run_dir": str(run_dir),
        }
        self.lock: Path | None = None  # rank 0's, while it holds checkpoint.dir
        self._skipped: list[Path] = []  # damaged checkpoints resume=auto passed over
        found, self.run_id, self.lineage = self.on_rank0(lambda: self._start(c.resume, model_config))
        self.base_meta |= {"run_id": self.run_id, "lineage": self.lineage}
        self.resume_from: Path | None = None if found is None else Path(found[0])
        self.resume_meta: dict[str, Any] | None = None if found is None else found[1]
        self.last_saved: Path | None = None

    def release(self) -> None:
        """Gives up checkpoint.dir's lock (rank 0; a no-op elsewhere and when called again)."""
        if self.lock is not None:
            release_lock(self.lock)
            self.lock = None

    def _start(self, resume: str, model_config: NemotronHConfig) -> tuple[Any, str, str]:
        """Rank 0: takes checkpoint.dir's lock, then chooses the checkpoint to resume and this run's id
        and lineage. The lock is given up again if any of that fails."""
        self.lock = acquire_lock(self.root)
        try:
            found = self._find_resume(resume, model_config)
            run_id = uuid.uuid4().hex[:12]
            return found, run_id, self._lineage_after(found, run_id)
        except BaseException:
            self.release()
            raise

    def _lineage_after(self, found: tuple[str, dict[str, Any]] | None, run_id: str) -> str:
        """The lineage this run's checkpoints belong to. Resuming the newest checkpoint of a lineage
        continues it (its `keep` then rotates that lineage's checkpoints); a fresh start, a checkpoint
        written before lineages were recorded, or one with newer checkpoints of its lineage beside it
        (a branch) starts a lineage named after this run, so its saves never prune the other's."""
        if found is None or not found[1].get("lineage"):
            return run_id
        path, meta = Path(found[0]), found[1]
        group = checkpoints_by_lineage(self.root).get(meta["lineage"], [])
        newer = [q.name for q in group if q not in self._skipped and _step_of(q) > meta["step"]]
        if newer:
            log.info("resuming %s, an older checkpoint of its lineage (newer: %s): this run starts lineage %s",
                     path.name, ", ".join(newer), run_id)
            return run_id
        return meta["lineage"]

    # ------------------------------------------------------------------ coordination
    def on_rank0(self, fn: Callable[[], T]) -> T:
        """Run `fn` on rank 0 and hand its result, or its failure, to every rank.

        Public so that work on this run's checkpoints done elsewhere (an export) is coordinated the
        same way: `fn`'s result must be picklable, and a failure reaches every rank as a CheckpointError.
        """
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", fn())
            except CheckpointError as e:
                box[0] = ("error", str(e))
            except Exception as e:  # noqa: BLE001 - the other ranks must not wait forever for rank 0
                box[0] = ("error", f"{self.root}: {type(e).__name__}: {e}")
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise CheckpointError(value)
        return value

    def _find_resume(self, resume: str, model_config: NemotronHConfig) -> tuple[str, dict[str, Any]] | None:
        existing = complete_checkpoints(self.root)
        if resume == "none":
            if existing:
                raise CheckpointError(
                    f"checkpoint.dir={str(self.root)!r} already holds checkpoints "
                    f"({', '.join(p.name for _, p in existing)}); checkpoint.resume=none would mix new ones in. "
                    "Fix: checkpoint.resume=auto to continue from the newest, or another checkpoint.dir / run_dir."
                )
            return None
        if resume == "auto":
            if not existing:
                return None
            lineages = checkpoints_by_lineage(self.root)
            path, meta = self._newest_intact([p for group in lineages.values() for p in group], model_config)
            log.info("resume=auto: %s of lineage %s (%d lineage(s) in %s; the newest saved last)",
                     path.name, meta.get("lineage", LEGACY_LINEAGE), len(lineages), self.root)
        else:
            path = find_checkpoint(resume)
            meta = self._verified(path, model_config)
        if meta["step"] >= self.max_steps:
            raise CheckpointError(
                f"{path}: saved at step {meta['step']}, and trainer.max_steps={self.max_steps} leaves no step to "
                f"train (a resumed run continues up to trainer.max_steps). Fix: set trainer.max_steps above "
                f"{meta['step']} to train further, or start afresh with checkpoint.resume=none and a new checkpoint.dir."
            )
        return str(path), meta

    @staticmethod
    def _verified(path: Path, model_config: NemotronHConfig) -> dict[str, Any]:
        """`path`'s meta after checking that it is this model's and that every file is intact."""
        meta = read_meta(path)
        check_model_config(path, meta, model_config)
        read_dcp_metadata(path)
        verify_checksums(path, meta)
        return meta

    def _newest_intact(self, paths: list[Path], model_config: NemotronHConfig) -> tuple[Path, dict[str, Any]]:
        """The last of `paths` (newest lineage last, each oldest step first) that verifies; each damaged one skipped is named in a
        warning. A checkpoint of another model stops the search: that is a settings mistake."""
        damaged = []
        for path in reversed(paths):
            try:
                return path, self._verified(path, model_config)
            except CheckpointError as e:
                if "saved for another model" in str(e):
                    raise
                log.warning("resume=auto: skipping %s: %s", path.name, e)
                self._skipped.append(path)
                damaged.append(str(e))
        raise CheckpointError(
            f"checkpoint.dir={str(self.root)!r}: no intact checkpoint to resume: " + " | ".join(damaged)
            + " Fix: checkpoint.resume=none with another checkpoint.dir to start afresh."
        )

    # ------------------------------------------------------------------ load
    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> int:
        """Restore model, optimizer, schedule and (same world size) RNG; returns the step to continue from."""
        if self.resume_from is None:
            return 0
        path, meta = self.resume_from, self.resume_meta
        assert meta is not None
        metadata = read_dcp_metadata(path)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=self.options)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        check_tensors(path, metadata, state)

        rng = {}
        if meta["world_size"] == self.world_size:
            saved = metadata.state_dict_metadata
            rng = {k: v.clone() for k, v in _rng_states(self.device).items() if f"rng.rank_{self.rank}.{k}" in saved}
            state["rng"] = {f"rank_{self.rank}": rng}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's own type is not an Exception
            raise CheckpointError(f"{path}: loading failed: {type(e).__name__}: {e}") from None
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=self.options)
        scheduler.load_state_dict(meta["scheduler"])
        if "cpu" in rng:
            torch.set_rng_state(rng["cpu"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], self.device)

        if meta.get("data") != self.base_meta["data"]:
            log.warning(
                "checkpoint %s was trained on other data settings (%s, now %s): the examples after step %d "
                "differ from an uninterrupted run's", path, meta.get("data"), self.base_meta["data"], meta["step"],
            )
        log.info(
            "resumed from %s: step %d (saved by %d rank(s), mesh %s%s)", path, meta["step"], meta["world_size"],
            meta.get("mesh"), "" if rng else "; RNG not restored: another world size",
        )
        return int(meta["step"])

    def check_peft(self, record: dict[str, Any] | None) -> None:
        """Records this run's `peft` (None: full fine-tuning) for its saves, and refuses a resumed
        checkpoint of another kind or one whose adapters were trained on another base."""
        self.base_meta["peft"] = record
        if self.resume_meta is None:
            return
        path, saved = self.resume_from, self.resume_meta.get("peft")
        if (saved is None) != (record is None):
            kind = "a LoRA" if saved else "a full fine-tuning"
            fix = "peft=lora with its settings" if saved else "peft=none"
            raise CheckpointError(f"{path}: {kind} checkpoint, and this run is {'full fine-tuning' if saved else 'LoRA'}. "
                                  f"Fix: resume it with {fix}, or start afresh in another checkpoint.dir.")
        if saved is None:
            return
        if saved["base"]["hash"] != record["base"]["hash"]:
            raise CheckpointError(
                f"{path}: its adapters were trained on another base ({_describe_base(saved['base'])}, hash "
                f"{saved['base']['hash']}); this run's base is {_describe_base(record['base'])}, hash "
                f"{record['base']['hash']}. Fix: resume with the base it was trained on."
            )
        diffs = [k for k in ("rank", "alpha", "dropout", "adapted") if saved.get(k) != record.get(k)]
        if diffs:
            raise CheckpointError(f"{path}: saved with other LoRA settings ({', '.join(diffs)} differ: "
                                  f"{[saved.get(k) for k in diffs]}). Fix: resume with the settings it was saved with.")

    # ------------------------------------------------------------------ disk
    def check_space(self, model: torch.nn.Module) -> None:
        """Before the first step: refuses a checkpoint.dir without room for one more checkpoint, so a
        full disk is found now and not at a save hours later. The estimate is conservative: every
        parameter at its size plus Adam's two fp32 moments, as if one rank wrote it all."""
        params = [p for p in model.parameters() if p.requires_grad or not self.adapters_only]
        self.checkpoint_bytes = sum(p.numel() * (p.element_size() + OPTIMIZER_BYTES_PER_ELEMENT) for p in params)
        self.on_rank0(self._check_space)

    def _check_space(self) -> None:
        self._remove_leftovers()  # killed saves' leftovers (the lock says no other run writes them)
        free = shutil.disk_usage(self.root).free
        if free < self.checkpoint_bytes:
            raise CheckpointError(
                f"checkpoint.dir={str(self.root)!r}: no space left for a checkpoint: about "
                f"{_size(self.checkpoint_bytes)} needed, {_size(free)} free. Fix: free space there or set "
                "checkpoint.dir to a larger disk (a lower checkpoint.keep frees old checkpoints of this lineage)."
            )

    def _disk_full_error(self, error: BaseException, tmp: Path) -> CheckpointError | None:
        """A CheckpointError saying "no space left" with the sizes if `error` is a full disk (DCP wraps the
        writer's OSError, or reports it as a failed write), else None."""
        seen, todo = [], [error]
        while todo:
            e = todo.pop()
            if e is None or any(e is s for s in seen):
                continue
            seen.append(e)
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                break
            # CheckpointException.failures maps each failed rank to (exception, traceback).
            failures = getattr(e, "failures", None) or {}
            todo += [e.__cause__, e.__context__, *(f[0] if isinstance(f, tuple) else f for f in failures.values())]
        else:
            text = " ".join(str(e) for e in seen)
            if not any(k in text for k in ("No space left", "ENOSPC", "unexpected pos")):
                return None
        free = shutil.disk_usage(self.root).free
        return CheckpointError(
            f"{tmp}: no space left on the device while saving (about {_size(getattr(self, 'checkpoint_bytes', 0))} "
            f"per checkpoint, {_size(free)} free now); the earlier checkpoints are intact. Fix: free space in "
            f"{self.root} or set checkpoint.dir to a larger disk, then resume."
        )

    # ------------------------------------------------------------------ save
    def due(self, step: int, max_steps: int) -> bool:
        return (self.every > 0 and step % self.every == 0) or (self.save_final and step == max_steps)

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> Path:
        began = time.perf_counter()
        # Rank 0 names the save: every rank must write its shards into the same directory.
        name, tmp_name = self.on_rank0(lambda: self._save_names(step))
        tmp = self.root / tmp_name
        model_sd, optim_sd = get_state_dict(model, optimizer, options=self.options)
        state = {
            "model": model_sd,
            "optim": optim_sd,
            # Per-rank keys: every rank's generator state is kept, not just rank 0's.
            "rng": {f"rank_{self.rank}": _rng_states(self.device)},
        }
        try:
            dcp.save(state, checkpoint_id=str(tmp))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's own type is not an Exception
            full = self._disk_full_error(e, tmp)
            if full is None:
                raise
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise full from None
        spec = os.environ.get(PUBLISH_DELAY_ENV)
        if spec and int(spec.split(":")[0]) == step:
            time.sleep(float(spec.split(":")[1]))
        dist.barrier()
        meta = {
            **self.base_meta,
            "step": step,
            # The checkpoint this one continues from: this run's previous save, or the one it resumed.
            "parent": None if (parent := self.last_saved or self.resume_from) is None else str(parent),
            "scheduler": scheduler.state_dict(),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        final = self.root / name
        self.on_rank0(lambda: self._publish(tmp, final, meta))
        dist.barrier()
        self.last_saved = final
        log.info("checkpoint %s written in %.1f s", final, time.perf_counter() - began)
        return final

    def _save_names(self, step: int) -> tuple[str, str]:
        name = self._final_name(step)
        return name, f"{name}{TMP_MARK}{uuid.uuid4().hex[:12]}"

    def _final_name(self, step: int) -> str:
        """Rank 0: the directory name of this run's checkpoint of `step`, after removing the `.tmp`
        leftovers of killed saves (the lock guarantees that no other run is writing them). A step that
        another lineage already saved gets the lineage as a suffix, so neither branch replaces the other."""
        self._remove_leftovers()
        name = step_name(step)
        taken = self.root / name
        if taken.is_dir() and (taken / META).is_file() and lineage_of(taken) != self.lineage:
            return f"{name}-{self.lineage}"
        return name

    def _remove_leftovers(self) -> None:
        for leftover in self.root.iterdir():
            if TMP_MARK in leftover.name and leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)

    def _publish(self, tmp: Path, final: Path, meta: dict[str, Any]) -> None:
        # Every rank's shards are complete (barrier): rank 0 records their checksums for readers.
        meta = {**meta, "files": file_checksums(tmp)}
        with open(tmp / META, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # the same step saved again (e.g. re-running from an earlier checkpoint)
            _remove(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        if self.keep > 0:  # only this lineage's: another run's checkpoints are not ours to rotate
            for old in checkpoints_by_lineage(self.root).get(self.lineage, [])[:-self.keep]:
                _remove(old)
        self._remove_leftovers()
