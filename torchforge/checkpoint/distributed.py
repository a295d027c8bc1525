"""Checkpoints under torch.distributed: every rank writes its own shards, one commit, restore at any world size.

Saving (``Checkpointer.save`` on every rank of an initialized process group, gloo or nccl):

1. The state is taken in torch's canonical form (``torch.distributed.checkpoint.state_dict``): parameter
   names without DDP's ``module.`` prefix, optimizer state keyed by parameter name. Every tensor is
   either a ``DTensor`` (FSDP2 / tensor parallel: this rank holds one slice of it) or a plain tensor,
   which under a process group is taken as replicated (DDP: every rank holds the same values).
2. A plan, made identically on every rank from one ``all_gather_object``: each rank writes its slices
   of DTensors; replicated tensors are written once, spread over the ranks largest first onto the rank
   with the fewest bytes so far, and a replicated tensor larger than a rank's fair share is cut into
   row ranges so that no rank writes much more than the mean. ``extra`` (global state) is rank 0's.
   A rank that cannot take its state (a value that cannot be stored) says so in the plan's collective,
   and every rank raises at once; one whose snapshot fails after the plan leaves its error file for
   the others (below).
3. Each rank writes its safetensors files (checksummed, fsynced) into the step's temporary folder
   ``.tmp-step-<step>-h<host>-p<pid of rank 0>-<nonce>`` (host and pid: a node never deletes another
   node's save in progress on a shared filesystem), then its ``rank-<k>.json`` (its slices, its files'
   digests and its per-rank state), atomically.
4. Rank 0 waits for every rank's JSON (or a rank's error file, or the timeout), writes
   ``manifest.json`` last (JSON only: every tensor's global shape and dtype and which file and byte
   range holds which slice; every file's size and block digests), fsyncs, renames the folder into
   place and fsyncs the root. The other ranks return once rank 0 is done with the step (committed,
   older steps pruned, the export written): until then ``<temporary folder>.busy`` is beside it, and
   an error after the commit is written into it for every rank to raise. A step is complete or
   absent; a rank that dies mid-save leaves the previous steps intact, and the others raise
   :class:`~torchforge.errors.CheckpointError` within the timeout instead of hanging.

Restoring (any world size, or a plain process with no process group): every rank reads the manifest,
works out the slice of every tensor it holds (the whole tensor for a plain one, its local slice for a
DTensor) and copies from each saved slice only the overlap, through mmap views of the files: a rank
reads the bytes it needs and no others (rows of row-major slices; ``Checkpointer.last_restore`` counts
them). Per-rank state (``rank_state=``) comes back at the same world size only; a DataLoader's state is
remapped through its elastic resume at another world size when every rank's state says the same global
position (a ``GlobalSampler``), and anything that cannot be remapped raises ``CheckpointError``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import re
import shutil
import time
import uuid
import weakref
import zlib
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from torchforge._proc import host_name, pid_alive
from torchforge.checkpoint.digest import BlockDigest
from torchforge.checkpoint.state import (
    TensorTable,
    canonical_keys,
    check_fits,
    check_group_sizes,
    check_loader,
    check_materialized,
    decode,
    encode,
    memory_key,
    same_bits,
    tied_apart,
    torch_dtype,
    unique_name,
)
from torchforge.checkpoint.writer import (
    FilePlan,
    crash_point,
    file_plan,
    split_by_size,
    write_files,
)
from torchforge.errors import CheckpointError, TorchforgeError
from torchforge.formats.safetensors import fsync_dir, load_safetensors, write_all

__all__ = ["active", "rank_and_world", "restore_distributed", "save_distributed"]

FORMAT = "torchforge-checkpoint"
VERSION = 2  # the distributed layout (version 1: single-process)
_POLL = (0.002, 0.05)  # first and longest sleep while waiting for other ranks' files


def active() -> bool:
    """Whether a process group is initialized (saves then take the distributed path)."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if active() else (0, 1)


def tmp_name(step: int, pid: int | None = None, host: str | None = None, nonce: str | None = None) -> str:
    """A step's temporary folder name: it carries the host and pid of the process that owns it."""
    return f".tmp-step-{step:08d}-h{host or host_name()}-p{pid or os.getpid()}-{nonce or uuid.uuid4().hex[:8]}"


