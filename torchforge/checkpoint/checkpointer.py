"""The :class:`Checkpointer` (see :mod:`torchforge.checkpoint` for the layout)."""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import json
import logging
import os
import re
import shutil
import stat
import sys
import threading
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self

import torch

from torchforge.checkpoint import distributed, writer
from torchforge.checkpoint.digest import verify_files
from torchforge.checkpoint.distributed import after_commit
from torchforge.checkpoint.export import export_model
from torchforge.checkpoint.staging import Arena
from torchforge.checkpoint.state import (
    TensorTable,
    check_loader,
    check_optimizer,
    decode,
    encode,
    model_table,
    restore_model,
    restore_optimizer,
    strip_wrapper_names,
)
from torchforge.checkpoint.writer import FilePlan, crash_point, plan_group, write_files
from torchforge.errors import CheckpointError, TorchforgeError
from torchforge.formats.safetensors import fsync_dir, load_safetensors
from torchforge.sizes import parse_size

_log = logging.getLogger("torchforge.checkpoint")

# the Checkpointers with a background save: at interpreter exit each is waited for before the thread pools
# it writes with refuse work (threading's exit hooks run newest first, and concurrent.futures' was registered
# when it was imported, above); a script whose last line is save(..., blocking=False) lost that step
_saving: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def _finish_saves() -> None:
    for ck in list(_saving):
        try:
            ck.wait()
        except BaseException as e:  # noqa: BLE001 - at exit: said, not raised
            _log.error("the background save into %s failed at exit: %s", ck.root, e)
            print(f"torchforge: the background save into {ck.root} failed at exit: {e}", file=sys.stderr)


if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_finish_saves)
else:  # pragma: no cover - (every supported Python has it)
    atexit.register(_finish_saves)

__all__ = ["Checkpointer"]

_STEP = re.compile(r"step-(\d{8,})")
_FORMAT = "torchforge-checkpoint"
MANIFEST, STATE = "manifest.json", "state.json"
GROUPS = ("model", "optimizer", "extra")


