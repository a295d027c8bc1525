"""``torchforge inspect`` and ``torchforge verify`` on a checkpoint folder (the root a
:class:`~torchforge.Checkpointer` saves into, or one ``step-NNNNNNNN`` folder of it). Both read through
:meth:`Checkpointer.reader`, which changes nothing in the folder."""
from __future__ import annotations

import json
import os
from typing import Any

from torchforge.checkpoint.checkpointer import _FORMAT, _STEP, MANIFEST, STATE, Checkpointer
from torchforge.checkpoint.state import alias_problem
from torchforge.errors import CheckpointError, TorchforgeError

__all__ = ["checkpoint_info", "is_checkpoint", "verify_checkpoint"]


def _is_step(path: str) -> bool:
    """A step folder: named ``step-NNNNNNNN`` and holding a manifest of this format."""
    if not _STEP.fullmatch(os.path.basename(os.path.normpath(path))):
        return False
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            return json.loads(f.read()).get("format") == _FORMAT
    except (OSError, ValueError, AttributeError, RecursionError):
        if os.path.isfile(os.path.join(path, MANIFEST)):  # damaged: still a step, which verify reports
            return True
    try:  # no manifest: a step still, by what a step holds (verify says the manifest is missing)
        names = os.listdir(path)
    except OSError:
        return False
    return STATE in names or any(n.endswith(".safetensors.index.json") or n.startswith("rank-") for n in names)


def is_checkpoint(path: str) -> bool:
    """A checkpoint root (a folder holding ``step-NNNNNNNN`` steps) or one step folder."""
    if not os.path.isdir(path):
        return False
    if _is_step(path):
        return True
    try:
        names = os.listdir(path)
    except OSError:
        return False
    # a step folder, even one whose manifest is missing (verify reports it)
    return any(_STEP.fullmatch(n) and os.path.isdir(os.path.join(path, n)) for n in names)


def _open(path: str) -> tuple[Checkpointer, list[int]]:
    """The reader and the steps ``path`` names: every committed step of a root, or the one step."""
    path = os.path.abspath(path)
    if _is_step(path):
        return Checkpointer.reader(os.path.dirname(path)), [int(_STEP.fullmatch(os.path.basename(path)).group(1))]
    ck = Checkpointer.reader(path)
    return ck, ck.committed()


def checkpoint_info(path: str) -> dict[str, Any]:
    """What ``inspect`` prints: the steps, and the files of the latest (or the named) step."""
    ck, steps = _open(path)
    try:
        step = steps[-1] if steps else None
        info: dict[str, Any] = {"path": path, "format": "checkpoint", "steps": steps, "latest": step}
        if step is None:
            return {**info, "files": 0, "bytes": 0, "shards": []}
        m = ck.manifest(step)
        files = m["files"]
        info.update({"world size": m.get("world_size", 1), "files": len(files),
                     "bytes": sum(e["size"] for e in files.values()),
                     "shards": [{"file": f"step-{step:08d}/{n}", "bytes": e["size"]} for n, e in sorted(files.items())]})
        return info
    finally:
        ck.close()


def verify_checkpoint(path: str) -> tuple[int, list[str]]:
    """Check every step ``path`` names: manifest, sizes and every block digest (:meth:`Checkpointer.verify`).
    Returns (steps checked, problems), each naming the file and byte offset."""
    try:
        ck, steps = _open(path)
    except TorchforgeError as e:
        return 0, [str(e)]
    problems: list[str] = []
    try:
        for step in steps:
            try:
                ck.verify(step)
                _check_structure(ck, step)
            except TorchforgeError as e:
                problems.append(f"step {step}: {e}")
    finally:
        ck.close()
    return len(steps), problems


def _check_structure(ck: Checkpointer, step: int) -> None:
    """What the digests cannot say (a file the writer itself got wrong): ``state.json`` and the tensors of
    ``extra`` decode, and every tensor a single-process step's indexes name is in its shard's header."""
    m = ck.manifest(step)
    folder = ck.path(step)
    if m.get("version") == 1:
        state = ck._state(folder, step)
        for group in ("model", "optimizer", "extra"):
            if f"{group}.safetensors.index.json" in m["files"]:
                names, get = ck._group(folder, group, m["files"])
                for name in names:
                    get(name)
                problem = alias_problem(names, state["model"]["aliases"]) if group == "model" else None
                if problem:  # a tied tensor's alias names a stored tensor
                    raise CheckpointError(f"state.json is damaged: model {problem}",
                                          path=os.path.join(folder, "state.json"))
    ck.restore(step)  # no model or optimizer given: reads state.json and decodes extra