# --- the state as items ------------------------------------------------------------------------------
class _Items(TensorTable):
    """A TensorTable that keeps DTensors as they are. ``ties`` (the model's state keys -> the group of
    names one parameter or buffer has: tied weights, an embedding shared with the LM head) stores each
    group once, its later names referring to the first, as the single-process save stores them. The
    groups come from the module tree, the same on every rank (a rank's local shard of a tied weight may
    be empty, and its memory tells nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ties: dict[str, int] = {}
        self._first: dict[int, str] = {}

    def add(self, name: str, t: torch.Tensor) -> str:
        group = self.ties.get(name.removeprefix("model.")) if name.startswith("model.") else None
        if group is not None and group in self._first:
            return self._first[group]
        name = unique_name(name, self.tensors)  # (two values of one dotted name each keep theirs)
        self.tensors[name] = t.detach() if t.requires_grad else t  # a DTensor's detach costs a dispatch
        if group is not None:
            self._first[group] = name
        return name


def _tie_groups(model: torch.nn.Module | None) -> dict[str, int]:
    """State key (canonical: no wrapper attributes) -> group id, for the parameters and buffers that the
    model holds under more than one name."""
    if model is None:
        return {}
    names: dict[int, list[str]] = {}
    for name, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                   model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(name)
    tied = [group for group in names.values() if len(group) > 1]
    if not tied:
        return {}
    canon = canonical_keys(model, [n for group in tied for n in group])
    return {canon[n]: g for g, group in enumerate(tied) for n in group}


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


_regions: dict[Any, tuple[Any, Any]] = {}


def _local_region(t: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """(local tensor, global offsets, local sizes) of what this rank holds of ``t``."""
    if _is_dtensor(t):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = t.to_local()
        key = (tuple(t.shape), t.device_mesh, tuple(t.placements))
        found = _regions.get(key)
        if found is None:  # the same for every tensor of one shape and layout (all the layers of a stack)
            found = _regions[key] = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        shape, offsets = found
        if tuple(local.shape) != tuple(shape):  # uneven shards are padded by some placements
            local = local[tuple(slice(0, s) for s in shape)]
        return local, list(offsets), list(shape)
    return t, [0] * t.dim(), list(t.shape)


def _replicated_everywhere(t: torch.Tensor) -> bool:
    if not _is_dtensor(t):
        return True
    from torch.distributed.tensor import Replicate

    return all(isinstance(p, Replicate) for p in t.placements)


def _writes_its_replica(name: str, t: torch.Tensor) -> bool:
    """Whether this rank writes its slice of ``t``: a DTensor sharded on some mesh dims and replicated on
    others (HSDP's 2D mesh) has each slice on every rank along the replicated dims, and one of them writes
    it: the one at coordinate ``crc32(name) % size`` of each such dim, so the tensors spread over the
    replicas."""
    if not _is_dtensor(t):
        return True
    from torch.distributed.tensor import Replicate

    dims = [d for d, p in enumerate(t.placements) if isinstance(p, Replicate)]
    if not dims:  # (FSDP2 on a 1D mesh: every slice is one rank's)
        return True
    mesh, coord = t.device_mesh, t.device_mesh.get_coordinate()
    if coord is None:  # not in the mesh: holds nothing
        return False
    pick = zlib.crc32(name.encode())
    return all(coord[d] == pick % mesh.size(d) for d in dims)


def _model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def _optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer)


def _canonical_state(ck: Any, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None
                     ) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
    """``get_model_state_dict(model)`` and ``get_optimizer_state_dict(model, optimizer)``: the same
    values, but the map of parameters to names that both begin by building (torch's ``_verify_options``,
    about 0.6 ms each for a few hundred tensors) is built once and kept on the Checkpointer while the
    model holds the same parameter and buffer objects under the same names. An FSDP1 model, or a torch
    whose helpers differ, goes through the public functions every time."""
    if model is None:
        return None, None
    fresh = optimizer is not None and not any(optimizer.state.get(p) for g in optimizer.param_groups
                                              for p in g["params"])
    info = _state_dict_info(ck, model)
    if info is None:  # another torch: the public functions
        model_state, optim_state = _model_state(model), _optimizer_state(model, optimizer) if optimizer else None
    else:
        from torch.distributed.checkpoint import state_dict as sd

        with sd._gc_context():
            model_state = sd._get_model_state_dict(model, info)
            sd._verify_state_dict(model_state, {}, info)
            optim_state = None
            if optimizer is not None:
                oinfo = dataclasses.replace(info, handle_model=False, handle_optim=True)
                optim_state = sd._get_optim_state_dict(model, (optimizer,), oinfo)
                sd._verify_state_dict({}, optim_state, oinfo)
    if fresh:
        # torch fills a never-stepped optimizer's state by stepping it with lr 0 (_init_optim_state): AdamW's
        # step counts became 1, and the training after a step-0 save changed. The optimizer is put back as
        # it was, and saved as it was: no state (restored, it has none, as after load_state_dict)
        optimizer.state.clear()
        optim_state["state"] = {}
    return model_state, optim_state


def _state_dict_info(ck: Any, model: torch.nn.Module) -> Any:
    """torch's ``_StateDictInfo`` for ``model`` (kept on ``ck``, see :func:`_canonical_state`), or None
    where this torch's private helpers are missing or take other arguments."""
    try:
        from torch.distributed.checkpoint import state_dict as sd

        for helper in ("_get_model_state_dict", "_get_optim_state_dict", "_gc_context", "_verify_state_dict"):
            getattr(sd, helper)
        verify = sd._verify_options
    except (ImportError, AttributeError):
        return None
    key = ([(name, id(p)) for name, p in model.named_parameters(remove_duplicate=False)],
           [(name, id(b)) for name, b in model.named_buffers(remove_duplicate=False)])
    cached = ck._sd_info
    if cached is not None and cached[0]() is model and cached[1] == key:
        return cached[2]
    ck._sd_info = None
    try:
        info = verify(model, (), optim_only=False)
    except TypeError:  # another torch's signature
        return None
    if not info.fsdp_modules:  # FSDP1 modules would keep the model alive through the cache
        # The info holds the parameters (so their ids stay theirs); dropped when the model dies.
        ck._sd_info = (weakref.ref(model, functools.partial(_forget_info, weakref.ref(ck))), key, info)
    return info


def _forget_info(ck_ref: Any, _model_ref: Any) -> None:
    ck = ck_ref()
    if ck is not None:
        ck._sd_info = None


def after_commit(reason: str, path: str, cause: BaseException) -> CheckpointError:
    """The error of something that failed after a step was committed: ``installed`` is True (the step is
    listed and restores; the distributed commit lets the other ranks see it)."""
    err = CheckpointError(reason, path=path)
    err.installed = True
    err.__cause__ = cause
    return err


# --- saving --------------------------------------------------------------------------------------------
def _collective(what: str, fn: Callable[[], Any], where: str) -> Any:
    try:
        return fn()
    except Exception as e:  # a rank died or the group broke: typed, not a hang or a raw RuntimeError
        raise CheckpointError(f"{what} failed: another rank is gone or the process group broke ({e})",
                              path=where) from e


def _same_step(flag: torch.Tensor, step: int, root: str) -> None:
    """After the plan's all_reduce (MAX of [changed, step, -step]): every rank saves ``step``."""
    hi, lo = int(flag[1]), -int(flag[2])
    if hi != step or lo != step:
        raise CheckpointError(f"ranks save different steps (from {lo} to {hi}; this rank: {step}): every rank "
                              "must call save() with the same step", path=root)


def _plan(ck: Any, items: dict[str, torch.Tensor], owner0: set[str], rank: int, world: int, step: int,
          failure: str | None = None
          ) -> tuple[str, list[tuple[str, torch.Tensor, list[int], list[int]]], Callable[[], bool] | None]:
    """This rank's writes: (name, tensor to write, global offsets, sizes), the temporary folder, and
    ``holds``: None, or a function to call before anything is written that says whether the plan holds.

    The assignment of replicated tensors needs every rank's sizes (one ``all_gather_object``). It is
    kept on the Checkpointer and reused while no rank's state changed shape: then one tiny
    ``all_reduce`` says so, and the temporary folder's name is made from rank 0's host and pid (known
    from the first plan) and a counter every rank advances alike. Where this rank's state did not
    change, that ``all_reduce`` runs while the caller copies its state (``holds`` waits for it); if
    another rank's did, ``holds()`` is False and the caller plans again (every rank learns the same).

    ``failure``: this rank could not take its state (the message). It still takes part in the plan's
    collectives, as an unkept plan, so that every rank learns of it there and raises at once, instead
    of the others waiting in a collective this rank never joins.
    """
    mine, sharded_bytes, replicated, shape_of, whole0 = [], 0, [], [], []
    for name, t in items.items():
        if name in owner0:  # (a DTensor is made whole once every rank agreed on the plan: a collective)
            whole0.append((name, t))
            if rank == 0:
                sharded_bytes += t.numel() * t.element_size()
            shape_of.append((name, "0", list(t.shape), str(t.dtype)))
        elif _replicated_everywhere(t):
            full = t.full_tensor() if _is_dtensor(t) else t
            replicated.append((name, full))
            shape_of.append((name, "r", list(full.shape), str(full.dtype)))
        else:
            local, offsets, sizes = _local_region(t)
            if not _writes_its_replica(name, t):  # (HSDP: the same slice on every rank of a replicate dim)
                shape_of.append((name, "d", offsets + sizes, str(local.dtype)))
                continue
            mine.append((name, local, offsets, sizes))
            sharded_bytes += local.numel() * local.element_size()
            shape_of.append((name, "s", offsets + sizes, str(local.dtype)))
    signature = [world, rank, shape_of]  # compared as it is: exact, and cheaper than hashing its JSON
    cached = ck._dist_plan
    if cached is not None and cached["world"] == world:
        # [plan changed, step, -step], each rank's maximum: a plan that changes anywhere changes for every
        # rank, and ranks saving different steps find out at once (they would wait for each other's files)
        kept = (failure is None and cached["signature"] == signature
                and not any(_is_dtensor(t) for _, t in whole0))
        flag = torch.tensor([0 if kept else 1, step, -step], dtype=torch.int64)
        if int(flag[0]) == 0:  # the cached plan, checked by every rank while the state is copied
            work = _collective("checking the save plan (all_reduce)",
                               lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), ck.root)

            def holds() -> bool:
                _collective("checking the save plan (all_reduce)", work.wait, ck.root)
                _same_step(flag, step, ck.root)
                return int(flag[0]) == 0

            cached["count"] += 1
            folder = tmp_name(step, pid=cached["pid"], host=cached["host"], nonce=f"{cached['token']}{cached['count']:x}")
            if rank == 0:
                mine += [(name, t, [0] * t.dim(), list(t.shape)) for name, t in whole0]
            full = dict(replicated)
            for name, a, b in cached["pieces"]:
                mine.append(_piece(name, full[name], a, b))
            return folder, mine, holds
        _collective("checking the save plan (all_reduce)", lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX),
                    ck.root)
        if failure is None:  # (a failed rank's step is what it was called with, but its error comes first)
            _same_step(flag, step, ck.root)
    ck._dist_plan = None
    rep_info = [(name, list(t.shape), t.element_size()) for name, t in replicated]
    gathered: list[Any] = [None] * world
    proposal = (host_name(), os.getpid(), uuid.uuid4().hex[:8], sharded_bytes, rep_info, step, failure)
    _collective("planning the save (all_gather_object)", lambda: dist.all_gather_object(gathered, proposal), ck.root)
    failed = [(r, g[6]) for r, g in enumerate(gathered) if g[6] is not None]
    if failed:
        raise CheckpointError("; ".join(f"rank {r} could not take its state: {msg}" for r, msg in failed)
                              + f"; nothing of step {step} was written", path=ck.root)
    host0, pid0, token = gathered[0][:3]
    if len({g[5] for g in gathered}) > 1:
        raise CheckpointError(f"ranks save different steps: {sorted({g[5] for g in gathered})} (rank {rank}: {step}); "
                              "every rank must call save() with the same step", path=ck.root)
    if any(g[4] != rep_info for g in gathered):
        raise CheckpointError("ranks disagree on the replicated (non-DTensor) state: every rank must save the "
                              "same model and optimizer structure", path=ck.root)
    load = [g[3] for g in gathered]
    total = sum(load) + sum(_nbytes(s, e) for _, s, e in rep_info)
    fair = total / world
    pieces = []  # (bytes, name, row start, row end)
    for name, shape, esize in rep_info:
        nbytes = _nbytes(shape, esize)
        rows = shape[0] if shape else 1
        if shape and nbytes > fair / 2 and rows > 1:  # large: cut into row ranges, spread like the rest
            k = min(rows, 2 * world)
            bounds = [rows * i // k for i in range(k + 1)]
            pieces += [(nbytes * (b - a) // rows, name, a, b) for a, b in itertools.pairwise(bounds) if b > a]
        else:
            pieces.append((nbytes, name, 0, rows))
    pieces.sort(key=lambda p: (-p[0], p[1], p[2]))
    for name, t in whole0:  # every rank alike (a DTensor's full_tensor is a collective); rank 0 writes them
        t = t.full_tensor() if _is_dtensor(t) else t
        if rank == 0:
            mine.append((name, t, [0] * t.dim(), list(t.shape)))
    full = dict(replicated)
    own = []
    for nbytes, name, a, b in pieces:
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += nbytes
        if r == rank:
            own.append((name, a, b))
            mine.append(_piece(name, full[name], a, b))
    ck._dist_plan = {"world": world, "signature": signature, "host": host0, "pid": pid0, "token": token,
                     "count": 0, "pieces": own}
    folder = tmp_name(step, pid=pid0, host=host0, nonce=f"{token}0")
    return folder, mine, None


def _piece(name: str, t: torch.Tensor, a: int, b: int) -> tuple[str, torch.Tensor, list[int], list[int]]:
    """Rows ``a:b`` of a replicated tensor (the whole of a 0-dim one)."""
    if t.dim() == 0:
        return name, t, [], []
    return name, t[a:b], [a] + [0] * (t.dim() - 1), [b - a, *t.shape[1:]]


def _nbytes(shape: list[int], esize: int) -> int:
    n = esize
    for s in shape:
        n *= s
    return n


@torch.no_grad()  # a DTensor's to_local() skips autograd: 1.2 ms less for 168 tensors
def save_distributed(ck: Any, step: int, model: Any, optimizer: Any, extra: Any, rank_state: Any,
                     loader: Any, blocking: bool = True, export_to: Any = None) -> Callable[[], None]:
    """Plan one step on every rank (one collective) and snapshot this rank's part; returns the writer.

    Calling the returned function writes this rank's files and takes part in the commit (see the module
    docstring); it uses no collective, so it may run in a background thread. With ``blocking`` and CPU
    state it writes straight from the tensors' memory; otherwise it writes a copy made now in the
    Checkpointer's staging arena (reused save after save, so memory stays flat), and the state may
    change as soon as this returns.
    """
    rank, world = rank_and_world()
    if optimizer is not None and model is None:
        raise CheckpointError("a distributed save of an optimizer needs its model (optimizer state is keyed "
                              "by parameter name)", path=ck.root)
    items, own, extra_items = _Items(), _Items(), _Items()
    spec: dict[str, Any] = {}
    owner0: set[str] = set()
    try:  # what one rank alone may fail at: the others learn it in the plan's collective (no hang)
        model_state, optim_state = _canonical_state(ck, model, optimizer)
        if model_state is not None:
            items.ties = _tie_groups(model)
            spec["model"] = encode(model_state, "model", items)
            items.ties = {}
        if optim_state is not None:
            spec["optimizer"] = encode(optim_state, "optim", items)
        spec["extra"] = encode(extra, "extra", extra_items)
        for name, t in extra_items.tensors.items():  # global state: rank 0's, written by rank 0
            items.tensors[name] = t
            owner0.add(name)
        if model is not None:
            # a buffer (BatchNorm's running statistics) may differ between ranks after a step: rank 0's is
            # saved, the one DDP broadcasts to every rank at the next forward (written by rank 0, like extra)
            buffers = {b.data_ptr() for b in model.buffers() if not _is_dtensor(b) and b.numel()}
            owner0.update(name for name, t in items.tensors.items() if name.startswith("model.")
                          and not _is_dtensor(t) and t.numel() and t.data_ptr() in buffers)
        own_spec = encode(rank_state, f"rank{rank}", own)
        # (encoded as the single-process save encodes it: int keys, tuples, tensors come back as they were)
        loader_state = encode(loader.state_dict(), "__loader__", own) if loader is not None else None
    except Exception as e:  # noqa: BLE001 - _plan_failed raises it, on every rank
        _plan_failed(ck, rank, world, step, e)
    folder_name, mine, holds = _plan(ck, items.tensors, owner0, rank, world, step)
    try:  # this rank alone fails (memory for the snapshot): the others learn it now, not at the timeout
        tensors: dict[str, torch.Tensor] = {}
        chunks: dict[str, list[dict[str, Any]]] = {}
        for name, t, offsets, sizes in mine:
            key = f"{name}@{','.join(map(str, offsets))}"
            tensors[key] = t
            chunks.setdefault(name, []).append({"key": key, "offsets": offsets, "sizes": sizes,
                                                "dtype": str(t.dtype).removeprefix("torch.")})
        for name, t in own.tensors.items():
            tensors[name] = t.full_tensor() if _is_dtensor(t) else t
        tensors = {k: (v.contiguous() if v.device.type == "cpu" else v) for k, v in tensors.items()}
        files, by_key = _rank_files(f"rank-{rank:05d}", tensors, ck.max_shard_size, ck._rank_files_cache)
        events: list[Any] = []
        if not blocking or any(t.device.type != "cpu" for f in files for _, t in f.parts):
            events = ck._arena.stage(files, ordered=not blocking)
        else:
            for f in files:
                if not f.views:  # (a shard of no tensors still has its header to write)
                    f.bind()
    except Exception as e:
        if holds is not None and not holds():  # the others plan again: this rank joins, failing
            ck._dist_plan = None
            _plan_failed(ck, rank, world, step, e)
        _fail_part(ck, os.path.join(ck.root, folder_name), rank, e)
        raise
    if holds is not None and not holds():  # another rank's state changed shape: plan again, all ranks alike
        for event in events:
            event.synchronize()
        ck._dist_plan = None
        return save_distributed(ck, step, model, optimizer, extra, rank_state, loader, blocking, export_to)
    for entries_of in chunks.values():
        for c in entries_of:
            c.update(by_key[c["key"]])
    info = {"rank": rank, "world_size": world, "chunks": chunks, "state": own_spec,
            "state_tensors": {k: by_key[k] for k in own.tensors},
            "loader": loader_state}
    if rank == 0:
        info["spec"] = spec
    del items, own, tensors, mine, extra_items

    def write() -> None:
        for event in events:  # GPU snapshot copies (stream-ordered) land before the write
            event.synchronize()
        _write_part(ck, step, os.path.join(ck.root, folder_name), files, info, rank, world,
                    export_to if model is not None else None)

    return write


def _plan_failed(ck: Any, rank: int, world: int, step: int, e: Exception) -> NoReturn:
    """Take part in the plan's collectives as the rank that could not take its state (``e``): every rank
    raises there (this one its CheckpointError, from ``e``)."""
    try:
        _plan(ck, {}, set(), rank, world, step, failure=f"{type(e).__name__}: {e}")
    except CheckpointError as told:
        raise told from e
    raise e  # (the plan raises for every rank once one failed)


def _report_failure(tmp: str, rank: int, e: BaseException) -> None:
    """This rank's error file in the step's temporary folder; rank 0's also aborts the save (the others
    wait for rank 0's commit, not for its part): every rank waiting on the step raises at once."""
    _write_json_atomic(tmp, f"rank-{rank:05d}.error", {"rank": rank, "error": repr(e)}, quiet=True)
    if rank == 0:
        _abort(tmp)


def _fail_part(ck: Any, tmp: str, rank: int, e: BaseException) -> None:
    """Tell the other ranks that this rank will write nothing for the step being saved (rank 0 makes the
    step's temporary folder first), so that they raise at once."""
    with contextlib.suppress(OSError, CheckpointError):
        if rank == 0:
            os.makedirs(tmp, exist_ok=True)
        else:
            _wait_for(lambda: os.path.isdir(tmp) or _owner_gone(tmp), ck.timeout, "rank 0's folder", tmp)
        _report_failure(tmp, rank, e)


def _write_part(ck: Any, step: int, tmp: str, files: list[FilePlan], info: dict[str, Any], rank: int,
                world: int, export_to: Any) -> None:
    if rank == 0:
        _drop_aborted(ck.root)
        try:
            os.makedirs(tmp, exist_ok=True)
            _busy(tmp)
        except OSError as e:
            raise CheckpointError(f"rank 0: cannot create step {step}'s folder: {e}", path=tmp) from e
    else:
        _wait_for(lambda: os.path.isdir(tmp) or _owner_gone(tmp), ck.timeout,
                  f"rank 0 to create {os.path.basename(tmp)}", tmp)
        if not os.path.isdir(tmp):
            raise CheckpointError(f"rank 0 died before step {step}'s folder existed; nothing was committed",
                                  path=tmp)
    try:
        _write_json_atomic(tmp, f"rank-{rank:05d}.pid", {"host": host_name(), "pid": os.getpid()})
        crash_point("tmp-created")
        info["files"] = write_files(tmp, files, ck._pool, ck._flusher, direct=ck.direct_io)
        _write_json_atomic(tmp, f"rank-{rank:05d}.json", info)
        crash_point("data-written")
    except BaseException as e:
        _report_failure(tmp, rank, e)
        if rank == 0:
            _unbusy(tmp)
        if isinstance(e, OSError):
            raise CheckpointError(f"rank {rank}: writing step {step} failed, nothing was committed: {e}",
                                  path=getattr(e, "filename", None) or tmp) from e
        raise
    finally:
        for f in files:  # drop references to tensors and the arena
            f.views, f.parts = [], []
    final = ck.path(step)
    if rank == 0:  # the others return once rank 0 is done: the step committed, older ones pruned, the export
        try:
            _commit(ck, step, tmp, final, world)
            if export_to is not None:
                try:
                    ck._export(step, export_to, ck.max_shard_size, overwrite=True)
                except (TorchforgeError, OSError) as e:
                    raise after_commit(f"step {step} was committed, but its export failed: {e}",
                                        getattr(e, "path", None) or str(export_to), e) from e
        except CheckpointError as e:
            if not getattr(e, "installed", False):
                _unbusy(tmp)
                raise
            try:  # the step is there, but what came after failed: the others raise it too
                _write_json_atomic(ck.root, os.path.basename(tmp) + ".busy", {"error": str(e)})
            except OSError:
                _unbusy(tmp)
            raise
        except BaseException:
            _unbusy(tmp)
            raise
        _unbusy(tmp)
    else:
        _wait_for(lambda: _committed(final, tmp), ck.timeout, f"rank 0 to commit step {step}", tmp)
        if not os.path.isdir(final) or not os.path.exists(os.path.join(final, "manifest.json")):
            raise CheckpointError(f"step {step} was not committed (another rank failed)", path=tmp)
        try:  # (the timeout again, from the commit: an export may take a while)
            _wait_for(lambda: _done(final, tmp), ck.timeout, f"rank 0 to prune and export after step {step}",
                      tmp)
        except CheckpointError as e:
            if getattr(e, "installed", False):
                raise
            raise after_commit(f"step {step} was committed, but {e}", final, e) from e


def _rank_files(prefix: str, tensors: dict[str, torch.Tensor], max_shard: int, cache: dict | None = None
                ) -> tuple[list[FilePlan], dict[str, dict[str, Any]]]:
    """This rank's safetensors files (split at ``max_shard`` bytes) and where each tensor lies:
    key -> {"file", "range": [begin, end] in the file}.

    ``cache`` (a dict kept by the caller) keeps the headers and offsets of the last call: while the
    names, dtypes and shapes stay the same (save after save of one model) they are reused, not rebuilt.
    """
    key = [prefix, max_shard, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]]
    if cache is not None and cache.get("key") == key:
        files = [FilePlan(name, head, [(off, tensors[k]) for off, k in parts], size)
                 for name, head, parts, size in cache["files"]]
        return files, {k: {"file": v["file"], "range": list(v["range"])} for k, v in cache["where"].items()}
    files, where, layouts = [], {}, []
    for k, group in enumerate(split_by_size(tensors, max_shard) if tensors else []):
        f, layout = file_plan(f"{prefix}-{k:05d}.safetensors", group)
        files.append(f)
        layouts.append((f.name, f.head, [(off, name) for name, _, off in layout], f.size))
        for name, t, off in layout:
            where[name] = {"file": f.name, "range": [off, off + t.numel() * t.element_size()]}
    if cache is not None:
        cache.clear()
        cache.update(key=key, files=layouts, where={k: {"file": v["file"], "range": list(v["range"])}
                                                     for k, v in where.items()})
    return files, where


def _abort(tmp: str) -> None:
    """Mark a save as failed (``ABORT`` in its folder) for the ranks waiting on it."""
    with contextlib.suppress(OSError), open(os.path.join(tmp, "ABORT"), "wb"):
        pass


def _busy(tmp: str) -> None:
    """Mark a save as not done (``<tmp>.busy`` beside its folder, made by rank 0 with the folder): the
    other ranks return once it is gone, after the commit, the pruning of older steps and the export,
    so that every rank sees the same steps when save() returns. Left with an error in it, the step was
    committed but what came after failed (the others raise that error too)."""
    with open(tmp + ".busy", "wb"):
        pass


def _unbusy(tmp: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(tmp + ".busy")


def _drop_aborted(root: str) -> None:
    """Delete this process's earlier saves that were aborted (rank 0 only: their ranks have all given up
    by the time rank 0 saves again), so a job whose saves keep failing does not pile up partial steps."""
    mine = f"-h{host_name()}-p{os.getpid()}-"
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            if name.startswith(".tmp-step-") and mine in name:
                if name.endswith(".busy"):  # a save's error, read by the other ranks before this save
                    os.unlink(os.path.join(root, name))
                elif os.path.exists(os.path.join(root, name, "ABORT")):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _done(final: str, tmp: str) -> bool:
    """Whether rank 0 is done with a committed step (pruned older steps, exported): its ``.busy`` gone."""
    try:
        with open(tmp + ".busy", "rb") as f:
            said = f.read()
    except FileNotFoundError:
        return True
    if said:
        try:
            error = json.loads(said)["error"]
        except (ValueError, KeyError, TypeError, RecursionError):
            error = f"unreadable error report {said[:200]!r}"
        raise after_commit(f"rank 0: {error}", final, CheckpointError(error, path=final))
    return _owner_gone(tmp)  # (rank 0 died after the commit: the step is there)


def _committed(final: str, tmp: str) -> bool:
    if os.path.exists(os.path.join(final, "manifest.json")) and not os.path.isdir(tmp):
        return True
    if os.path.exists(os.path.join(tmp, "ABORT")):
        raise CheckpointError("rank 0 aborted the save (a rank failed or timed out)", path=tmp)
    if _owner_gone(tmp):
        raise CheckpointError("rank 0 died before it committed the step; nothing was committed", path=tmp)
    return False


def _owner_gone(tmp: str) -> bool:
    """Whether the process named in a temporary folder's name (rank 0) is gone (same host only: another
    host's process cannot be checked, and the timeout covers it)."""
    m = re.search(r"-h(\w+)-p(\d+)-[0-9a-f]+$", tmp)
    return bool(m) and m.group(1) == host_name() and not pid_alive(int(m.group(2)))


def _dead_ranks(tmp: str, waiting: list[int]) -> list[str]:
    """Ranks among ``waiting`` whose process, on this host, is gone (from their ``rank-<k>.pid`` file)."""
    dead = []
    for r in waiting:
        try:
            with open(os.path.join(tmp, f"rank-{r:05d}.pid"), "rb") as f:
                who = json.loads(f.read())
        except (OSError, ValueError, RecursionError):
            continue  # not started yet (or on a host whose file is not visible yet): the timeout covers it
        if isinstance(who, dict) and who.get("host") == host_name() and isinstance(who.get("pid"), int) \
                and not pid_alive(who["pid"]):
            dead.append(f"rank {r} (pid {who['pid']})")
    return dead


def _wait_for(cond: Callable[[], bool], timeout: float, what: str, where: str) -> None:
    deadline = time.monotonic() + timeout
    pause = _POLL[0]
    while not cond():
        if time.monotonic() > deadline:
            raise CheckpointError(f"timed out after {timeout:g} s waiting for {what}", path=where)
        time.sleep(pause)
        pause = min(pause * 1.5, _POLL[1])


def _write_json_atomic(folder: str, name: str, obj: Any, quiet: bool = False) -> None:
    data = json.dumps(obj, indent=1).encode() + b"\n"
    tmp = os.path.join(folder, f".{name}.part")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, [memoryview(data)], 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(folder, name))
        fsync_dir(folder)
    except OSError:
        if not quiet:
            raise


def _commit(ck: Any, step: int, tmp: str, final: str, world: int) -> None:
    names = [f"rank-{r:05d}.json" for r in range(world)]

    def ready() -> bool:
        errors = [n for n in os.listdir(tmp) if n.endswith(".error")]
        if errors:
            raise CheckpointError(f"step {step}: {', '.join(sorted(errors))} reported a failure; nothing was "
                                  "committed", path=tmp)
        waiting = [r for r, n in enumerate(names) if not os.path.exists(os.path.join(tmp, n))]
        dead = _dead_ranks(tmp, waiting)
        if dead:
            raise CheckpointError(f"step {step}: {', '.join(dead)} died before writing its part; nothing was "
                                  "committed", path=tmp)
        return not waiting

    try:
        _wait_for(ready, ck.timeout, f"all {world} ranks to write their part of step {step}", tmp)
        infos = []
        for n in names:
            with open(os.path.join(tmp, n), "rb") as f:
                infos.append(json.loads(f.read()))
        files: dict[str, Any] = {}
        tensors: dict[str, Any] = {}
        for info in infos:
            files.update(info["files"])
            for name, cs in info["chunks"].items():
                tensors.setdefault(name, []).extend(cs)
        for n in names:  # the rank files are covered by the manifest's digests too
            with open(os.path.join(tmp, n), "rb") as f:
                data = f.read()
            d = BlockDigest()
            d.update(memoryview(data))
            files[n] = {"size": len(data), "digests": [d.hexdigest()]}
        spec = infos[0]["spec"]
        table = {}
        for name, cs in sorted(tensors.items()):
            cs.sort(key=lambda c: c["offsets"])
            table[name] = {"shape": _global_shape(cs), "dtype": cs[0]["dtype"],
                           "chunks": [{k: c[k] for k in ("file", "key", "offsets", "sizes", "range")} for c in cs]}
        key = (ck._next_seq(), time.time_ns())  # (seq, commit time): what _prune knows of this step
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "world_size": world, "committed": key[1],
                    "seq": key[0],
                    "checksum": "blake2b128-of-4KiB-page-sum64, 64MiB blocks", "files": files,
                    "tensors": table, "spec": spec}
        for r in range(world):  # liveness records of the save, not part of the step
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(tmp, f"rank-{r:05d}.pid"))
        crash_point("manifest-written")
        _write_json_atomic(tmp, "manifest.json", manifest)
        crash_point("before-rename")
        ck._install(tmp, final)
        crash_point("after-rename")
    except CheckpointError as e:
        if getattr(e, "installed", False):  # the step is in place: the others see it once tmp is gone
            shutil.rmtree(tmp, ignore_errors=True)  # (tmp held the step saved before under that number)
        else:
            _abort(tmp)
        raise
    except BaseException as e:
        _abort(tmp)
        if isinstance(e, OSError):
            raise CheckpointError(f"rank 0: committing step {step} failed, nothing was committed: {e}",
                                  path=getattr(e, "filename", None) or tmp) from e
        raise
    ck._prune(step, key)


