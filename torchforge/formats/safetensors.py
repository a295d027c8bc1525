"""The safetensors format: a strict reader over one mmap and a zero-copy writer.

Layout (https://github.com/huggingface/safetensors): an 8-byte little-endian header length ``n``, ``n``
bytes of UTF-8 JSON mapping tensor names to ``{"dtype", "shape", "data_offsets"}`` (plus an optional
``"__metadata__"`` string-to-string map), then the data buffer; offsets are relative to the buffer.

The reader accepts exactly what the official Rust reader (``safetensors/src/tensor.rs``, version 0.8)
accepts: header length <= 100 MB and inside the file, strict UTF-8, RFC 8259 JSON (no NaN, no lone
surrogates, nesting below 128), a JSON object, known dtypes, unsigned integer shapes and offsets,
offsets contiguous from 0 without gap or overlap, each size equal to shape x dtype (no partial bytes),
and a buffer ending exactly at the end of the file. Every failure is a :class:`SafetensorsError` whose
``kind`` names the official error variant and whose ``offset`` is the byte in the file concerned.

>>> save_safetensors({"w": torch.ones(2, 3)}, "/tmp/w.safetensors")  # doctest: +SKIP
>>> load_safetensors("/tmp/w.safetensors")["w"].sum()  # doctest: +SKIP
tensor(6.)
"""
# ruff: noqa: TRY004 - header type errors are ValueErrors turned into SafetensorsError (a ValueError) below
from __future__ import annotations

import json
import mmap
import os
import stat
import struct
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from torchforge.errors import SafetensorsError, TorchforgeError

__all__ = ["DTYPES", "SafetensorsFile", "TensorInfo", "load_safetensors", "open_regular", "read_header",
           "save_safetensors"]

MAX_HEADER_SIZE = 100_000_000
_U64_MAX = 2**64 - 1
_MAX_DEPTH = 127  # serde_json refuses the 128th nested container

# Official dtype codes in the official enum order (the writer sorts by this order, descending), with the
# element size in bits and the torch dtype (None where torch has none: F6 values are returned as raw bytes).
DTYPES: dict[str, tuple[int, torch.dtype | None]] = {
    "BOOL": (8, torch.bool),
    "F4": (4, getattr(torch, "float4_e2m1fn_x2", None)),
    "F6_E2M3": (6, None),
    "F6_E3M2": (6, None),
    "U8": (8, torch.uint8),
    "I8": (8, torch.int8),
    "F8_E5M2": (8, getattr(torch, "float8_e5m2", None)),
    "F8_E4M3": (8, getattr(torch, "float8_e4m3fn", None)),
    "F8_E8M0": (8, getattr(torch, "float8_e8m0fnu", None)),
    "F8_E4M3FNUZ": (8, getattr(torch, "float8_e4m3fnuz", None)),
    "F8_E5M2FNUZ": (8, getattr(torch, "float8_e5m2fnuz", None)),
    "I16": (16, torch.int16),
    "U16": (16, getattr(torch, "uint16", None)),
    "F16": (16, torch.float16),
    "BF16": (16, torch.bfloat16),
    "I32": (32, torch.int32),
    "U32": (32, getattr(torch, "uint32", None)),
    "F32": (32, torch.float32),
    "C64": (64, torch.complex64),
    "F64": (64, torch.float64),
    "I64": (64, torch.int64),
    "U64": (64, getattr(torch, "uint64", None)),
}
_ORDER = {code: i for i, code in enumerate(DTYPES)}
_CODE_OF: dict[torch.dtype, str] = {dt: code for code, (_, dt) in DTYPES.items() if dt is not None}
_F4 = DTYPES["F4"][1]
_umask_lock = threading.Lock()


def _umask() -> int:
    """The process's current umask, read without changing it where the kernel says it (Linux 4.7+:
    ``/proc/self/status``); elsewhere set and restored at once, under a lock."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: dtype code, logical shape, and data offsets relative to the buffer start."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _err(kind: str, reason: str, path: str | None, offset: int | None) -> SafetensorsError:
    e = SafetensorsError(f"{reason} [{kind}]", path=path, offset=offset)
    e.kind = kind  # the official SafeTensorError variant this corresponds to
    return e


# --- header parsing ----------------------------------------------------------------------------------
class _Bad:
    """A JSON value that serde_json would not turn into a usize (negative, float, too large)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _parse_int(s: str) -> int | _Bad:
    v = int(s)
    return _Bad(s) if s.startswith("-") or v > _U64_MAX else v  # "-0" is a float to serde_json


