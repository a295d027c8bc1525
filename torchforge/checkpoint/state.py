"""Checkpoint state: model / optimizer / extra state to tensors + JSON and back, without pickle.

Non-tensor values are encoded as JSON with a few tagged forms (``{"__tensor__": name}``,
``{"__tuple__": [...]}``, ``{"__float__": "inf"}``, ``{"__dict__": [[key, value], ...]}`` for non-string
keys, ``{"__dtype__": "float32"}``). Tensors that share memory exactly (tied weights) are stored once;
the other names are recorded as aliases.
"""
from __future__ import annotations

import itertools
import math
import sys
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from torchforge.checkpoint.staging import copy_tensors
from torchforge.errors import CheckpointError, TorchforgeError
from torchforge.formats.safetensors import DTYPES

SAFETENSORS_DTYPES = frozenset(dt for _, dt in DTYPES.values() if dt is not None)

__all__ = ["TensorTable", "alias_problem", "check_fits", "decode", "encode", "restore_model", "restore_optimizer"]

_EXTRA_STATE = "_extra_state"  # torch's key for a module's get_extra_state()
_TAGS = ("__tensor__", "__tuple__", "__float__", "__dict__", "__dtype__")


class TensorTable:
    """Named tensors of one group (model, optimizer, extra), deduplicating exact memory aliases."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.aliases: dict[str, str] = {}
        self._seen: dict[tuple, str] = {}

    def add(self, name: str, t: torch.Tensor) -> str:
        """Record ``t`` under ``name``; returns the name it is stored under (an earlier alias, itself, or
        ``name~k`` where another value of the state already has that dotted name: ``{"a.b": x, "a": {"b":
        y}}``)."""
        check_storable(name, t)
        name = unique_name(name, self.tensors, self.aliases)
        t = t.detach()
        key = None
        if t.numel():
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
                   t.dtype, t.is_conj(), t.is_neg())  # x.conj() shares x's memory, not its values
            if key in self._seen:
                self.aliases[name] = self._seen[key]
                return self._seen[key]
            self._seen[key] = name
        self.tensors[name] = t
        return name

    def cpu_contiguous(self) -> dict[str, torch.Tensor]:
        """The tensors, with strided CPU ones made contiguous (the zero-copy writer needs C order; other
        devices are copied into the staging arena, which takes any strides)."""
        return {k: v.contiguous() if v.device.type == "cpu" else v for k, v in self.tensors.items()}


def check_storable(name: str, t: torch.Tensor) -> None:
    """Only dense tensors of a safetensors dtype are stored: anything else is an error naming the tensor."""
    kind = ("nested" if t.is_nested else "quantized" if t.is_quantized
            else None if t.layout == torch.strided else str(t.layout).removeprefix("torch."))
    if kind is not None:
        raise CheckpointError(f"{name!r} is a {kind} tensor; a checkpoint stores dense (strided) tensors only: "
                              "store its dense form or its parts (e.g. .to_dense(), or indices and values)")
    if t.dtype not in SAFETENSORS_DTYPES:
        hint = " (e.g. torch.view_as_real)" if t.is_complex() else ""
        raise CheckpointError(f"{name!r} is {str(t.dtype).removeprefix('torch.')}, which safetensors cannot "
                              f"hold: store it as another dtype{hint}")


def canonical_keys(model: torch.nn.Module, keys: Any) -> dict[str, str]:
    """``model.state_dict()`` key -> the key without the attributes of wrappers (``torch.compile``'s
    ``_orig_mod``, DDP's and DataParallel's ``module``), found by walking the model, as
    ``torch.distributed.checkpoint`` names state: a compiled, wrapped and bare model share one name per
    tensor. (A submodule that happens to be called ``module`` keeps its name: only a wrapper's is dropped.)"""
    out = {}
    for key in keys:
        m: Any = model
        kept = []
        for part in key.split("."):
            sub = m._modules.get(part) if isinstance(m, torch.nn.Module) else None
            if sub is None or _wrapper_attr(m) != part:
                kept.append(part)
            m = sub
        out[key] = ".".join(kept)
    return out


def _wrapper_attr(m: torch.nn.Module) -> str | None:
    if isinstance(m, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
        return "module"
    frame = sys.modules.get("torch._dynamo.eval_frame")  # (not imported: nothing was compiled)
    if frame is not None and isinstance(m, frame.OptimizedModule):
        return "_orig_mod"
    return None


def strip_wrapper_names(names: Any) -> dict[str, str]:
    """Stored name -> the name without wrappers' attributes, for steps saved before names were canonical:
    every ``_orig_mod`` part dropped, and a ``module.`` prefix that every name has."""
    out = {n: ".".join(p for p in n.split(".") if p != "_orig_mod") for n in names}
    if out and all(v.startswith("module.") for v in out.values()):
        out = {k: v.removeprefix("module.") for k, v in out.items()}
    return out


def unique_name(name: str, *taken: Mapping[str, Any]) -> str:
    """``name``, or ``name~1``, ``name~2``, ... when it is taken."""
    out, k = name, 0
    while any(out in t for t in taken):
        k += 1
        out = f"{name}~{k}"
    return out


def encode(obj: Any, path: str, table: TensorTable) -> Any:
    """A JSON-able form of ``obj``; tensors go into ``table`` under their dotted ``path``."""
    def sub(key: Any) -> str:
        return f"{path}.{key}" if path else str(key)

    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": table.add(path, obj)}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, sub(i), table) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, sub(i), table) for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) for k in obj) and not any(k in _TAGS for k in obj):
            return {k: encode(v, sub(k), table) for k, v in obj.items()}
        return {"__dict__": [[encode(k, sub(f"key{i}"), table), encode(v, sub(k), table)]
                             for i, (k, v) in enumerate(obj.items())]}
    raise CheckpointError(f"cannot store {type(obj).__name__} at {path!r} without pickle: use tensors, "
                          "numbers, "
                          "strings, bools, None, lists, tuples and dicts")


_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def torch_dtype(name: Any) -> torch.dtype:
    """The torch dtype a manifest names (``"float32"``); ValueError for anything else (never an attribute
    of ``torch`` that is not a dtype)."""
    d = _DTYPES.get(name) if isinstance(name, str) else None
    if d is None:
        raise ValueError(f"{name!r} is not a torch dtype")
    return d


def decode(obj: Any, tensor: Callable[[str], torch.Tensor]) -> Any:
    """Invert :func:`encode`; ``tensor(name)`` supplies stored tensors."""
    if isinstance(obj, list):
        return [decode(v, tensor) for v in obj]
    if isinstance(obj, dict):
        if len(obj) == 1:
            (k, v), = obj.items()
            if k == "__tensor__":
                return tensor(v)
            if k == "__tuple__":
                return tuple(decode(x, tensor) for x in v)
            if k == "__float__":
                return float(v)
            if k == "__dtype__":
                return torch_dtype(v)
            if k == "__dict__":
                return {decode(a, tensor): decode(b, tensor) for a, b in v}
        return {k: decode(v, tensor) for k, v in obj.items()}
    return obj


def model_table(model: torch.nn.Module) -> TensorTable:
    """The model's state under canonical names (see :func:`canonical_keys`)."""
    table = TensorTable()
    sd = model.state_dict(keep_vars=False)
    canon = canonical_keys(model, sd)
    if len(set(canon.values())) != len(canon):
        canon = {k: k for k in sd}  # (wrapper names that collide with the model's own: kept as they are)
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise CheckpointError(f"model state {k!r} is a {type(v).__name__}; only tensors are stored")
        table.add(canon[k], v)
    return table


def alias_problem(names: list[str], aliases: Mapping[str, str]) -> str | None:
    """What is wrong with a group's aliases: each names a tensor that is stored, and is not one itself
    (an alias that is also stored, or that names another alias, would restore one tensor's values into
    another)."""
    stored = set(names)
    wrong = [f"{k} -> {v}" for k, v in aliases.items() if k in stored or v not in stored]
    return f"aliases {wrong[:3]} do not name a stored tensor or are stored themselves" if wrong else None


def check_materialized(target: Mapping[str, torch.Tensor], where: str) -> None:
    """A model on the meta device has no memory to restore into: ``copy_`` into it does nothing, and the
    restore would return as if it had worked."""
    meta = [k for k, t in target.items() if isinstance(t, torch.Tensor) and t.is_meta]
    if meta:
        raise CheckpointError(f"model tensors {meta[:5]}{' ...' if len(meta) > 5 else ''} are on the meta "
                              "device: a restore copies into the model's own memory; materialize the model "
                              "first (model.to_empty(device=...))", path=where)


@torch.no_grad()
def restore_model(model: torch.nn.Module, source: Callable[[str], torch.Tensor], names: list[str],
                  aliases: Mapping[str, str], where: str) -> None:
    """Copy stored tensors into the model's parameters and buffers (strict key match, under canonical
    names: a compiled, wrapped or bare model restores any of their steps). Shapes, dtypes and ties are
    checked before anything is copied. Where ``state_dict()`` is not the model's own memory (a module's
    extra state, a state-dict hook's converted copies, a lazy module) or the model has load hooks, the
    copy goes through ``model.load_state_dict``, which runs them."""
    problem = alias_problem(names, aliases)
    if problem:
        raise CheckpointError(f"state.json is damaged: model {problem}", path=where)
    target = model.state_dict(keep_vars=True)
    stored_of = match_names(model, target, set(names) | set(aliases), where)
    check_materialized(target, where)
    done: dict[tuple, tuple[str, str, torch.Tensor]] = {}
    sources: dict[str, torch.Tensor] = {}
    pairs = []
    for k, dst in target.items():
        name = stored_of[k]
        src = sources[k] = source(aliases.get(name, name))
        if torch.nn.parameter.is_lazy(dst) or k.endswith(_EXTRA_STATE):
            continue  # no shape yet (load_state_dict's lazy hook makes it), or anything set_extra_state takes
        dst = dst.detach()
        check_fits(k, list(src.shape), src.dtype, dst, where)
        key = memory_key(dst)
        if dst.numel() and key in done:  # tied in the model: one tensor, restored once
            first, stored, value = done[key]
            if stored != name and not same_bits(value, src):
                raise tied_apart(first, k, where)
            continue
        done[key] = (k, name, src)
        pairs.append((dst, src))
    if _needs_load_state_dict(model, target):
        try:
            model.load_state_dict(sources, strict=True)
        except (RuntimeError, ValueError, TypeError, KeyError) as e:
            raise CheckpointError(f"the model's load_state_dict rejects the stored state ({type(e).__name__}: "
                                  f"{e})", path=where) from e
        return
    copy_tensors(pairs)


def match_names(model: torch.nn.Module, target: Mapping[str, Any], stored: set[str], where: str) -> dict[str, str]:
    """Model state key -> stored name: canonical names (wrappers' attributes dropped) on both sides; the
    model's own keys for a step saved from the same wrapping before names were canonical; or such a step's
    names with the wrappers' attributes stripped."""
    canon = canonical_keys(model, target)
    if set(canon.values()) == stored and len(canon) == len(stored):
        return canon
    if set(target) == stored:
        return {k: k for k in target}
    stripped = strip_wrapper_names(stored)
    back = {v: k for k, v in stripped.items()}
    if len(back) == len(stored) and set(back) == set(canon.values()):
        return {k: back[c] for k, c in canon.items()}
    have, saved = set(canon.values()), set(back) if len(back) == len(stored) else stored
    missing, unexpected = sorted(have - saved), sorted(saved - have)
    raise CheckpointError(f"model keys differ from the checkpoint: {len(missing)} missing {missing[:5]}, "
                          f"{len(unexpected)} unexpected {unexpected[:5]}", path=where)


def check_fits(name: str, shape: list[int], dtype: torch.dtype, dst: torch.Tensor, where: str) -> None:
    """A stored tensor of ``shape`` and ``dtype`` can be copied into the model's ``dst`` (the same shape;
    a dtype that changes precision only, never float into int): else a CheckpointError naming it."""
    if list(shape) != list(dst.shape):
        raise CheckpointError(f"{name!r} has shape {list(shape)} in the checkpoint, {list(dst.shape)} in "
                              "the model", path=where)
    if _lossy(dtype, dst.dtype):
        raise CheckpointError(f"{name!r} is {str(dtype).removeprefix('torch.')} in the checkpoint, "
                              f"{str(dst.dtype).removeprefix('torch.')} in the model: the copy would lose "
                              "values (convert the model or the checkpoint)", path=where)


def _lossy(src: torch.dtype, dst: torch.dtype) -> bool:
    """A copy from ``src`` to ``dst`` that drops values, not only precision: complex to real, a
    floating-point value to an integer or bool, an integer to bool."""
    if src.is_complex:
        return not dst.is_complex
    if src.is_floating_point:
        return not (dst.is_floating_point or dst.is_complex)
    return src != torch.bool and dst == torch.bool


def _needs_load_state_dict(model: torch.nn.Module, target: Mapping[str, Any]) -> bool:
    live = {id(t) for t in itertools.chain(model.parameters(), model.buffers())}
    if any(id(t) not in live for t in target.values()):  # extra state, a hook's copies
        return True
    return any(m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks for m in model.modules())


def tied_apart(first: str, second: str, where: str) -> CheckpointError:
    """The error for a model that ties two tensors which the checkpoint holds with different values."""
    return CheckpointError(f"the model ties {first!r} and {second!r} (one tensor), and the checkpoint holds "
                           "different values for them (saved from a model that did not tie them): restoring "
                           "would keep one and silently drop the other", path=where)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs included), of tensors of one shape."""
    if a.dtype != b.dtype:
        return False
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else t for t in (a, b)]
    return torch.equal(*flat)


def check_group_sizes(opt: torch.optim.Optimizer, stored_groups: Any, where: str) -> None:
    """The optimizer's param groups hold as many parameters as the stored ones (stored: a list of dicts
    with a ``params`` list; anything else differs). Torch's loaders fold groups that differ into one."""
    stored = [len(g["params"]) if isinstance(g, dict) and isinstance(g.get("params"), list) else None
              for g in stored_groups] if isinstance(stored_groups, list) else None
    have = [len(g["params"]) for g in opt.param_groups]
    if stored != have:
        raise CheckpointError(f"optimizer has groups of sizes {have}, the checkpoint {stored}", path=where)