def _global_shape(chunks: list[dict[str, Any]]) -> list[int]:
    if not chunks[0]["offsets"]:
        return []
    dims = len(chunks[0]["offsets"])
    return [max(c["offsets"][d] + c["sizes"][d] for c in chunks) for d in range(dims)]


# --- restoring ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def damaged(files: str, values: str, where: str) -> Iterator[None]:
    """Errors raised inside as CheckpointErrors: a damaged file's own TorchforgeError (a ValueError too,
    so it is caught first) keeps its path and offset ("<files> is damaged: ..."); a malformed value
    (KeyError, TypeError, ...) names ``where`` ("<values> is damaged: ...")."""
    try:
        yield
    except CheckpointError:
        raise
    except TorchforgeError as e:
        raise CheckpointError(f"{files} is damaged: {e.reason}", path=e.path, offset=e.offset) from e
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise CheckpointError(f"{values} is damaged: {e!r}", path=where) from e


def check_tensors(folder: str, manifest: dict[str, Any]) -> None:
    """Check the manifest's tensor table before anything is read: every entry's shape (ints >= 0), dtype
    (a torch dtype) and chunks (a listed file and a key each; offsets and sizes of the entry's rank, inside
    its shape), and that the chunks tile the shape exactly: pairwise disjoint, their elements summing to
    the shape's. So a restore never leaves part of a tensor unwritten (stale or uninitialized values)
    nor reads a slice from outside the tensor.

    Raises:
        CheckpointError: naming ``manifest.json`` and the tensor.
    """
    where = os.path.join(folder, "manifest.json")
    table, files = manifest.get("tensors"), manifest.get("files")
    if not isinstance(table, dict) or not isinstance(files, dict):
        raise CheckpointError("manifest.json is damaged: no 'tensors' or 'files' table", path=where)
    for name, e in table.items():
        why = _entry_problem(e, files)
        if why:
            raise CheckpointError(f"manifest.json is damaged: tensor {name!r}: {why}", path=where)


