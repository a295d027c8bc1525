"""A feature store's folder: the schema, version manifests, and the lock-free claim of a version number.

Layout of a store at ``path``::

    schema.json                         {"format": "torchforge-feature-store", "format_version": 1,
                                         "columns": {"emb": {"shape": [768], "dtype": "F16"}, ...}}
    shards/<writer>-<n>.safetensors     rows one writer wrote: "id" (I64 [rows]) + one tensor per column
    index/<writer>-<commit>-<try>.safetensors   a version's merged id index (see index.py)
    versions/v-00000001.json            one manifest per version (the schema, every shard the version
                                        reads with its size, row count and digest, and its index file)

Every file is written under a temporary name ``.tmp-<host>-<pid>-...`` and only ever named by a
manifest once it is complete and fsynced; a manifest itself appears with ``os.link`` from a complete,
fsynced temporary file, which fails with EEXIST when another committer claimed that number first. So
the highest ``v-N.json`` is always whole, no two commits get one number, and no lock exists between
writers. A writer keeps its completed shards under temporary names too and names them in ``commit()``,
just before it claims the version, so files nobody names (a writer killed before ``commit()``) are
temporary files: ignored by readers and listed by :func:`stale_temp_files` once their process is gone.
Writers are named ``<host>-<pid>-<random>``, and so are the files they name; :func:`clean_leftovers` (run
by every new writer) deletes what dead writers of this host left, named or not, that no version names.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import torch

from torchforge._proc import host_name, pid_alive
from torchforge.errors import CorruptShardError, FormatError, NotFoundError, TorchforgeError
from torchforge.formats.safetensors import DTYPES, fsync_dir
from torchforge.formats.safetensors import open_regular as _open_regular

__all__ = [
    "FORMAT",
    "Column",
    "Manifest",
    "PrunedError",
    "ShardEntry",
    "check_cast",
    "claim_version",
    "column_order",
    "column_spans",
    "list_versions",
    "live_versions",
    "open_regular",
    "pick_columns",
    "prune_versions",
    "read_manifest",
    "read_schema",
    "schema_from_user",
    "temp_name",
    "write_schema",
]

FORMAT = "torchforge-feature-store"
FORMAT_VERSION = 1
SCHEMA_FILE = "schema.json"
SHARDS, INDEX, VERSIONS = "shards", "index", "versions"
DIGEST = "blake2b128-of-4KiB-page-sum64"  # the checkpoint's block digest (torchforge.checkpoint.digest.BlockDigest)
MAX_JSON = 256 << 20  # bytes of a schema or manifest file read at most
_VERSION_RE = re.compile(r"v-(\d{8,})\.json")
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]+\.safetensors")
# dtype codes a column may have: whole bytes per value and a torch dtype
_CODES = {code: dt for code, (bits, dt) in DTYPES.items() if dt is not None and bits % 8 == 0}
_CODE_OF = {dt: code for code, dt in _CODES.items()}


@dataclass(frozen=True)
class Column:
    """One column: the per-row shape and dtype (``code`` is the safetensors dtype code)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def code(self) -> str:
        return _CODE_OF[self.dtype]

    @property
    def row_bytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


Schema = dict[str, Column]


@dataclass(frozen=True)
class ShardEntry:
    """A shard as a manifest lists it (``file`` relative to the store)."""

    file: str
    bytes: int
    rows: int
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "bytes": self.bytes, "rows": self.rows, "digest": self.digest}


@dataclass(frozen=True)
class Manifest:
    """One version: its number, parent, schema, shards (index order = the index's shard numbers) and
    index file entry (None for a version without rows)."""

    version: int
    parent: int
    schema: Schema
    shards: tuple[ShardEntry, ...]
    index: ShardEntry | None
    rows: int
    writer: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "version": self.version,
                "parent": self.parent, "rows": self.rows, "schema": schema_to_json(self.schema),
                "index": None if self.index is None else self.index.to_json(),
                "shards": [s.to_json() for s in self.shards], "writer": self.writer}