def memory_key(t: torch.Tensor) -> tuple:
    """What makes two tensors one (tied weights): the same memory, offset, shape and strides."""
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride()


def check_optimizer(opt: torch.optim.Optimizer, saved: dict[str, Any], where: str) -> tuple[dict, dict]:
    """Whether the stored state fits ``opt`` (its groups' sizes, every state entry's parameter): checked
    before a restore changes anything. Returns stored parameter id -> parameter, and -> its group."""
    check_group_sizes(opt, saved["param_groups"], where)
    groups, sgroups = opt.param_groups, saved["param_groups"]
    index, group_of = {}, {}
    for g, s in zip(groups, sgroups):
        for p, i in zip(g["params"], s["params"]):
            index[i] = p
            group_of[i] = g
    stray = [i for i in saved["state"] if i not in index]
    if stray:
        raise CheckpointError(f"optimizer state for parameter {stray[0]} which no group holds", path=where)
    return index, group_of


@torch.no_grad()
def restore_optimizer(opt: torch.optim.Optimizer, saved: dict[str, Any], where: str) -> None:
    """Load a decoded optimizer state dict, copying into existing state tensors where shapes match.

    Follows ``Optimizer.load_state_dict``'s rules: state tensors take the parameter's device (and dtype
    for floating-point parameters), ``step`` stays as stored unless the group is capturable or fused.
    """
    index, group_of = check_optimizer(opt, saved, where)
    groups, sgroups = opt.param_groups, saved["param_groups"]
    state: defaultdict = defaultdict(dict)
    pairs = []
    for i, entry in saved["state"].items():
        p, g = index[i], group_of[i]
        old = opt.state.get(p, {})
        new = {}
        for k, v in entry.items():
            if isinstance(v, torch.Tensor):
                if k == "step":
                    on_device = g.get("capturable") or g.get("fused")
                    dev, dt = (p.device, torch.float32) if on_device else ("cpu", v.dtype)
                else:
                    dev, dt = p.device, p.dtype if p.is_floating_point() else v.dtype
                cur = old.get(k)
                if not (isinstance(cur, torch.Tensor) and cur.shape == v.shape and cur.dtype == dt
                        and cur.device == torch.device(dev)):
                    cur = torch.empty(v.shape, dtype=dt, device=dev)
                pairs.append((cur, v))
                v = cur
            new[k] = v
        state[p] = new
    copy_tensors(pairs)
    for g, s in zip(groups, sgroups):
        for k, v in s.items():
            if k != "params":
                g[k] = v.clone() if isinstance(v, torch.Tensor) else v  # e.g. a tensor lr: not the mmap
    try:
        opt.__setstate__({"state": state, "param_groups": groups})
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # the optimizer's own checks of its state
        raise CheckpointError(f"{type(opt).__name__} rejects the stored optimizer state ({type(e).__name__}: "
                              f"{e})", path=where) from e


def check_loader(loader: Any, state: Any, step: int, where: str) -> None:
    """Refuse, before a restore changes anything, a DataLoader state ``loader`` cannot load (a torchforge
    loader's ``check_state_dict``: another sampler seed or dataset, say) as a CheckpointError naming the step:
    the checkpoint is not damaged, the loader is not the one it was saved from."""
    check = getattr(loader, "check_state_dict", None)
    if not callable(check):
        return
    try:
        check(state)
    except (ValueError, TorchforgeError) as e:
        raise CheckpointError(f"step {step}'s DataLoader state does not fit this loader: {e}", path=where) from e