def _entry_problem(e: Any, files: dict[str, Any]) -> str | None:
    if not isinstance(e, dict):
        return "its entry is not an object"
    shape, chunks = e.get("shape"), e.get("chunks")
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**62 for d in shape):
        return f"shape {shape!r} is not a list of ints >= 0"
    try:
        torch_dtype(e.get("dtype"))
    except ValueError as ex:
        return str(ex)
    if not isinstance(chunks, list):
        return "'chunks' is not a list"
    lo, hi, total = [], [], 0
    for c in chunks:
        if not isinstance(c, dict) or c.get("file") not in files or not isinstance(c.get("key"), str):
            return f"chunk {c!r} does not name a file the manifest lists and a key"
        off, size = c.get("offsets"), c.get("sizes")
        if not (isinstance(off, list) and isinstance(size, list) and len(off) == len(size) == len(shape)
                and all(type(v) is int for v in off + size)):
            return f"chunk offsets {off!r} and sizes {size!r} are not {len(shape)} ints each"
        if any(o < 0 or z < 0 or o + z > d for o, z, d in zip(off, size, shape)):
            return f"the chunk at offsets {off} of sizes {size} lies outside the shape {shape}"
        n = math.prod(size)
        if n:
            lo.append(off)
            hi.append([o + z for o, z in zip(off, size)])
            total += n
    if total != math.prod(shape) or _overlap(lo, hi, shape):
        return (f"its {len(chunks)} chunks do not tile the shape {shape} exactly (they overlap or leave "
                "parts out)")
    return None