# --- schema ------------------------------------------------------------------------------------------
def schema_from_user(schema: Any) -> Schema:
    """Check ``{"name": (shape, dtype)}`` at the API boundary and return it as Columns."""
    if not isinstance(schema, dict) or not schema:
        raise ValueError(f"schema must be a non-empty dict of name -> (shape, dtype), got {schema!r}")
    out: Schema = {}
    for name, spec in schema.items():
        _check_name(name, ValueError)
        if not isinstance(spec, (tuple, list)) or len(spec) != 2:
            raise ValueError(f"schema[{name!r}]={spec!r} must be a (shape, dtype) pair such as ((768,), "
                             "torch.float16)")
        shape, dtype = spec
        if isinstance(shape, int):
            shape = (shape,)
        if not isinstance(shape, (tuple, list, torch.Size)) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"schema[{name!r}] shape {shape!r} must be a tuple of ints >= 0")
        if dtype not in _CODE_OF:
            raise ValueError(f"schema[{name!r}] dtype {dtype!r} is not one of "
                             f"{sorted(str(d).removeprefix('torch.') for d in _CODE_OF)}")
        out[name] = Column(tuple(shape), dtype)
    return out


def pick_columns(schema: Schema, columns: Any) -> list[str]:
    """The column names ``columns`` stands for (one name, several, or None: all of ``schema``), checked."""
    cols = list(schema) if columns is None else [columns] if isinstance(columns, str) else list(columns)
    unknown = [c for c in cols if c not in schema]
    if unknown:
        raise ValueError(f"columns {unknown} are not in the store; it has {sorted(schema)}")
    return cols


def _check_name(name: Any, exc: type[Exception], path: str | None = None) -> None:
    if not isinstance(name, str) or not name or name == "id" or name.startswith("__"):
        msg = f"column name {name!r} must be a non-empty str other than 'id' and not starting with '__'"
        raise exc(msg, path=path) if path is not None else exc(msg)


def schema_to_json(schema: Schema) -> dict[str, Any]:
    return {name: {"shape": list(c.shape), "dtype": c.code} for name, c in schema.items()}


def schema_from_json(doc: Any, path: str) -> Schema:
    if not isinstance(doc, dict) or not doc:
        raise FormatError("the schema must be a non-empty JSON object of columns", path=path)
    out: Schema = {}
    for name, c in doc.items():
        _check_name(name, FormatError, path)
        if not isinstance(c, dict) or c.get("dtype") not in _CODES or not isinstance(c.get("shape"), list) \
                or not all(type(d) is int and 0 <= d < 2**40 for d in c["shape"]):
            raise FormatError(f"column {name!r}: {c!r} is not {{'shape': [ints], 'dtype': one of "
                              f"{sorted(_CODES)}}}", path=path)
        out[name] = Column(tuple(c["shape"]), _CODES[c["dtype"]])
        if len(c["shape"]) > 64 or out[name].row_bytes >= 2**40:  # before any output is sized from it
            raise FormatError(f"column {name!r}: a row of shape {c['shape'][:8]} is more than 64 dimensions "
                              "or 1 TiB", path=path)
    return out


def read_schema(root: str) -> Schema:
    path = os.path.join(root, SCHEMA_FILE)
    doc = _read_json(path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise FormatError(f"not a feature store schema (expected \"format\": {FORMAT!r})", path=path)
    return schema_from_json(doc.get("columns"), path)


def write_schema(root: str, schema: Schema) -> None:
    """Create ``schema.json`` once (exclusively); an existing one must hold the same schema."""
    path = os.path.join(root, SCHEMA_FILE)
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "columns": schema_to_json(schema)}
    if not os.path.exists(path):
        tmp = _write_temp(root, "schema", doc)
        try:
            os.link(tmp, path)
            fsync_dir(root)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    have = read_schema(root)
    if have != schema:
        raise FormatError(f"the store has schema {schema_to_json(have)}, not the {schema_to_json(schema)} "
                          "given; open it without a schema or create a new store", path=path)


# --- manifests ---------------------------------------------------------------------------------------
def version_path(root: str, version: int) -> str:
    return os.path.join(root, VERSIONS, f"v-{version:08d}.json")


def list_versions(root: str) -> list[int]:
    """Every claimed version number, ascending (a claimed manifest is always complete)."""
    try:
        names = os.listdir(os.path.join(root, VERSIONS))
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_VERSION_RE.fullmatch, names) if m)


def live_versions(root: str) -> list[int]:
    """The version numbers not pruned, ascending (reads every manifest)."""
    live = []
    for v in list_versions(root):
        try:
            doc = _read_json(version_path(root, v))
        except TorchforgeError:
            live.append(v)  # (damaged, not pruned: verify says so)
            continue
        if not (isinstance(doc, dict) and doc.get("pruned") is True):
            live.append(v)
    return live