def _parse_float(s: str) -> _Bad:
    if float(s) in (float("inf"), float("-inf")):
        raise ValueError(f"number out of range: {s}")
    return _Bad(s)


def _no_constant(s: str) -> Any:
    raise ValueError(f"{s} is not JSON")


class _Obj:
    """An object's key/value pairs in file order (duplicates kept, resolved like serde)."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: list[tuple[str, Any]]):
        self.pairs = pairs

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)


def _check_strings_and_depth(v: Any, depth: int) -> None:
    if isinstance(v, str):
        v.encode("utf-8")  # lone surrogates (from \\udXXX escapes) raise, as serde_json refuses them
    elif isinstance(v, (list, _Obj)):
        if depth > _MAX_DEPTH:
            raise ValueError("recursion limit exceeded")
        for x in v:
            if isinstance(v, _Obj):
                x[0].encode("utf-8")
                _check_strings_and_depth(x[1], depth + 1)
            else:
                _check_strings_and_depth(x, depth + 1)


def _usize(v: Any, what: str) -> int:
    if type(v) is not int:  # bool, float, None, str, _Bad are all refused by serde
        raise ValueError(f"invalid type: {v!r}, expected usize for {what}")
    return v


def _usize_list(v: Any, what: str, n: int | None = None) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise ValueError(f"invalid type: expected a sequence for {what}")
    if n is not None and len(v) != n:
        raise ValueError(f"invalid length {len(v)}, expected {n} elements in {what}")
    return tuple(_usize(x, what) for x in v)


def _dtype(v: Any, name: str) -> str:
    if isinstance(v, _Obj):  # serde also takes the externally tagged form {"F32": null}
        if len(v) != 1:
            raise ValueError(f"dtype of {name!r}: expected map with a single key")
        if v.pairs[0][1] is not None:
            raise ValueError(f"dtype of {name!r}: expected unit variant")
        v = v.pairs[0][0]
    if not isinstance(v, str):
        raise ValueError(f"dtype of {name!r}: expected string or map")
    if v not in DTYPES:
        raise ValueError(f"unknown dtype {v!r} of tensor {name!r}, expected one of {list(DTYPES)}")
    return v


def _tensor_info(name: str, v: Any) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    if isinstance(v, list):  # serde's sequence form of a struct: [dtype, shape, data_offsets]
        if len(v) != 3:
            raise ValueError(f"tensor {name!r}: invalid length {len(v)}, expected 3 elements")
        fields = dict(zip(("dtype", "shape", "data_offsets"), v))
    elif isinstance(v, _Obj):
        fields = {}
        for k, x in v:
            if k in ("dtype", "shape", "data_offsets"):
                if k in fields:
                    raise ValueError(f"tensor {name!r}: duplicate field {k!r}")
                fields[k] = x
        for k in ("dtype", "shape", "data_offsets"):
            if k not in fields:
                raise ValueError(f"tensor {name!r}: missing field {k!r}")
    else:
        raise ValueError(f"tensor {name!r}: invalid type, expected struct TensorInfo")
    return (_dtype(fields["dtype"], name), _usize_list(fields["shape"], f"shape of {name!r}"),
            _usize_list(fields["data_offsets"], f"data_offsets of {name!r}", 2))


def _nbytes(dtype: str, shape: Sequence[int]) -> int | None:
    """Bytes of a tensor, None on u64 overflow; -1 when the bits do not end on a byte boundary."""
    n = 1
    for d in shape:
        n *= d
        if n > _U64_MAX:
            return None
    bits = n * DTYPES[dtype][0]
    if bits > _U64_MAX:
        return None
    return -1 if bits % 8 else bits // 8


def parse_header(head: bytes, file_size: int, path: str | None = None
                 ) -> tuple[int, dict[str, TensorInfo], dict[str, str] | None]:
    """Validate a safetensors header exactly as the official reader does.

    Args:
        head: the file's first ``8 + n`` bytes (or fewer if the file is shorter).
        file_size: the total size of the file.
        path: the file name used in errors.

    Returns:
        ``(n, tensors, metadata)``: the header length, the entries by name (in data order), and the
        ``__metadata__`` map or None.

    Raises:
        SafetensorsError: with ``kind`` one of HeaderTooSmall, HeaderTooLarge, InvalidHeaderLength,
            InvalidHeader (UTF-8), InvalidHeaderDeserialization (JSON and types), InvalidOffset,
            ValidationOverflow, MisalignedSlice, TensorInvalidInfo, MetadataIncompleteBuffer.
    """
    if file_size < 8 or len(head) < 8:
        raise _err("HeaderTooSmall", f"file of {file_size} bytes is shorter than the 8-byte header length",
                   path, 0)
    (n,) = struct.unpack_from("<Q", head)
    if n > MAX_HEADER_SIZE:
        raise _err("HeaderTooLarge", f"header length {n} exceeds {MAX_HEADER_SIZE}", path, 0)
    if 8 + n > file_size or len(head) < 8 + n:
        raise _err("InvalidHeaderLength", f"header length {n} runs past the end of the {file_size}-byte file",
                   path, 0)
    try:
        text = bytes(head[8:8 + n]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise _err("InvalidHeader", f"header is not UTF-8: {e.reason}", path, 8 + e.start) from None
    try:
        doc = json.loads(text, object_pairs_hook=_Obj, parse_int=_parse_int, parse_float=_parse_float,
                         parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise _err("InvalidHeaderDeserialization", f"header is not JSON: {e.msg}", path,
                   8 + len(text[:e.pos].encode("utf-8", "surrogatepass"))) from None
    except (ValueError, RecursionError) as e:
        raise _err("InvalidHeaderDeserialization", f"header is not JSON: {e}", path, 8) from None
    try:
        _check_strings_and_depth(doc, 1)
        if not isinstance(doc, _Obj):
            raise ValueError(f"header is a JSON {type(doc).__name__}, expected an object")
        metadata: dict[str, str] | None = None
        seen_meta = False
        raw: dict[str, Any] = {}
        for k, v in doc:
            if k == "__metadata__":
                if seen_meta:
                    raise ValueError("duplicate field '__metadata__'")
                seen_meta = True
                if v is not None:
                    if not isinstance(v, _Obj):
                        raise ValueError("__metadata__ must be a map of strings to strings")
                    if not all(isinstance(x, str) for _, x in v):
                        raise ValueError("__metadata__ values must be strings")
                    metadata = dict(v)
            else:
                raw[k] = v  # a repeated tensor name: the last entry wins, as in the official reader
        parsed = {k: _tensor_info(k, v) for k, v in raw.items()}
    except (ValueError, UnicodeEncodeError) as e:
        raise _err("InvalidHeaderDeserialization", f"invalid header: {e}", path, 8) from None

    data_start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    pos = 0
    for name, (dtype, shape, (s, e)) in sorted(parsed.items(), key=lambda kv: kv[1][2]):
        if s != pos or e < s:
            raise _err("InvalidOffset", f"tensor {name!r} has data_offsets [{s}, {e}] but the previous "
                       "tensor "
                       f"ends at {pos} (offsets must be contiguous from 0, without gap or overlap)",
                       path, data_start + min(s, pos))
        pos = e
        size = _nbytes(dtype, shape)
        if size is None:
            raise _err("ValidationOverflow", f"tensor {name!r}: shape {list(shape)} x {dtype} overflows "
                       "64 bits",
                       path, data_start + s)
        if size < 0:
            raise _err("MisalignedSlice", f"tensor {name!r}: {list(shape)} x {dtype} does not end on a byte",
                       path, data_start + s)
        if e - s != size:
            raise _err("TensorInvalidInfo", f"tensor {name!r}: {dtype} {list(shape)} needs {size} bytes but "
                       f"data_offsets [{s}, {e}] hold {e - s}", path, data_start + s)
        tensors[name] = TensorInfo(dtype, shape, s, e)
    if data_start + pos != file_size:
        raise _err("MetadataIncompleteBuffer", f"tensor data ends at byte {data_start + pos} but the file "
                   "has "
                   f"{file_size} bytes ({'trailing bytes' if data_start + pos < file_size else 'truncated'})",
                   path, min(data_start + pos, file_size))
    return n, tensors, metadata


def open_regular(path: str, error: type[TorchforgeError] = SafetensorsError) -> BinaryIO:
    """``path`` opened for reading, refusing what is not a regular file (opening a FIFO would block for ever).

    Raises:
        FileNotFoundError: as ``open()``.
        ``error``: a FIFO, a device or a folder (naming the path).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error("not a regular file (a FIFO, a device or a folder) where a file is expected", path=path)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_header(path: str | os.PathLike) -> tuple[int, dict[str, TensorInfo], dict[str, str] | None]:
    """Read and validate the header of a safetensors file without mapping its data (see parse_header)."""
    path = os.fspath(path)
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) == 8:
            (n,) = struct.unpack("<Q", head)
            if n <= MAX_HEADER_SIZE and 8 + n <= size:
                head += f.read(n)
        return parse_header(head, size, path)