def _overlap(lo: list[list[int]], hi: list[list[int]], shape: list[int]) -> bool:
    """Whether any two of the boxes ``[lo, hi)`` (none empty, all inside ``shape``) overlap."""
    if len(lo) < 2:
        return False
    if not shape:  # two 0-dim chunks of one element each
        return True
    split = [d for d in range(len(shape)) if any(a[d] != 0 or b[d] != shape[d] for a, b in zip(lo, hi))]
    if len(split) <= 1:  # cut along one dimension at most (FSDP's Shard(0), DDP's whole tensor): intervals
        d = split[0] if split else 0
        spans = sorted((a[d], b[d]) for a, b in zip(lo, hi))
        return any(b0 > a1 for (_, b0), (a1, _) in itertools.pairwise(spans))
    for i in range(len(lo)):  # a grid or any other cut: box against box
        for j in range(i):
            if all(lo[i][d] < hi[j][d] and lo[j][d] < hi[i][d] for d in range(len(shape))):
                return True
    return False


class _Reader:
    """Copies saved slices into target regions through mmap views, counting the bytes it touches."""

    def __init__(self, folder: str, manifest: dict[str, Any]):
        self.folder, self.m = folder, manifest
        self.files: dict[str, Any] = {}
        self.bytes_read = 0
        self.bytes_needed = 0

    def _file(self, name: str) -> Any:
        f = self.files.get(name)
        if f is None:
            if name not in self.m["files"]:
                raise CheckpointError(f"the manifest's tensor table names {name!r}, which it does not list",
                                      path=os.path.join(self.folder, "manifest.json"))
            f = self.files[name] = load_safetensors(os.path.join(self.folder, name))
        return f

    def entry(self, name: str) -> dict[str, Any]:
        e = self.m["tensors"].get(name)
        if e is None:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint", path=os.path.join(self.folder,
                                                                                                 "manifest.json"))
        return e

    @torch.no_grad()
    def fill(self, name: str, dst: torch.Tensor, offsets: list[int], sizes: list[int]) -> None:
        """Copy the region [offsets, offsets + sizes) of saved tensor ``name`` into ``dst``."""
        e = self.entry(name)
        covered = 0
        for c in e["chunks"]:
            lo = [max(a, b) for a, b in zip(c["offsets"], offsets)]
            hi = [min(a + s, b + z) for a, s, b, z in zip(c["offsets"], c["sizes"], offsets, sizes)]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            src = self._file(c["file"]).get(c["key"])
            if src is None:
                raise CheckpointError(f"{c['key']!r} is missing from its file", path=os.path.join(self.folder,
                                                                                                 c["file"]))
            if list(src.shape) != list(c["sizes"]) or src.dtype != torch_dtype(e["dtype"]):
                raise CheckpointError(f"{c['key']!r} is {str(src.dtype).removeprefix('torch.')} {list(src.shape)}, "
                                      f"the manifest says {e['dtype']} {c['sizes']}",
                                      path=os.path.join(self.folder, c["file"]))
            s = src[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, c["offsets"]))]
            d = dst[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offsets))]
            d.copy_(s)
            n = s.numel() * s.element_size()
            self.bytes_read += n
            covered += s.numel()
        want = 1
        for z in sizes:
            want *= z
        self.bytes_needed += want * dst.element_size()
        if covered != want:
            raise CheckpointError(f"tensor {name!r}: the saved slices cover {covered} of the {want} elements "
                                  f"this rank needs (offsets {offsets}, sizes {sizes})",
                                  path=os.path.join(self.folder, "manifest.json"))

    def check_like(self, name: str, target: torch.Tensor, key: str | None = None) -> None:
        """Saved tensor ``name`` can be copied into ``target`` (model key ``key``): the same global shape,
        a dtype that changes precision only (CheckpointError otherwise)."""
        e = self.entry(name)
        check_fits(key or name, e["shape"], torch_dtype(e["dtype"]), target,
                   os.path.join(self.folder, "manifest.json"))

    def fill_like(self, name: str, target: torch.Tensor) -> None:
        """Fill what this process holds of ``target`` (a DTensor's local slice, or a whole tensor)."""
        self.check_like(name, target)
        local, offsets, sizes = _local_region(target)
        if local.numel():
            self.fill(name, local, offsets, sizes)

    def whole(self, name: str, device: Any = "cpu") -> torch.Tensor:
        e = self.entry(name)
        out = torch.empty(e["shape"], dtype=torch_dtype(e["dtype"]), device=device)
        if out.numel():
            self.fill(name, out, [0] * out.dim(), list(out.shape))
        return out