def _entry(doc: Any, folder: str, path: str, what: str) -> ShardEntry:
    if not isinstance(doc, dict):
        raise FormatError(f"{what} entry {doc!r} is not an object", path=path)
    file, size, rows, digest = doc.get("file"), doc.get("bytes"), doc.get("rows"), doc.get("digest")
    if not isinstance(file, str) or not file.startswith(folder + "/") \
            or not _NAME_RE.fullmatch(file[len(folder) + 1:]) or file.endswith("/..") or "/." in file:
        raise FormatError(f"{what} file {file!r} is not a safetensors file name inside {folder}/", path=path)
    if type(size) is not int or size < 8 or type(rows) is not int or rows < 0 or not isinstance(digest, str):
        raise FormatError(f"{what} {file!r}: bytes={size!r}, rows={rows!r}, digest={digest!r} are not "
                          "ints >= 0 and a string", path=path)
    return ShardEntry(file, size, rows, digest)


class PrunedError(NotFoundError):
    """The version was deleted by ``FeatureStore.prune`` (its number stays taken: a tombstone)."""


def read_manifest(root: str, version: int) -> Manifest:
    """The manifest of ``version``, checked field by field (FormatError names the file and field).

    Raises:
        NotFoundError: no such version; PrunedError: it was pruned.
        FormatError: a malformed manifest.
    """
    path = version_path(root, version)
    if not os.path.exists(path):
        have = list_versions(root)
        raise NotFoundError(f"version {version} does not exist (the store has "
                            f"{f'versions 1..{have[-1]}' if have else 'no version yet'})", path=path)
    doc = _read_json(path)
    if isinstance(doc, dict) and doc.get("format") == FORMAT and doc.get("pruned") is True \
            and doc.get("version") == version:
        raise PrunedError(f"version {version} was pruned (FeatureStore.prune keeps the newest versions)", path=path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise FormatError(f"not a feature store manifest (expected \"format\": {FORMAT!r})", path=path)
    if doc.get("version") != version:
        raise FormatError(f"manifest says version {doc.get('version')!r} but is named for {version}", path=path)
    parent, rows = doc.get("parent"), doc.get("rows")
    if type(parent) is not int or not 0 <= parent < version or type(rows) is not int or rows < 0:
        raise FormatError(f"parent={parent!r} and rows={rows!r} must be ints, 0 <= parent < {version}",
                          path=path)
    shards = doc.get("shards")
    if not isinstance(shards, list):
        raise FormatError("\"shards\" must be a list", path=path)
    entries = tuple(_entry(s, SHARDS, path, "shard") for s in shards)
    index = None if doc.get("index") is None else _entry(doc["index"], INDEX, path, "index")
    if (index is None) != (rows == 0):
        raise FormatError(f"a version of {rows} rows must {'' if rows else 'not '}have an index", path=path)
    if index is not None and index.rows != rows:
        raise FormatError(f"the manifest claims {rows} rows but lists an index of {index.rows}", path=path)
    if sum(s.rows for s in entries) < rows:
        raise FormatError(f"the manifest claims {rows} rows but its shards hold "
                          f"{sum(s.rows for s in entries)}", path=path)
    writer = doc.get("writer") if isinstance(doc.get("writer"), dict) else {}
    return Manifest(version, parent, schema_from_json(doc.get("schema"), path), entries, index, rows, writer)


def claim_version(root: str, manifest: Manifest) -> bool:
    """Publish ``manifest`` as ``versions/v-N.json`` if N is still free; False if another commit has it.

    True means published: readers may see the version from then on, so the caller records it as
    committed before anything else can fail, and only then makes the link durable (``fsync_dir`` of
    ``versions/``): a failure of that fsync must not make the caller undo a version others may read."""
    tmp = _write_temp(os.path.join(root, VERSIONS), f"v-{manifest.version}", manifest.to_json())
    try:
        os.link(tmp, version_path(root, manifest.version))
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    return True


# --- files -------------------------------------------------------------------------------------------
def temp_name(folder: str, stem: str, suffix: str = "") -> str:
    """A temporary file name in ``folder`` that says who made it: ``.tmp-<host>-<pid>-<stem>-<rand>``."""
    host = host_name()
    return os.path.join(folder, f".tmp-{host}-{os.getpid()}-{stem}-{uuid.uuid4().hex[:8]}{suffix}")


def stale_temp_files(root: str) -> list[str]:
    """Temporary files under ``root`` left by processes of this host that no longer run."""
    host = host_name()
    pat = re.compile(rf"\.tmp-{re.escape(host)}-(\d+)-")
    out = []
    for sub in (SHARDS, INDEX, VERSIONS, ""):
        folder = os.path.join(root, sub)
        for name in os.listdir(folder) if os.path.isdir(folder) else ():
            m = pat.match(name)
            if m and not pid_alive(int(m.group(1))):
                out.append(os.path.join(folder, name))
    return out


def writer_name() -> str:
    """A new writer's name, ``<host>-<pid>-<random>``: the files it names before its commit claims a
    version (its shards and id index) say whose they are, so a writer killed there leaves nothing that
    :func:`clean_leftovers` cannot attribute."""
    return f"{host_name()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def clean_leftovers(root: str) -> list[str]:
    """Delete what writers of this host that no longer run left behind: their temporary files (killed
    while writing) and the shards and id index they named for a commit whose version they never claimed
    (killed inside ``commit()``); returns the paths deleted. Another host's files are never touched (its
    processes cannot be checked), nor a file any version names, nor anything while a manifest cannot be
    read."""
    gone = stale_temp_files(root)
    mine = re.compile(rf"{re.escape(host_name())}-(\d+)-[0-9a-f]{{8}}-")
    named: list[str] = []
    for sub in (SHARDS, INDEX):
        folder = os.path.join(root, sub)
        for name in os.listdir(folder) if os.path.isdir(folder) else ():
            m = mine.match(name)
            if m and not pid_alive(int(m.group(1))):
                named.append(f"{sub}/{name}")
    if named:
        used: set[str] = set()
        try:
            for v in reversed(list_versions(root)):  # newest first: the latest names most of them
                try:
                    manifest = read_manifest(root, v)
                except PrunedError:
                    continue
                used.update(e.file for e in manifest.shards)
                if manifest.index is not None:
                    used.add(manifest.index.file)
                if used.issuperset(named):
                    break
        except TorchforgeError:
            named = []
        gone += [os.path.join(root, n) for n in named if n not in used]
    for path in gone:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return gone


def _write_temp(folder: str, stem: str, doc: Any) -> str:
    tmp = temp_name(folder, stem, ".json")
    data = json.dumps(doc, indent=1).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return tmp


def open_regular(path: str) -> BinaryIO:
    """``path`` opened for reading; a FIFO, device or folder is a CorruptShardError (see
    :func:`torchforge.formats.safetensors.open_regular`)."""
    return _open_regular(path, CorruptShardError)


def _read_json(path: str) -> Any:
    try:
        with open_regular(path) as f:
            data = f.read(MAX_JSON + 1)
    except FileNotFoundError:
        raise NotFoundError("no such file: not a feature store (or not one yet)", path=path) from None
    if len(data) > MAX_JSON:
        raise FormatError(f"larger than the {MAX_JSON}-byte limit of a schema or manifest", path=path)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON, bad UTF-8, an int of > 4300 digits
        raise FormatError(f"not valid JSON: {e}", path=path, offset=getattr(e, "pos", None)) from None


def as_values(v: Any) -> torch.Tensor:
    """A column's values (or a ``missing=`` default) as a tensor, before the cast to the column's dtype:
    a numpy array or scalar as it is (its byte order made native), anything else through
    ``torch.as_tensor``, or as uint64 where it holds ints past int64 (a uint64 column's ``2**64 - 1``)."""
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, (np.ndarray, np.generic)) and v.dtype.kind in "biufc":
        native = np.dtype(f"{v.dtype.kind}{v.dtype.itemsize}")  # native order, numpy's canonical type
        return torch.from_numpy(np.ascontiguousarray(v, native).reshape(np.shape(v)))  # (a scalar stays 0-d)
    try:
        return torch.as_tensor(v)
    except (OverflowError, RuntimeError, ValueError):  # ints past int64 (one, or a list's)
        a = np.asarray(v, dtype=object)
        ints = a.size and all(type(x) is int for x in a.flat)
        if not ints or min(a.flat) < 0 or max(a.flat) >= 2**64:
            raise
        return as_values(a.astype(np.uint64))