# --- reading -----------------------------------------------------------------------------------------
def storage_shape(info: TensorInfo, path: str) -> tuple[torch.dtype, tuple[int, ...]]:
    """The torch dtype and shape a header entry is exposed as."""
    dt = DTYPES[info.dtype][1]
    if any(d >= 2**63 for d in info.shape):
        raise SafetensorsError(f"shape {list(info.shape)} has a dimension torch cannot hold (>= 2**63)",
                               path=path)
    if dt is None:  # F6 (and float8 on an old torch): the raw bytes
        return torch.uint8, (info.end - info.start,)
    if info.dtype == "F4":  # two values per byte: torch's float4_e2m1fn_x2 halves the last dimension
        if not info.shape or info.shape[-1] % 2:
            raise _err("MisalignedSlice", f"F4 tensor of shape {list(info.shape)} needs an even last "
                       "dimension "
                       "to be a torch float4_e2m1fn_x2 tensor", path, None)
        return dt, info.shape[:-1] + (info.shape[-1] // 2,)
    return dt, info.shape


class SafetensorsFile(Mapping):
    """A read-only Mapping of tensor name -> zero-copy tensor over one private mmap of the file.

    The file is never written: tensors are backed by a copy-on-write mapping, so an in-place write to a
    returned tensor copies the touched pages into private memory. ``metadata`` is the ``__metadata__``
    map; ``infos`` the header entries (dtype code, logical shape, offsets).
    """

    def __init__(self, path: str | os.PathLike, *, lazy: bool = True):
        self.path = os.fspath(path)
        if sys.byteorder != "little":
            raise SafetensorsError("safetensors data is little-endian; big-endian hosts are not supported",
                                   path=self.path)
        with open_regular(self.path) as f:
            size = os.fstat(f.fileno()).st_size
            if lazy:
                self._buf: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
            else:
                self._buf = bytearray(size)
                f.readinto(self._buf)
        self.header_len, self.infos, self.metadata = parse_header(memoryview(self._buf)[:8 + min(
            MAX_HEADER_SIZE, max(0, size - 8))], size, self.path)
        self.data_start = 8 + self.header_len
        self._cache: dict[str, torch.Tensor] = {}
        if not lazy:
            for k in self.infos:
                self[k]

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._cache.get(name)
        if t is None:
            info = self.infos[name]
            dtype, shape = storage_shape(info, self.path)
            count = info.end - info.start
            if count == 0:
                # a view, as the official reader makes: torch.empty's strides of [1, 0, 2**62, 2**62] overflow
                t = torch.empty(0, dtype=dtype).view(shape)
            else:
                t = torch.frombuffer(self._buf, dtype=torch.uint8, count=count,
                                     offset=self.data_start + info.start)
                t = t.view(dtype) if _aligned(self.data_start + info.start, dtype) else t.clone().view(dtype)
                t = t.view(shape)
            self._cache[name] = t
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self.infos)

    def __reduce__(self) -> tuple[Any, ...]:
        # Sent to another process by path: the receiver maps the file itself.
        return (_reopen, (self.path, isinstance(self._buf, mmap.mmap)))

    def __len__(self) -> int:
        return len(self.infos)

    def __repr__(self) -> str:
        return f"SafetensorsFile({self.path!r}, {len(self)} tensors)"