def restore_distributed(ck: Any, step: int, folder: str, manifest: dict[str, Any], model: Any, optimizer: Any,
                        loader: Any, map_location: Any) -> Any:
    rank, world = rank_and_world()
    where = os.path.join(folder, "manifest.json")
    reader = _Reader(folder, manifest)
    spec = manifest.get("spec")
    if not isinstance(spec, dict) or not isinstance(manifest.get("tensors"), dict):
        raise CheckpointError("manifest.json is damaged: no 'spec' or 'tensors' table", path=where)
    check_tensors(folder, manifest)
    with damaged(f"step {step}", "manifest.json", where):
        if optimizer is not None and "optimizer" in spec:
            _check_groups(spec["optimizer"], optimizer, where)  # before the model changes: all or nothing
        if loader is not None:
            loader_state = _loader_state(folder, manifest, rank, world)
            check_loader(loader, loader_state, step, where)
        if model is not None:
            if "model" not in spec:
                raise CheckpointError(f"step {step} holds no model state", path=where)
            _restore_model(reader, model, spec["model"], where)
        if optimizer is not None:
            if "optimizer" not in spec:
                raise CheckpointError(f"step {step} holds no optimizer state", path=where)
            if model is None:
                raise CheckpointError("restoring an optimizer from a distributed checkpoint needs its model",
                                      path=where)
            _restore_optimizer(reader, model, optimizer, spec["optimizer"], where)
        if loader is not None:
            loader.load_state_dict(loader_state)
        extra = decode(spec.get("extra"), lambda name: reader.whole(name, map_location))
    ck.last_restore = {"bytes_read": reader.bytes_read, "bytes_needed": reader.bytes_needed}
    return extra