def check_cast(v: torch.Tensor, out: torch.Tensor, name: str, ids: np.ndarray | None = None) -> None:
    """Refuse values an integer or bool column cannot hold (``out`` is ``v`` converted): 1000 into int8
    wrapped to -24, 2.7 into uint8 became 2, NaN into an integer. A floating column rounds as torch's casts
    do (a value past float16's range is inf there, as ``.half()`` makes it).

    Raises:
        ValueError: naming the column, the value and, where given, its row's id.
    """
    if v.dtype == out.dtype or not v.numel() or out.dtype.is_floating_point or out.dtype.is_complex:
        return
    bad = out.to(device=v.device, dtype=v.dtype) != v
    if v.dtype.is_floating_point or v.dtype.is_complex:
        bad |= torch.isnan(v)
    elif out.dtype != torch.bool and v.dtype != torch.bool and v.dtype.is_signed != out.dtype.is_signed:
        # between integers of one width the cast back is exact (-1 -> 255 -> -1): the sign tells
        bad |= (v < 0) if v.dtype.is_signed else (out < 0)
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        where = f" (row of id {int(ids[at[0]])})" if ids is not None and len(at) and at[0] < len(ids) else ""
        raise ValueError(f"column {name!r} ({out.dtype}) cannot hold the value {v[at].item()!r}{where}: it would "
                         f"be stored as {out[at].item()!r}")