def _reopen(path: str, lazy: bool) -> SafetensorsFile:
    return SafetensorsFile(path, lazy=lazy)


def _aligned(offset: int, dtype: torch.dtype) -> bool:
    return offset % max(1, dtype.itemsize) == 0


def load_safetensors(path: str | os.PathLike, *, lazy: bool = True) -> SafetensorsFile:
    """Open a safetensors file.

    Args:
        path: the file.
        lazy: True (default) maps the file (one mmap, zero-copy views made on first access); False reads
            the whole file into memory at once and builds every tensor now (the file may then change).

    Returns:
        A Mapping of name -> tensor with ``.metadata`` (the ``__metadata__`` map or None). Tensors whose
        data offset is not a multiple of their element size (files not written by the official writer
        or by torchforge) are copied.

    Raises:
        SafetensorsError: the file violates the format (see :func:`parse_header`).
    """
    return SafetensorsFile(path, lazy=lazy)


# --- writing -----------------------------------------------------------------------------------------
def tensor_code(t: torch.Tensor) -> str:
    """The safetensors dtype code of a torch tensor."""
    code = _CODE_OF.get(t.dtype)
    if code is None:
        raise SafetensorsError(f"{t.dtype} has no safetensors dtype; supported: {sorted(map(str, _CODE_OF))}")
    return code