class Checkpointer:
    """Saves and restores training state under ``root``, one folder per step.

    Args:
        root: the checkpoint folder (created if missing).
        keep_last: how many committed steps to keep (None or 0 keeps all).
        max_shard_size: the largest safetensors shard, ``"2GB"``/``"2GiB"`` style or bytes
            (:mod:`torchforge.sizes`).
        threads: parallel writer threads (default 8: with direct I/O each keeps one write in flight).
        direct_io: write large files with ``O_DIRECT`` (Linux; falls back to buffered writes where the
            filesystem refuses it). Faster on fast disks and it leaves the page cache to training, but the
            files are not in the page cache afterwards. False writes through the page cache.
        recycle: with ``keep_last`` and ``direct_io``, the large files of the step a save prunes are kept,
            hidden (``.trash-*``), and the next save writes over them instead of into new files: no
            deletion to wait for, and no block allocation (about 20% faster on ext4). The folder then
            holds ``keep_last + 1`` steps' worth of files between saves, as it does during any save;
            :meth:`close` (or the next Checkpointer on the folder) deletes them. A file with another hard
            link, or that any process still has open or mapped (a reader of the pruned step), is never
            written over: it is deleted, which leaves the reader its bytes. False deletes pruned steps
            at once.
        timeout: under torch.distributed, how long (seconds) a rank waits for the others' part of a save
            before it raises :class:`CheckpointError` (a rank that died mid-save never hangs the others).

    Under an initialized process group (gloo or nccl), ``save`` and ``restore`` are called on every rank
    and take the distributed path (:mod:`torchforge.checkpoint.distributed`): each rank writes its own
    slices, one rank commits, and a step restores at any world size, or in a plain process. ``root``
    must then be one folder every rank sees (a shared filesystem).
    """

    def __init__(self, root: str | os.PathLike, keep_last: int | None = 3, max_shard_size: int | str = "2GB",
                 *, threads: int | None = None, direct_io: bool = True, recycle: bool = True,
                 timeout: float = 600.0):
        self._setup(root, keep_last, max_shard_size, threads, direct_io, recycle, timeout, read_only=False)
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:  # a file in the way (FileExistsError, NotADirectoryError), no permission, ...
            raise CheckpointError(f"cannot make the checkpoint folder: {e.strerror}", path=e.filename or self.root
                                  ) from e
        self._clean_leftovers()

    @classmethod
    def reader(cls, root: str | os.PathLike) -> Checkpointer:
        """A Checkpointer that lists, inspects and verifies the steps under ``root`` and restores them, for
        tools that must change nothing (``torchforge inspect|verify``): unlike the constructor it creates no
        folder and cleans no leftovers of dead writers. It cannot save."""
        self = cls.__new__(cls)
        self._setup(root, None, "2GB", None, False, False, 600.0, read_only=True)
        if not os.path.isdir(self.root):
            raise CheckpointError("no checkpoint folder here", path=self.root)
        return self

    def _setup(self, root: str | os.PathLike, keep_last: int | None, max_shard_size: int | str,
               threads: int | None, direct_io: bool, recycle: bool, timeout: float, *, read_only: bool) -> None:
        """The attributes of a Checkpointer (the constructor's, and :meth:`reader`'s), touching no file."""
        self.root = os.path.abspath(os.fspath(root))
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 0):
            raise ValueError(f"keep_last={keep_last!r} must be None or an int >= 0")
        self.keep_last = keep_last or None
        self.max_shard_size = parse_size(max_shard_size, option="max_shard_size")
        self.direct_io = bool(direct_io)
        self.recycle = bool(recycle)
        self._read_only = read_only
        self._spare_dir: str | None = None  # the hidden folder of a pruned step whose files the next save reuses
        self.timeout = float(timeout)
        self._closed = False
        self.last_restore: dict[str, int] = {}  # bytes read and needed by the last distributed restore
        self._pool = ThreadPoolExecutor(threads or 8,
                                        thread_name_prefix="torchforge-ckpt")
        self._flusher = ThreadPoolExecutor(1, thread_name_prefix="torchforge-ckpt-flush")
        self._arena = Arena()
        # kept across distributed saves of one model (see checkpoint.distributed): the parameter-name
        # map of torch's state-dict functions, the save plan and this rank's file headers
        self._sd_info: tuple | None = None
        self._dist_plan: dict | None = None
        self._rank_files_cache: dict = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    # --- listing -------------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, ascending (folders being written or removed are not listed; none when the
        folder itself is gone)."""
        out = []
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        for name in names:
            m = _STEP.fullmatch(name)
            # (the name :meth:`path` gives the step, and no other: 'step-000000007' is not step 7's folder)
            if m and name == os.path.basename(self.path(int(m.group(1)))) and \
                    os.path.isdir(os.path.join(self.root, name)):
                out.append(int(m.group(1)))
        return sorted(out)

    def latest(self) -> int | None:
        """The most recently committed step, or None.

        After a rollback (a run restored from step 5 that saves step 6 again while a step 9 of the
        abandoned run still exists) that is the new save, not the highest step number: resuming goes on
        from where the run that saved last stopped. "Most recently" is the commit order each manifest
        records (``seq``: one more than the newest step's when it was committed), not a clock: a run
        resumed on a host whose clock is behind still finds its own saves latest.
        """
        s = self.committed()
        return s[-1] if s else None

    def committed(self) -> list[int]:
        """Committed steps in the order they were committed (the manifests' ``seq``)."""
        return sorted(self.steps(), key=lambda s: (self._commit_key(s), s))

    def _commit_key(self, step: int, strict: bool = False) -> tuple[int, int]:
        """Where ``step`` is in the commit order: ``(seq, commit time)``; a step saved before ``seq`` was
        recorded is ``(0, its commit time)`` (older than any with one), a damaged step (no manifest, or not
        JSON) ``(-1, 0)``: the oldest, pruned first (restore reports the damage). ``strict``: a manifest that
        exists but cannot be read now (EIO, EMFILE) raises OSError rather than counting as damaged, so
        pruning never guesses."""
        folder = self.path(step)
        try:
            with open(os.path.join(folder, MANIFEST), "rb") as f:
                doc = json.loads(f.read())
            seq, t = doc.get("seq"), doc.get("committed")
            if not isinstance(t, int):
                t = os.stat(folder).st_mtime_ns  # a step saved before commit times were recorded
            return (seq if isinstance(seq, int) and not isinstance(seq, bool) and seq > 0 else 0), t
        except OSError as e:
            if strict and not isinstance(e, FileNotFoundError):
                raise
            return -1, 0
        except (ValueError, AttributeError, RecursionError):  # RecursionError: JSON nested too deep
            return -1, 0

    def _next_seq(self) -> int:
        """The ``seq`` of a step committed now: one more than every committed step's."""
        return 1 + max((self._commit_key(s)[0] for s in self.steps()), default=0)

    def path(self, step: int) -> str:
        """The folder of ``step``."""
        return os.path.join(self.root, f"step-{int(step):08d}")

    # --- saving --------------------------------------------------------------------------------------
    def save(self, step: int, *, model: torch.nn.Module | None = None,
             optimizer: torch.optim.Optimizer | None = None, extra: Any = None,
             rank_state: Any = None, loader: Any = None, export_to: str | os.PathLike | None = None,
             blocking: bool = True) -> None:
        """Save a step (replacing an existing folder of the same step).

        Args:
            step: the step number (an int >= 0).
            model: its ``state_dict()`` tensors are saved; tied tensors once.
            optimizer: its ``state_dict()``: tensors in safetensors shards, the rest in ``state.json``.
            extra: any nesting of dicts, lists, tuples, numbers, strings, None and tensors. Under
                torch.distributed it is global state: rank 0's is saved.
            rank_state: under torch.distributed, this rank's own state (RNG states, counters; the same
                kinds of values as ``extra``), saved per rank; see :meth:`rank_state`.
            loader: a torchforge DataLoader whose ``state_dict()`` is saved (per rank under
                torch.distributed); ``restore(loader=...)`` resumes it.
            export_to: also write the committed step's model to this folder in Hugging Face layout
                (:meth:`export`, replacing the folder's previous export); under torch.distributed rank 0
                does it.
            blocking: False copies the state into CPU memory (pinned if CUDA is present), returns, and
                writes in a background thread; the model may change as soon as this returns. CPU tensors
                are copied before returning; GPU tensors are copied on a side stream that the current
                stream then waits for, so ``save`` returns without waiting for the GPU and kernels
                queued afterwards (the next optimizer step) run after the copies. At most one save is in
                flight: a second one waits for the first. ``wait()`` joins it.

        Raises:
            ValueError: ``step`` is not an int >= 0.
            CheckpointError: a previous non-blocking save failed, or the state cannot be stored (nothing
                of this step was committed). When the step was committed but something after it failed
                (the folder's fsync, the export, pruning older steps) the error has ``installed=True``
                and says so: the step is listed and restores.
        """
        if self._read_only:
            raise CheckpointError("this Checkpointer was opened with Checkpointer.reader(): it cannot save",
                                  path=self.root)
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step={step!r} must be an int >= 0")
        if export_to is not None:
            if model is None:
                raise CheckpointError("export_to= writes the step's model: pass model= too (nothing was saved)",
                                      path=os.fspath(export_to))
            self._check_export_folder(export_to)
        self.wait()
        if distributed.active():
            write = distributed.save_distributed(self, step, model, optimizer, extra, rank_state, loader,
                                                 blocking, export_to)
            if blocking:
                write()
            else:
                self._thread = threading.Thread(target=self._run_background, args=(write,),
                                                name=f"torchforge-ckpt-{step}", daemon=False)
                self._thread.start()
                _saving.add(self)
            return
        files, state = self._plan(step, model, optimizer, extra, rank_state,
                                  loader.state_dict() if loader is not None else None)
        staged = not blocking or any(t.device.type != "cpu" for f in files for _, t in f.parts)
        pending: list[Any] = []  # CUDA events of snapshot copies still running (non-blocking saves)
        if staged:
            pending = self._arena.stage(files, ordered=not blocking)
        else:
            for f in files:
                if not f.views:  # (a shard of no tensors still has its header to write)
                    f.bind()
        if blocking:
            self._write(step, files, state, export_to)
        else:
            self._thread = threading.Thread(target=self._background, args=(step, files, state, pending, export_to),
                                            name=f"torchforge-ckpt-{step}", daemon=False)
            self._thread.start()
            _saving.add(self)

    def wait(self, *, deletions: bool = False) -> None:
        """Block until the background save (if any) is committed; re-raise its error.

        Once it returns, nothing runs in the background on the checkpoint folder: pruned steps are
        deleted by the save itself, before it counts as done.

        Args:
            deletions: accepted for compatibility (deletions are never left running).
        """
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None
        err, self._error = self._error, None
        if err is not None:
            if isinstance(err, TorchforgeError):
                raise err
            raise CheckpointError(f"background save failed: {err!r}", path=self.root) from err

    def _run_background(self, write: Any) -> None:
        try:
            write()
        except BaseException as e:  # noqa: BLE001 - kept for wait()/the next save(), which re-raise it
            self._error = e

    def _background(self, step: int, files: list[FilePlan], state: dict, pending: list[Any],
                    export_to: Any = None) -> None:
        try:
            for event in pending:  # GPU snapshot copies (stream-ordered) must land before the write
                event.synchronize()
            self._write(step, files, state, export_to)
        except BaseException as e:  # noqa: BLE001 - kept for wait()/the next save(), which re-raise it
            self._error = e

    def _plan(self, step: int, model: Any, optimizer: Any, extra: Any, rank_state: Any = None,
              loader_state: Any = None) -> tuple[list[FilePlan], dict]:
        tables = {g: TensorTable() for g in GROUPS}
        state: dict[str, Any] = {"format": _FORMAT, "version": 1, "step": step}
        if model is not None:
            tables["model"] = model_table(model)
            state["model"] = {"aliases": tables["model"].aliases}
        if optimizer is not None:
            state["optimizer"] = encode(optimizer.state_dict(), "", tables["optimizer"])
        state["extra"] = encode(extra, "", tables["extra"])
        if rank_state is not None:
            state["rank_state"] = encode(rank_state, "__rank_state__", tables["extra"])
        if loader_state is not None:
            state["loader"] = encode(loader_state, "__loader__", tables["extra"])
        files: list[FilePlan] = []
        for g in GROUPS:
            present = bool(tables[g].tensors) if g == "extra" else g in state
            if not present:
                continue
            tensors = tables[g].tensors
            if any(t.device.type == "cpu" and not t.is_contiguous() for t in tensors.values()):
                tensors = tables[g].cpu_contiguous()
            shards, index = plan_group(g, tensors, self.max_shard_size)
            files += shards + [FilePlan.of_bytes(f"{g}.safetensors.index.json", index)]
        files.append(FilePlan.of_bytes(STATE, json.dumps(state, indent=1).encode() + b"\n"))
        return files, state

    def _write(self, step: int, files: list[FilePlan], state: dict, export_to: Any = None) -> None:
        tmp = os.path.join(self.root, distributed.tmp_name(step))
        try:
            os.mkdir(tmp)
            crash_point("tmp-created")
            seq, key = self._next_seq(), (0, 0)

            def manifest(entries: dict[str, Any]) -> FilePlan:
                nonlocal key
                key = (seq, time.time_ns())  # (what _prune knows of the step without reading it back)
                m = {"format": _FORMAT, "version": 1, "step": step, "committed": key[1], "seq": seq,
                     "checksum": "blake2b128-of-4KiB-page-sum64, 64MiB blocks", "files": entries}
                return FilePlan.of_bytes(MANIFEST, json.dumps(m, indent=1).encode() + b"\n")

            write_files(tmp, files, self._pool, self._flusher, then=manifest, direct=self.direct_io,
                        spares=self._spares())
            fsync_dir(tmp)
            final = self.path(step)
            crash_point("before-rename")
            self._install(tmp, final)
            crash_point("after-rename")
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)  # (after an exchange, the step saved before under that number)
            if isinstance(e, OSError):
                raise CheckpointError(f"writing step {step} failed, nothing was committed: {e}",
                                      path=getattr(e, "filename", None) or tmp) from e
            raise
        for f in files:  # drop references to tensors and the arena
            f.views, f.parts = [], []
        failed = None
        if export_to is not None and "model" in state:
            try:
                self._export(step, export_to, self.max_shard_size, overwrite=True)
            except (TorchforgeError, OSError) as e:  # the step is committed: prune as after any commit
                failed = after_commit(f"step {step} was committed, but its export failed: {e}",
                                      getattr(e, "path", None) or str(export_to), e)
        try:
            self._prune(step, key, recycle=self.recycle and self.direct_io)
        except CheckpointError as e:
            if failed is not None:
                e.__context__ = failed  # (shown with the traceback: both failures)
            raise
        if failed is not None:
            raise failed

    def _spares(self) -> list[str]:
        """The files of the step pruned last, largest first (see ``recycle``)."""
        if self._spare_dir is None:
            return []
        sized = []
        try:
            for entry in os.scandir(self._spare_dir):
                if entry.is_file(follow_symlinks=False):
                    sized.append((entry.stat().st_size, entry.path))
        except OSError:  # deleted meanwhile (another Checkpointer opened on the folder cleans leftovers)
            return []
        return [p for _, p in sorted(sized)]  # popped from the end: the largest first

    def _drop_spares(self) -> None:
        if self._spare_dir is not None:
            shutil.rmtree(self._spare_dir, ignore_errors=True)
            self._spare_dir = None

    def _install(self, tmp: str, final: str) -> None:
        """Move a written step folder into place. Re-saving a step swaps the two folders in one atomic
        rename (Linux ``renameat2(RENAME_EXCHANGE)``), so the step is the old one or the new one whatever
        moment a crash hits; then the old one is deleted. Where the exchange is not available the old
        folder is first renamed to ``.old-<step>-…``, which the next Checkpointer puts back if the new one
        never arrived."""
        with self._lock:
            if not os.path.exists(final):
                os.rename(tmp, final)
                self._sync_installed(final)
                return
            if exchange_paths(tmp, final):
                self._sync_installed(final)
                crash_point("old-step-hidden")
                shutil.rmtree(tmp, ignore_errors=True)
                return
            old = os.path.join(self.root, f".old-{os.path.basename(final)}-{uuid.uuid4().hex[:8]}")
            os.rename(final, old)
            crash_point("old-step-hidden")
            try:
                os.rename(tmp, final)
            except BaseException:
                os.rename(old, final)  # the committed step comes back at once, not at the next open
                raise
            try:
                self._sync_installed(final)
            finally:  # (as after an exchange: the step saved before under that number goes either way)
                shutil.rmtree(old, ignore_errors=True)

    def _sync_installed(self, final: str) -> None:
        """fsync the root after ``final`` was renamed into place; a failure is a CheckpointError with
        ``installed`` set: the step is visible (and restores), but may not survive a crash."""
        try:
            fsync_dir(self.root)
        except OSError as e:
            raise after_commit(f"{os.path.basename(final)} is in place, but the checkpoint folder could not be "
                               f"fsynced ({e}): it may not survive a crash; save it again", self.root, e) from e

    def _prune(self, step: int, key: tuple[int, int], recycle: bool = False) -> None:
        """Delete all but the ``keep_last`` most recently committed steps (by commit, not step number: a
        run rolled back to an earlier step keeps its new saves), before the save returns; with
        ``recycle`` the first one's files are kept hidden for the next save to write over. Never
        ``step``, the one just committed (``key``: its ``(seq, commit time)`` as its manifest says), nor a
        step committed after it, nor a step whose manifest cannot be read now (kept, not counted, a warning
        logged) rather than making it look oldest."""
        if not self.keep_last:
            return
        try:
            others = [s for s in self.steps() if s != step]
            if len(others) < self.keep_last:
                return
            keys = {step: key}  # (as written: its manifest may not be readable now)
            for s in others:
                try:
                    keys[s] = self._commit_key(s, strict=True)
                except OSError as e:  # kept, and not counted: what cannot be read is never deleted
                    _log.warning("not pruning step %d: its manifest cannot be read (%s)", s, e)
            order = sorted(keys, key=lambda s: (keys[s], s))
            kept = set(order[-self.keep_last:]) | {step}
            # (never a step committed after this one: another job saving into the same folder keeps its own)
            for s in [s for s in order if s not in kept and (keys[s], s) < (keys[step], step)]:
                self._discard(self.path(s), recycle)
                recycle = False
        except OSError as e:
            raise after_commit(f"step {step} was committed, but pruning the steps before it failed: {e}",
                               getattr(e, "filename", None) or self.root, e) from e

    def _discard(self, folder: str, recycle: bool = False) -> None:
        """Make a step invisible at once (rename), then delete its files, or with ``recycle`` keep them as
        the next save's spares (the spares kept before, if any are left, are deleted)."""
        if os.path.islink(folder):  # a step folder linked in from elsewhere: the link goes, never what it names
            os.unlink(folder)
            fsync_dir(self.root)
            return
        trash = os.path.join(self.root, f".trash-{os.path.basename(folder)}-{uuid.uuid4().hex[:8]}")
        os.rename(folder, trash)
        kept = False
        try:
            fsync_dir(self.root)
            crash_point("old-step-hidden")
            if recycle:  # these replace the spares kept before (a step pruned with others keeps them)
                self._drop_spares()
                kept = self._keep_spares(trash)
        finally:
            if kept:
                self._spare_dir = trash
            else:  # (also when something failed: a hidden step is never left behind)
                shutil.rmtree(trash, ignore_errors=True)

    @staticmethod
    def _keep_spares(trash: str) -> bool:
        """Delete the files of a pruned step that no save would write over (those written without
        O_DIRECT, and any with another hard link); whether any is left."""
        kept = False
        for entry in os.scandir(trash):
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_size >= writer.DIRECT_MIN:
                kept = True
            elif entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        return kept

    def _clean_leftovers(self) -> None:
        host = distributed.host_name()
        for name in os.listdir(self.root):
            m = re.fullmatch(r"\.old-(step-\d{8,})-[0-9a-f]+", name)
            if m:  # a re-save interrupted between its two renames: the old step comes back if the new is absent
                final = os.path.join(self.root, m.group(1))
                if os.path.exists(final):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
                else:
                    os.rename(os.path.join(self.root, name), final)
                continue
            # .tmp-step-<step>-h<host>-p<pid>-<nonce>: this host's saves whose process is gone; another host's
            # (a node on a shared filesystem, or this machine's previous container: another PID namespace)
            # only once nothing in it changed for an hour (and twice the timeout), so that a save in progress
            # is never touched
            m = re.fullmatch(r"\.tmp-step-\d+-h(\w+)-p(\d+)-[0-9a-f]+(\.busy)?", name)
            dead = m is not None and (not distributed.pid_alive(int(m.group(2))) if m.group(1) == host
                                      else _idle_for(os.path.join(self.root, name)) > max(3600.0, 2 * self.timeout))
            if name.startswith(".trash-") or dead:
                if m and m.group(3):  # (a distributed save's marker: a file)
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.root, name))
                else:
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    # --- checking ------------------------------------------------------------------------------------
    def manifest(self, step: int) -> dict[str, Any]:
        """The parsed manifest of a committed step.

        Raises:
            CheckpointError: the step does not exist or its manifest is unreadable.
        """
        folder = self.path(step)
        if not os.path.isdir(folder):
            raise CheckpointError(f"no checkpoint for step {step}; committed steps: {self.steps()}",
                                  path=folder)
        p = os.path.join(folder, MANIFEST)
        try:
            with open(p, "rb") as f:
                m = json.loads(f.read())
            if not isinstance(m, dict) or m.get("format") != _FORMAT or not isinstance(m.get("files"), dict):
                raise ValueError("not a torchforge checkpoint manifest")
            for name, e in m["files"].items():
                if "/" in name or "\\" in name or "\x00" in name or name.startswith(".") or not isinstance(e, dict) or not (
                        type(e.get("size")) is int and e["size"] >= 0 and isinstance(e.get("digests"), list)):
                    raise ValueError(f"bad entry {name!r}: names must be plain file names with a size of 0 or "
                                     "more bytes and digests")
            return m
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep
            raise CheckpointError(f"unreadable manifest: {e}", path=p) from None

    def verify(self, step: int) -> None:
        """Re-check the size and block digests of every file of ``step``.

        Raises:
            CheckpointError: naming the missing or damaged file and the offset of the damaged block.
        """
        self.wait()
        verify_files(self.path(step), self.manifest(step)["files"], checksums=True, pool=self._pool)

    # --- restoring -----------------------------------------------------------------------------------
    def restore(self, step: int | None = None, *, model: torch.nn.Module | None = None,
                optimizer: torch.optim.Optimizer | None = None, loader: Any = None,
                map_location: str | torch.device = "cpu", verify: bool = False) -> Any:
        """Load a step into existing objects and return its ``extra``.

        Tensors are read through mmap and copied once, straight into the model's parameters and buffers
        and the optimizer's state tensors (allocated on the parameter's device when missing).

        Args:
            step: the step (default: the latest).
            model: copied into in place; keys, shapes and ties must match exactly, under canonical names
                (``torch.compile``'s ``_orig_mod`` and DDP's or DataParallel's ``module`` dropped: a compiled,
                wrapped or bare model restores any of their steps); a dtype may change in precision only
                (float32 into bfloat16, not a float into an int). Extra state, state-dict hooks, load hooks
                and lazy modules restore through the model's ``load_state_dict``.
            optimizer: its param groups and state are replaced by the stored ones.
            loader: a torchforge DataLoader saved with ``save(loader=...)``: resumed at the exact next
                batch. A step saved by N ranks and restored by M != N ranks remaps the loader state through
                its elastic resume (a ``GlobalSampler``), or raises CheckpointError where it cannot.
            map_location: where tensors inside ``extra`` are placed.
            verify: also re-check every checksum first (reads every byte once more); sizes, safetensors
                headers and the checksums of the step's small JSON files are always checked.

        Raises:
            CheckpointError: no such step, missing or damaged files, or state that does not fit.
        """
        step = self._resolve(step)
        folder = self.path(step)
        manifest = self.manifest(step)
        files = manifest["files"]
        verify_files(folder, files, checksums=verify, pool=self._pool)
        if not verify:  # the small JSON files restore trusts (state.json, indexes): their checksums, always
            verify_files(folder, {n: e for n, e in files.items() if n.endswith(".json")}, pool=self._pool)
        if manifest.get("version") == distributed.VERSION:
            try:
                return distributed.restore_distributed(self, step, folder, manifest, model, optimizer, loader,
                                                       map_location)
            except OSError as e:
                raise CheckpointError(f"step {step} cannot be read: {e.strerror}",
                                      path=e.filename or folder) from e
        state = self._state(folder, step)
        where = os.path.join(folder, STATE)
        try:
            # everything is read and decoded first: a damaged part is an error before any object changed
            if model is not None:
                if "model" not in state:
                    raise CheckpointError(f"step {step} holds no model state", path=where)
                names, get_model = self._group(folder, "model", files)
            if optimizer is not None:
                if "optimizer" not in state:
                    raise CheckpointError(f"step {step} holds no optimizer state", path=where)
                _, get = self._group(folder, "optimizer", files)
                saved = _decode(state["optimizer"], get, where)
                if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict)
                        and all(isinstance(e, dict) for e in saved["state"].values())):
                    raise CheckpointError(f"{STATE} is damaged: the optimizer state is not a dict of dicts",
                                          path=where)
                check_optimizer(optimizer, saved, folder)  # before the model changes: all or nothing
            tensor = self._extra_tensors(folder, files, map_location)
            if loader is not None:
                if state.get("loader") is None:
                    raise CheckpointError(f"step {step} holds no DataLoader state (save with loader=)", path=where)
                loader_state = _decode(state["loader"], tensor, where)
                check_loader(loader, loader_state, step, where)  # before the model changes: all or nothing
            extra = _decode(state["extra"], tensor, where)
            if model is not None:  # (the first copy: it checks the aliases and keys before copying anything)
                restore_model(model, get_model, names, state["model"]["aliases"], folder)
            if optimizer is not None:
                restore_optimizer(optimizer, saved, folder)
            if loader is not None:
                loader.load_state_dict(loader_state)
            return extra
        except TorchforgeError as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"step {step} is damaged: {e.reason}", path=e.path, offset=e.offset) from e
        except OSError as e:
            raise CheckpointError(f"step {step} cannot be read: {e.strerror}",
                                  path=e.filename or folder) from e

    def export(self, step: int | None, folder: str | os.PathLike, *, max_shard_size: int | str | None = None,
               overwrite: bool = False) -> str:
        """Write ``step``'s model (default: the latest step) as Hugging Face safetensors shards.

        ``folder`` gets ``model-0000k-of-0000N.safetensors`` and ``model.safetensors.index.json`` (whole
        tensors under their canonical names, tied parameters once), written atomically: see
        :mod:`torchforge.checkpoint.export`. Add the model's ``config.json`` and ``transformers`` loads it.

        Args:
            step: the step (None: the latest).
            folder: the output folder (must not exist unless ``overwrite``).
            max_shard_size: the largest output shard (default: this Checkpointer's ``max_shard_size``).
            overwrite: replace an existing ``folder``.

        Returns:
            The folder's absolute path.
        """
        step = self._resolve(step)
        self._check_export_folder(folder)
        limit = self.max_shard_size if max_shard_size is None else parse_size(max_shard_size,
                                                                             option="max_shard_size")
        return self._export(step, folder, limit, overwrite)

    def _check_export_folder(self, folder: str | os.PathLike) -> None:
        """An export replaces its folder: never the checkpoint folder, one holding it, a step or a folder of
        the Checkpointer's own (a plain sub-folder of the checkpoint folder, such as ``hf``, is fine)."""
        f, r = os.path.realpath(os.fspath(folder)), os.path.realpath(self.root)
        first = os.path.relpath(f, r).split(os.sep)[0] if f.startswith(r + os.sep) else ""
        if f == r or r.startswith(f + os.sep) or _STEP.fullmatch(first) or first.startswith("."):
            raise CheckpointError(f"cannot export into {os.fspath(folder)!r}: it is, holds or lies inside the "
                                  f"checkpoint folder {self.root} or one of its steps, which the export would "
                                  "replace; export to a folder of its own", path=os.fspath(folder))

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed (close(), or the end of its with block): make a "
                                  "new one to save or restore", path=self.root)

    def _export(self, step: int, folder: str | os.PathLike, limit: int, overwrite: bool) -> str:
        """:meth:`export` of a committed step, without waiting for a save in flight (it runs inside one)."""
        src = self.path(step)
        manifest = self.manifest(step)
        with distributed.damaged(f"step {step}", f"step {step}'s manifest", os.path.join(src, MANIFEST)):
            if manifest.get("version") == distributed.VERSION:
                names, get = distributed.model_tensors(src, manifest)
            else:
                if "model" not in self._state(src, step):
                    raise CheckpointError(f"step {step} holds no model state", path=os.path.join(src, STATE))
                stored, read = self._group(src, "model", manifest["files"])
                # (a step saved before names were canonical may carry a compiled or wrapped model's names)
                plain = strip_wrapper_names(stored)
                if len(set(plain.values())) != len(plain):
                    plain = {n: n for n in stored}
                original = {v: k for k, v in plain.items()}
                names = {}
                for n in stored:
                    t = read(n)
                    names[plain[n]] = (list(t.shape), t.dtype)

                def get(name: str) -> torch.Tensor:
                    return read(original[name])
            return export_model(names, get, os.fspath(folder), limit, self._pool, overwrite=overwrite)

    @property
    def staging_buffer(self) -> torch.Tensor | None:
        """The CPU buffer snapshots are staged in (page-locked when CUDA is present), None before the first
        staged save. It is reused save after save and freed by :meth:`close`."""
        return self._arena.buf

    def _resolve(self, step: int | None) -> int:
        """``step``, or the latest committed one, after any save in flight."""
        self._check_open()
        self.wait()
        if step is None:
            step = self.latest()
            if step is None:
                raise CheckpointError("no checkpoint: no step is committed", path=self.root)
        return step

    def _extra_tensors(self, folder: str, files: Any, map_location: Any) -> Any:
        if "extra.safetensors.index.json" in files:
            _, get = self._group(folder, "extra", files)
            made: dict[str, torch.Tensor] = {}

            def tensor(k: str) -> torch.Tensor:  # one tensor per stored name: names saved as one stay one
                t = made.get(k)
                if t is None:
                    t = made[k] = get(k).to(map_location, copy=True)
                return t

            return tensor
        return lambda k: _missing(k, folder)

    def rank_state(self, step: int | None = None, *, map_location: str | torch.device = "cpu") -> Any:
        """The ``rank_state`` this rank saved in ``step`` (default: the latest).

        Raises:
            CheckpointError: none was saved, or the step was saved at another world size (per-rank state
                cannot be remapped to other ranks).
        """
        step = self._resolve(step)
        folder = self.path(step)
        manifest = self.manifest(step)
        rank, world = distributed.rank_and_world()
        if manifest.get("version") == distributed.VERSION:
            return distributed.rank_state(folder, manifest, rank, world, map_location)
        if world != 1:
            raise CheckpointError(f"step {step} was saved by a single process; its rank_state cannot be given to "
                                  f"rank {rank} of {world}", path=folder)
        state = self._state(folder, step)
        if "rank_state" not in state:
            raise CheckpointError(f"step {step} holds no rank_state", path=os.path.join(folder, STATE))
        return _decode(state["rank_state"], self._extra_tensors(folder, manifest["files"], map_location),
                       os.path.join(folder, STATE))

    def _state(self, folder: str, step: int) -> dict[str, Any]:
        """The step's ``state.json``, checked for the structure ``restore`` relies on.

        Raises:
            CheckpointError: naming ``state.json`` when it is unreadable or not the state of ``step``.
        """
        state = self._json(folder, STATE)
        problem = _state_problem(state, step)
        if problem:
            raise CheckpointError(f"{STATE} is damaged: {problem}", path=os.path.join(folder, STATE))
        return state

    def _json(self, folder: str, name: str) -> Any:
        p = os.path.join(folder, name)
        try:
            with open(p, "rb") as f:
                return json.loads(f.read())
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep
            raise CheckpointError(f"unreadable {name}: {e}", path=p) from None

    def _group(self, folder: str, group: str, listed: Any) -> tuple[list[str], Any]:
        index = self._json(folder, f"{group}.safetensors.index.json")
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not (isinstance(wmap, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items())):
            raise CheckpointError("the index is damaged: no 'weight_map' of tensor names to file names",
                                  path=os.path.join(folder, f"{group}.safetensors.index.json"))
        opened: dict[str, Any] = {}
        for fname in sorted(set(wmap.values())):
            if fname not in listed:
                raise CheckpointError(f"index names {fname!r}, which is not in the manifest",
                                      path=os.path.join(folder, f"{group}.safetensors.index.json"))
            opened[fname] = load_safetensors(os.path.join(folder, fname))
        def get(name: str) -> torch.Tensor:
            fname = wmap.get(name)
            if fname is None or name not in opened[fname]:
                raise CheckpointError(f"tensor {name!r} is not in the {group} shards",
                                      path=os.path.join(folder, fname or f"{group}.safetensors.index.json"))
            return opened[fname][name]

        return list(wmap), get

    def close(self) -> None:
        """Wait for a background save and deletions, free the staging memory and stop the threads."""
        try:
            self.wait(deletions=True)
        finally:
            self._closed = True
            self._drop_spares()
            self._arena = Arena()
            self._sd_info = None  # the distributed save's parameter-name map (it holds the parameters)
            self._pool.shutdown(wait=True)
            self._flusher.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _state_problem(state: Any, step: int) -> str | None:
    """What is wrong with a parsed ``state.json`` of ``step`` (None when it has the expected structure)."""
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not a JSON object"
    head = {k: state.get(k) for k in ("format", "version", "step")}
    if head != {"format": _FORMAT, "version": 1, "step": step}:
        return f"{head} where {{'format': {_FORMAT!r}, 'version': 1, 'step': {step}}} was expected"
    if "extra" not in state:
        return "no 'extra' entry"
    if "model" in state:
        aliases = state["model"].get("aliases") if isinstance(state["model"], dict) else None
        if not (isinstance(aliases, dict) and all(isinstance(v, str) for v in aliases.values())):
            return "'model' has no 'aliases' dict of names"
    if "optimizer" in state:
        opt = state["optimizer"]
        groups = opt.get("param_groups") if isinstance(opt, dict) else None
        if not (isinstance(groups, list) and "state" in opt
                and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)):
            return "'optimizer' has no 'state' and 'param_groups' list of groups with 'params'"
    return None