def model_tensors(folder: str, manifest: dict[str, Any]
                  ) -> tuple[dict[str, tuple[list[int], torch.dtype]], Callable[[str], torch.Tensor]]:
    """The model's tensors of a distributed step, whole: name -> (shape, dtype), and a reader of one."""
    spec = manifest.get("spec")
    if not isinstance(spec, dict) or "model" not in spec:
        raise CheckpointError("the step holds no model state", path=os.path.join(folder, "manifest.json"))
    check_tensors(folder, manifest)
    stored = _names(spec["model"])
    reader = _Reader(folder, manifest)
    names, seen = {}, set()
    for key, name in stored.items():
        if name in seen:  # a tied weight: exported once, under its first name (as save_pretrained does)
            continue
        seen.add(name)
        e = reader.entry(name)
        names[key] = (list(e["shape"]), torch_dtype(e["dtype"]))
    return names, lambda key: reader.whole(stored[key])


def _names(spec: Any) -> dict[str, str]:
    """key -> stored tensor name, from an encoded flat dict (``{"w": {"__tensor__": "model.w"}}``)."""
    if not isinstance(spec, dict):
        raise TypeError("the model spec is not a dict")
    out = {}
    for k, v in spec.items():
        if not (isinstance(v, dict) and set(v) == {"__tensor__"}):
            raise TypeError(f"model entry {k!r} is not a tensor reference")
        out[k] = v["__tensor__"]
    return out


def _restore_model(reader: _Reader, model: Any, spec: Any, where: str) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    saved = _names(spec)
    target = _model_state(model)
    missing, unexpected = sorted(set(target) - set(saved)), sorted(set(saved) - set(target))
    if missing or unexpected:
        raise CheckpointError(f"model keys differ from the checkpoint: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}", path=where)
    check_materialized(target, where)
    for k, t in target.items():  # every tensor fits before the first copy: all or nothing
        reader.check_like(saved[k], t, k)
    tied: dict[tuple, str] = {}
    for k, t in target.items():
        local = t.to_local() if _is_dtensor(t) else t
        key = memory_key(local)
        first = tied.get(key) if local.numel() else None
        if first is None:
            tied[key] = k
        elif saved[first] != saved[k] and not same_bits(reader.whole(saved[first]), reader.whole(saved[k])):
            raise tied_apart(first, k, where)  # tied here, saved as two tensors of different values
    for k, t in target.items():
        reader.fill_like(saved[k], t)
    set_model_state_dict(model, target)  # a no-op copy where the state dict shares the parameters' memory


