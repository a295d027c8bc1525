"""Hugging Face output: a step's model as consolidated ``model-0000k-of-0000N.safetensors`` shards plus
``model.safetensors.index.json``, the layout ``transformers`` and ``safetensors.torch.load_file`` read.

Whole tensors under their canonical names (no DDP ``module.`` prefix, FSDP2 slices joined). Tied
parameters are written once, as ``transformers``' own ``save_pretrained`` does (the model ties them
again when it loads). The folder is written like a step: into a temporary sibling named with host and
pid, every file fsynced, then renamed into place, so a reader never sees half an export. Shards are
filled one at a time: an export of a sharded checkpoint holds one output shard in memory, not the model.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from typing import Any

import torch

from torchforge._proc import drop_dead_stages
from torchforge.checkpoint.writer import FilePlan, file_plan, split_by_size, write_files
from torchforge.errors import CheckpointError
from torchforge.formats.safetensors import fsync_dir

__all__ = ["export_model"]

INDEX = "model.safetensors.index.json"


def export_model(names: dict[str, tuple[list[int], torch.dtype]], get: Callable[[str], torch.Tensor],
                 folder: str, max_shard: int, pool: Any, *, overwrite: bool = False) -> str:
    """Write ``names`` (name -> (shape, dtype); tensors fetched one shard at a time by ``get``) to ``folder``.

    Returns:
        The folder.

    Raises:
        CheckpointError: ``folder`` exists (without ``overwrite``) or a write failed: nothing is left half
            written, and a previous export stays in place; or the new export is in place but its parent
            folder could not be fsynced (the message says so).
    """
    from torchforge.checkpoint.checkpointer import exchange_paths
    from torchforge.checkpoint.distributed import host_name

    folder = os.path.abspath(folder)
    if os.path.exists(folder) and not overwrite:
        raise CheckpointError("the export folder exists: pass overwrite=True to replace it", path=folder)
    parent = os.path.dirname(folder)
    stem = f".{os.path.basename(folder)}.tmp-h{host_name()}-p"
    tmp = os.path.join(parent, f"{stem}{os.getpid()}")
    try:
        os.makedirs(parent, exist_ok=True)
        _remove(tmp)
        drop_dead_stages(parent, rf"{re.escape(stem)}(\d+)")  # exports of this host's processes killed midway
        os.mkdir(tmp)
        sizes = {n: torch.empty(0, dtype=dt).element_size() * _numel(shape) for n, (shape, dt) in names.items()}
        groups = split_by_size({n: _Sized(sizes[n]) for n in names}, max_shard)  # type: ignore[arg-type]
        total = len(groups)
        weight_map, nbytes = {}, 0
        for k, group in enumerate(groups, 1):
            fname = f"model-{k:05d}-of-{total:05d}.safetensors"
            tensors = {n: get(n).contiguous() for n in group}
            f, _ = file_plan(fname, tensors)
            f.bind()
            write_files(tmp, [f], pool, direct=False)
            del tensors, f
            for n in group:
                weight_map[n] = fname
                nbytes += sizes[n]
        index = {"metadata": {"total_size": nbytes}, "weight_map": dict(sorted(weight_map.items()))}
        write_files(tmp, [FilePlan.of_bytes(INDEX, json.dumps(index, indent=2).encode() + b"\n")], pool,
                    direct=False)
        fsync_dir(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise CheckpointError(f"export failed, nothing was written: {e}", path=folder) from e
        raise
    # in place: one atomic swap with the previous export where the filesystem can (tmp then holds the
    # previous one), else two renames, the second undone if it fails; the previous export goes last
    try:
        if not os.path.exists(folder):
            os.rename(tmp, folder)
        elif not exchange_paths(tmp, folder):
            old = f"{tmp}.old-{uuid.uuid4().hex[:8]}"
            os.rename(folder, old)
            try:
                os.rename(tmp, folder)
            except BaseException:
                os.rename(old, folder)
                raise
            tmp = old
    except BaseException as e:
        _remove(tmp)
        if isinstance(e, OSError):
            raise CheckpointError(f"export failed, the previous export (if any) is in place: {e}",
                                  path=folder) from e
        raise
    try:
        fsync_dir(parent)
    except OSError as e:
        raise CheckpointError(f"the export is in place, but {parent} could not be fsynced ({e}): it may not "
                              "survive a crash", path=folder) from e
    finally:
        _remove(tmp)  # the previous export, if there was one
    return folder


def _remove(path: str) -> None:
    """Remove a folder, or a link or file (a previous export that was a symlink, swapped out), if present."""
    if os.path.islink(path) or os.path.isfile(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    else:
        shutil.rmtree(path, ignore_errors=True)


class _Sized:
    """Stands in for a tensor in :func:`split_by_size` (only its byte count matters)."""

    def __init__(self, nbytes: int) -> None:
        self.n = nbytes

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return 1


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