def _decode(value: Any, tensor: Any, where: str) -> Any:
    """:func:`decode`, with a malformed tagged value reported as a damaged ``state.json``."""
    try:
        return decode(value, tensor)
    except TorchforgeError:  # a damaged tensor file: its own error names it (and the offset)
        raise
    except (TypeError, ValueError, AttributeError, KeyError, RecursionError) as e:
        raise CheckpointError(f"{STATE} is damaged: cannot decode {e!r}", path=where) from e


def _missing(name: str, folder: str) -> torch.Tensor:
    raise CheckpointError(f"state.json refers to tensor {name!r} but the step has no extra shards",
                          path=folder)


_RENAME_EXCHANGE = 2


def _renameat2() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or a C library without it
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2_fn = _renameat2()
_AT_FDCWD = -100


def _idle_for(path: str) -> float:
    """Seconds since anything in ``path`` (a file, or a folder and its files) last changed; 0 if unknown."""
    try:
        newest = os.stat(path).st_mtime
        if os.path.isdir(path):
            for entry in os.scandir(path):
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    except OSError:
        return 0.0
    return time.time() - newest


def exchange_paths(a: str, b: str) -> bool:
    """Swap two paths atomically; False where the system or filesystem cannot."""
    if _renameat2_fn is None:
        return False
    if _renameat2_fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)