def _restore_optimizer(reader: _Reader, model: Any, optimizer: Any, spec: Any, where: str) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    canon = _model_state(model)  # canonical names (DDP's module. prefix gone) map to the same tensors

    def like(name: str) -> torch.Tensor:
        # optim.state.<fqn>.<key>: shaped like the parameter -> laid out like it (DTensor slices)
        e = reader.entry(name)
        fqn = _fqn_of(name, canon)
        p = canon.get(fqn) if fqn is not None else None
        if p is not None and list(p.shape) == list(e["shape"]) and e["shape"]:
            t = torch.empty_like(p, dtype=torch_dtype(e["dtype"]))
            reader.fill_like(name, t)
            return t
        return reader.whole(name, p.device if p is not None and not _is_dtensor(p) else "cpu")

    set_optimizer_state_dict(model, optimizer, decode(spec, like))  # (groups checked by restore_distributed)


def _check_groups(spec: Any, optimizer: Any, where: str) -> None:
    """:func:`check_group_sizes` of the encoded optimizer state (its ``param_groups`` are plain JSON)."""
    check_group_sizes(optimizer, spec.get("param_groups") if isinstance(spec, dict) else None, where)


def _fqn_of(name: str, canon: dict[str, Any]) -> str | None:
    """The parameter name inside ``optim.state.<fqn>.<key>``."""
    prefix = "optim.state."
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    fqn = rest.rpartition(".")[0]
    return fqn if fqn in canon else None


def _saved_world(folder: str, manifest: dict[str, Any]) -> int:
    w = manifest.get("world_size")
    if type(w) is not int or w < 1:
        raise CheckpointError(f"manifest.json is damaged: world_size {w!r} is not an int >= 1",
                              path=os.path.join(folder, "manifest.json"))
    return w


def _rank_info(folder: str, manifest: dict[str, Any], r: int) -> dict[str, Any]:
    """Rank ``r``'s ``rank-<r>.json`` (listed in the manifest, so its size and digests are checked)."""
    name = f"rank-{r:05d}.json"
    path = os.path.join(folder, name)
    if name not in manifest.get("files", {}):
        raise CheckpointError(f"rank {r}'s file is not listed in the manifest", path=path)
    try:
        with open(path, "rb") as f:
            info = json.loads(f.read())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"rank {r}'s state is unreadable: {e}", path=path) from None
    if not isinstance(info, dict):
        raise CheckpointError(f"rank {r}'s state is not a JSON object", path=path)
    return info


def _loader_state(folder: str, manifest: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    saved_world = _saved_world(folder, manifest)
    infos, states = [], []
    for r in range(saved_world):
        infos.append(_rank_info(folder, manifest, r))
        s = infos[r].get("loader")
        if s is not None and not (isinstance(s, dict) and isinstance(s.get("workers", []), list)
                                  and all(isinstance(w, dict) for w in s.get("workers", []))):
            raise CheckpointError(f"rank {r}'s DataLoader state {s!r:.80} is not a loader's state_dict()",
                                  path=os.path.join(folder, f"rank-{r:05d}.json"))
        states.append(s)
    if any(s is None for s in states):
        raise CheckpointError("the step holds no DataLoader state (save with loader=)", path=folder)
    if saved_world == world:
        return _decoded(folder, manifest, rank, infos[rank], states[rank], "DataLoader state")
    problems = []
    for r, s in enumerate(states):
        sampler = s.get("sampler")
        if not (isinstance(sampler, dict) and "position" in sampler and "epoch" in sampler) or s.get("skip_batches"):
            problems.append(f"rank {r}'s sampler state is not elastic (use a GlobalSampler)")
        if s.get("dataset") is not None:
            problems.append(f"rank {r} holds a dataset state")
        if any(w.get("state") is not None for w in s.get("workers", [])):
            problems.append(f"rank {r} holds per-worker dataset states")
        if s.get("extra"):
            problems.append(f"rank {r} yielded batches out of order (in_order=False) ahead of its position")
    positions = {(s["sampler"]["epoch"], s["sampler"]["position"]) for s in states if not problems}
    if len(positions) > 1:
        problems.append(f"ranks stopped at different global positions {sorted(positions)}")
    if problems:
        raise CheckpointError(f"the DataLoader state saved at world size {saved_world} cannot be remapped to "
                              f"world size {world}: {'; '.join(problems)}", path=folder)
    state = _decoded(folder, manifest, 0, infos[0], states[0], "DataLoader state")
    if isinstance(state, dict):  # torch's generator is each rank's own: rank 0's would be every rank's
        state.pop("global_rng", None)
    return state


def rank_state(folder: str, manifest: dict[str, Any], rank: int, world: int, map_location: Any) -> Any:
    """This rank's ``rank_state`` (same world size only).

    Raises:
        CheckpointError: another world size, or a damaged rank file (naming it); a tensor file the rank
            file names must be one the manifest lists (never a path outside the step).
    """
    saved_world = _saved_world(folder, manifest)
    if saved_world != world:
        raise CheckpointError(f"per-rank state was saved by {saved_world} ranks and cannot be given to rank "
                              f"{rank} of {world}: it is not remappable (restore at world size {saved_world}, or "
                              "rebuild it)", path=folder)
    info = _rank_info(folder, manifest, rank)
    return _decoded(folder, manifest, rank, info, info.get("state"), "state", map_location)


def _decoded(folder: str, manifest: dict[str, Any], rank: int, info: dict[str, Any], spec: Any, what: str,
             map_location: Any = "cpu") -> Any:
    """``spec`` (rank ``rank``'s encoded ``what``, from its rank file ``info``) decoded, its tensors read from
    the files the rank wrote."""
    where = os.path.join(folder, f"rank-{rank:05d}.json")
    files = {}

    def tensor(name: str) -> torch.Tensor:
        loc = info["state_tensors"][name]
        file = loc["file"]
        if not isinstance(file, str) or file not in manifest["files"]:
            raise CheckpointError(f"tensor {name!r} is in {file!r}, a file the manifest does not list", path=where)
        f = files.get(file) or files.setdefault(file, load_safetensors(os.path.join(folder, file)))
        if name not in f:
            raise CheckpointError(f"tensor {name!r} is missing from its file", path=os.path.join(folder, file))
        return f[name].to(map_location, copy=True)

    with damaged(f"rank {rank}'s {what}", f"rank {rank}'s {what}", where):
        return decode(spec, tensor)