def logical_shape(t: torch.Tensor) -> list[int]:
    """The header shape of a tensor (F4 records two values per byte)."""
    shape = list(t.shape)
    if t.dtype == _F4 and _F4 is not None:
        if not shape:
            raise SafetensorsError("a 0-dim float4_e2m1fn_x2 tensor cannot be stored (no last dimension)")
        shape[-1] *= 2
    return shape


def as_bytes(t: torch.Tensor) -> memoryview:
    """The C-order bytes of a contiguous CPU tensor, without copying (but for a lazily conjugated or
    negated view, ``x.conj()``, whose stored bytes are not its values: those are resolved into a copy)."""
    if t.numel() == 0:
        return memoryview(b"")
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def plan(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None, *,
         align: bool = False) -> tuple[bytes, list[tuple[str, torch.Tensor, int]]]:
    """Lay out a file: the 8-byte length + padded JSON header, and (name, tensor, file offset) in order.

    The order and header bytes are those of the official writer (dtype alignment descending, then name;
    header padded with spaces to a multiple of 8), so the files are byte-identical to its output.

    With ``align`` (checkpoint files, which promise no byte identity): the header is padded so the data
    starts at a multiple of 64 bytes, and tensors whose size is a multiple of 64 bytes come first, so each
    of them starts on a cache line of the file, of a buffer laid out like it and of a page-aligned mmap:
    copying to or from a misaligned address is about 20% slower (a 0-dim ``step`` placed between two
    layers misaligns every layer after it).
    """
    if metadata is not None and (not isinstance(metadata, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise SafetensorsError("metadata must be a mapping of str to str")
    items = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise SafetensorsError(f"tensor names must be str, got {type(name).__name__}")
        if name == "__metadata__":
            raise SafetensorsError("'__metadata__' is reserved and cannot name a tensor")
        if not isinstance(t, torch.Tensor):
            raise SafetensorsError(f"{name!r} is a {type(t).__name__}, expected a torch.Tensor")
        items.append((name, t, tensor_code(t)))
    if align:
        items.sort(key=lambda x: (x[1].numel() * x[1].element_size() % 64 != 0, -_ORDER[x[2]], x[0]))
    else:
        items.sort(key=lambda x: (-_ORDER[x[2]], x[0]))
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = dict(sorted(metadata.items()))
    pos = 0
    layout = []
    for name, t, code in items:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": logical_shape(t), "data_offsets": [pos, pos + n]}
        layout.append((name, t, pos))
        pos += n
    hb = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    hb += b" " * (-(len(hb) + 8) % 64 if align else -len(hb) % 8)
    if len(hb) > MAX_HEADER_SIZE:
        raise SafetensorsError(f"header of {len(hb)} bytes exceeds {MAX_HEADER_SIZE}")
    head = struct.pack("<Q", len(hb)) + hb
    return head, [(name, t, len(head) + off) for name, t, off in layout]


def write_all(fd: int, views: Sequence[memoryview], offset: int) -> None:
    """pwritev every byte of ``views`` at ``offset``, resuming after partial writes."""
    pending = [v for v in views if len(v)]
    while pending:
        batch = pending[:512]
        n = os.pwritev(fd, batch, offset)
        offset += n
        while n:
            if n >= len(pending[0]):
                n -= len(pending.pop(0))
            else:
                pending[0] = pending[0][n:]
                n = 0


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
                     metadata: Mapping[str, str] | None = None, *, fsync: bool = False) -> None:
    """Write tensors to a safetensors file the official library reads (byte-identical to its writer).

    Data goes straight from tensor memory to the file (no intermediate copy for contiguous CPU tensors),
    into a temporary sibling renamed into place, so an existing file (or a mapping of it) is never
    truncated. Tensors sharing memory are each written in full.

    Args:
        tensors: name -> tensor (any device; non-contiguous ones are made contiguous first).
        path: destination.
        metadata: optional ``__metadata__`` string-to-string map.
        fsync: flush the file and its folder to disk before returning.
    """
    path = os.fspath(path)
    prepared = {k: v.detach().cpu().contiguous() if isinstance(v, torch.Tensor) else v
                for k, v in tensors.items()}
    head, layout = plan(prepared, metadata)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".safetensors")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the mode open() would
        write_all(fd, [memoryview(head)] + [as_bytes(t) for _, t, _ in layout], 0)
        if fsync:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
        if fsync:
            fsync_dir(folder)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def fsync_dir(folder: str) -> None:
    """fsync a folder so the names created or renamed in it are durable."""
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