_STREAM_MIN = 64  # row bytes from which a column is streamed rather than buffered


def column_order(schema: Schema) -> tuple[str | None, list[str]]:
    """A shard's layout, the writer's and what the reader checks: ``(stream, rest)``. The stream column is
    the widest, if wide enough and a multiple of every alignment (so the columns after it stay aligned); it
    comes first, then ``"id"`` and the buffered columns, widest dtype first (as safetensors), then by name."""
    widths = {"id": 8, **{c: col.dtype.itemsize for c, col in schema.items()}}
    align = max(widths.values())
    wide = [c for c, col in schema.items() if col.row_bytes >= _STREAM_MIN and col.row_bytes % align == 0]
    stream = max(wide, key=lambda c: schema[c].row_bytes) if wide else None
    return stream, sorted((c for c in widths if c != stream), key=lambda c: (-widths[c], c))


def column_spans(schema: Schema, rows: int) -> dict[str, tuple[int, int]]:
    """Where each tensor of a shard of ``rows`` rows lies in its data (``"id"`` included), in the order of
    :func:`column_order`: what the writer's header says and the reader checks."""
    stream, rest = column_order(schema)
    spans, pos = {}, 0
    for name in ([stream] if stream else []) + rest:
        end = pos + rows * (8 if name == "id" else schema[name].row_bytes)
        spans[name], pos = (pos, end), end
    return spans


def prune_versions(root: str, keep: int) -> list[int]:
    """Delete every version but the ``keep`` newest: their manifests first (each becomes a tombstone that keeps
    its number taken; no reader opens the version from then on), then the files only they name (their id indexes; shards no kept version lists). Returns the version
    numbers deleted. A version published meanwhile names files of a kept version or its own, never one of
    these. Every manifest is read before anything is deleted: a damaged one is an error, and nothing changes.

    Raises:
        ValueError: ``keep`` < 1.
        FormatError: a manifest cannot be read.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r} must be an int >= 1 (the newest version is always kept)")
    versions = list_versions(root)
    older, kept = versions[:-keep], versions[-keep:]

    def files(v: int) -> set[str] | None:  # (None: pruned before)
        try:
            m = read_manifest(root, v)
        except PrunedError:
            return None
        return {e.file for e in m.shards} | ({m.index.file} if m.index is not None else set())

    used = set().union(*(f for f in map(files, kept) if f is not None))
    named: set[str] = set()
    gone = []
    for v in older:
        f = files(v)
        if f is not None:
            gone.append(v)
            named |= f
    if not gone:
        return []
    # a tombstone in each manifest's place, never no file: a version number is never claimed twice (a commit
    # whose parent is an older version would otherwise publish its rows under a deleted number, behind the newest)
    folder = os.path.join(root, VERSIONS)
    for v in gone:
        os.replace(_write_temp(folder, f"v-{v}", {"format": FORMAT, "version": v, "pruned": True}),
                   version_path(root, v))
    fsync_dir(folder)
    for f in sorted(named - used):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(root, f))
    for sub in (SHARDS, INDEX):
        fsync_dir(os.path.join(root, sub))
    return gone
