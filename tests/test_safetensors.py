"""torchforge.formats.safetensors: interop with the official package, and its exact strictness."""
# ruff: noqa: UP031 - the malformed headers are JSON templates full of braces: %-formatting keeps them legible
from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from typing import Any

import pytest
import safetensors
import safetensors.torch as st
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from torchforge.errors import SafetensorsError, TorchforgeError
from torchforge.formats.safetensors import (
    DTYPES,
    load_safetensors,
    parse_header,
    read_header,
    save_safetensors,
)

TORCH_CODES = [c for c, (_, dt) in DTYPES.items() if dt is not None]


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)


def _every_dtype(seed: int = 0) -> dict[str, torch.Tensor]:
    out = {}
    for i, code in enumerate(TORCH_CODES):
        dt = DTYPES[code][1]
        out[f"t_{code}"] = _random(dt, (3, 4), seed + i)
        out[f"s_{code}"] = _random(dt, (), seed + 100 + i) if code != "F4" else _random(dt, (1,), seed + 100)
        out[f"e_{code}"] = _random(dt, (0, 5), seed)
    return out


def test_every_dtype_official_writes_we_read(tmp_path):
    tensors = _every_dtype()
    p = tmp_path / "official.safetensors"
    st.save_file(tensors, p, metadata={"who": "official", "n": "1"})
    got = load_safetensors(p)
    assert got.metadata == {"who": "official", "n": "1"}
    assert set(got) == set(tensors)
    for k, v in tensors.items():
        assert _same(got[k], v), k
    assert {got.infos[f"t_{c}"].dtype for c in TORCH_CODES} == set(TORCH_CODES)


def test_every_dtype_we_write_official_reads_byte_identical(tmp_path):
    tensors = _every_dtype(7)
    p = tmp_path / "ours.safetensors"
    save_safetensors(tensors, p)
    assert p.read_bytes() == st.save(tensors)  # same layout and header bytes as the official writer
    with safetensors.safe_open(p, framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        for k, v in tensors.items():
            assert _same(f.get_tensor(k), v), k
    save_safetensors(tensors, p, metadata={"a": "b", "ü": "\n"}, fsync=True)
    with safetensors.safe_open(p, framework="pt") as f:
        assert f.metadata() == {"a": "b", "ü": "\n"}
    assert load_safetensors(p, lazy=False).metadata == {"a": "b", "ü": "\n"}


def test_non_contiguous_and_views(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {"t": base.t(), "slice": base[:, 1:3], "view": base[1]}
    p = tmp_path / "v.safetensors"
    save_safetensors(tensors, p)
    official = st.load_file(p)
    for k, v in tensors.items():
        assert torch.equal(official[k], v) and torch.equal(load_safetensors(p)[k], v)


def test_zero_copy_over_one_mmap_and_file_never_written(tmp_path):
    p = tmp_path / "z.safetensors"
    save_safetensors({"a": torch.arange(16, dtype=torch.float32), "b": torch.arange(8, dtype=torch.int64)}, p)
    before = p.read_bytes()
    f = load_safetensors(p)
    a, b = f["a"], f["b"]
    # both views point into the same mapping at the header-declared offsets
    assert f["a"] is a and abs(a.data_ptr() - b.data_ptr()) == 64  # b (I64, 64 bytes) comes first, then a
    a[0] = 100.0  # copy-on-write: memory changes, the file does not
    assert f["a"][0] == 100.0 and p.read_bytes() == before
    assert load_safetensors(p)["a"][0] == 0.0


def test_f6_and_unaligned_files_the_official_reader_accepts(tmp_path):
    # F6 has no torch dtype: exposed as raw bytes. Offsets not multiple of the element size are copied.
    hdr = json.dumps({"f6": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]},
                      "x": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}}).encode()
    raw = struct.pack("<Q", len(hdr)) + hdr + b"\x01\x02\x03" + struct.pack("<2f", 1.5, -2.0)
    safetensors.deserialize(raw)
    p = tmp_path / "f6.safetensors"
    p.write_bytes(raw)
    f = load_safetensors(p)
    assert f["f6"].dtype == torch.uint8 and f["f6"].tolist() == [1, 2, 3]
    assert f.infos["f6"].dtype == "F6_E2M3" and f.infos["f6"].shape == (4,)
    assert f["x"].tolist() == [1.5, -2.0]


def test_errors_name_path_and_offset(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", 10) + b"{}")
    with pytest.raises(SafetensorsError) as ei:
        load_safetensors(p)
    assert ei.value.path == str(p) and ei.value.offset == 0 and str(p) in str(ei.value)
    assert ei.value.kind == "InvalidHeaderLength"
    with pytest.raises(SafetensorsError):
        read_header(p)
    p.write_bytes(_mk('{"a":{"dtype":"F32","shape":[0,18446744073709551615],"data_offsets":[0,0]}}'))
    f = load_safetensors(p)  # a valid file (the official reader takes it) ...
    with pytest.raises(SafetensorsError, match="cannot hold"):
        f["a"]  # ... but not a torch tensor
    with pytest.raises(SafetensorsError):
        save_safetensors({"a": [1, 2]}, tmp_path / "x.safetensors")
    with pytest.raises(SafetensorsError):
        save_safetensors({"__metadata__": torch.zeros(1)}, tmp_path / "x.safetensors")


# --- strictness: the official reader and ours accept and refuse the same files ---------------------------
def _mk(h: str | bytes, data: bytes = b"") -> bytes:
    hb = h.encode() if isinstance(h, str) else h
    return struct.pack("<Q", len(hb)) + hb + data


T = '"dtype":"F32","shape":[1],"data_offsets":[0,4]'
Z4 = b"\0" * 4
GOOD = _mk('{"a":{%s}}' % T, Z4)

# (name, bytes, official kind we expect)
MALFORMED = [
    ("too small", b"\x01\x02\x03", "HeaderTooSmall"),
    ("empty file", b"", "HeaderTooSmall"),
    ("header too large", struct.pack("<Q", 100_000_001) + b"{}", "HeaderTooLarge"),
    ("header length u64 max", struct.pack("<Q", 2**64 - 1) + b"{}", "HeaderTooLarge"),
    ("length past EOF", struct.pack("<Q", 1000) + b'{"a":1}', "InvalidHeaderLength"),
    ("not UTF-8", _mk(b'{"\xff\xfe":{%s}}' % T.encode(), Z4), "InvalidHeader"),
    ("not JSON", _mk("{not json}", Z4), "InvalidHeaderDeserialization"),
    ("empty header", _mk(""), "InvalidHeaderDeserialization"),
    ("not an object", _mk("[]"), "InvalidHeaderDeserialization"),
    ("a string", _mk('"x"'), "InvalidHeaderDeserialization"),
    ("unknown dtype", _mk('{"a":{"dtype":"F31","shape":[1],"data_offsets":[0,4]}}', Z4),
     "InvalidHeaderDeserialization"),
    ("lowercase dtype", _mk('{"a":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}}', Z4),
     "InvalidHeaderDeserialization"),
    ("gap in offsets", _mk('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                           '"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}', b"\0" * 12), "InvalidOffset"),
    ("overlap in offsets", _mk('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                               '"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', b"\0" * 8), "InvalidOffset"),
    ("not from 0", _mk('{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', b"\0" * 8), "InvalidOffset"),
    ("end before start", _mk('{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},'
                             '"b":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}', b"\0" * 4), "InvalidOffset"),
    ("size mismatch", _mk('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', Z4), "TensorInvalidInfo"),
    ("dtype size mismatch", _mk('{"a":{"dtype":"F64","shape":[1],"data_offsets":[0,4]}}', Z4), "TensorInvalidInfo"),
    ("trailing bytes", GOOD + b"\0", "MetadataIncompleteBuffer"),
    ("truncated data", GOOD[:-1], "MetadataIncompleteBuffer"),
    ("truncated header", GOOD[:20], "InvalidHeaderLength"),
    ("shape overflow", _mk('{"a":{"dtype":"F32","shape":[18446744073709551615,2],"data_offsets":[0,4]}}', Z4),
     "ValidationOverflow"),
    ("bits overflow", _mk('{"a":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]}}'),
     "ValidationOverflow"),
    ("F4 odd count", _mk('{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,1]}}', b"\0"), "MisalignedSlice"),
    ("F6 partial byte", _mk('{"a":{"dtype":"F6_E3M2","shape":[3],"data_offsets":[0,2]}}', b"\0" * 2),
     "MisalignedSlice"),
    ("metadata not strings", _mk('{"__metadata__":{"x":1},"a":{%s}}' % T, Z4), "InvalidHeaderDeserialization"),
    ("metadata a list", _mk('{"__metadata__":[["x","y"]],"a":{%s}}' % T, Z4), "InvalidHeaderDeserialization"),
    ("metadata twice", _mk('{"__metadata__":{},"__metadata__":{},"a":{%s}}' % T, Z4),
     "InvalidHeaderDeserialization"),
    ("field twice", _mk('{"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}', Z4),
     "InvalidHeaderDeserialization"),
    ("missing field", _mk('{"a":{"dtype":"F32","shape":[1]}}', Z4), "InvalidHeaderDeserialization"),
    ("float in shape", _mk('{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}', Z4),
     "InvalidHeaderDeserialization"),
    ("exponent in shape", _mk('{"a":{"dtype":"F32","shape":[1e0],"data_offsets":[0,4]}}', Z4),
     "InvalidHeaderDeserialization"),
    ("bool in shape", _mk('{"a":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}', Z4),
     "InvalidHeaderDeserialization"),
    ("minus zero", _mk('{"a":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}'), "InvalidHeaderDeserialization"),
    ("negative offset", _mk('{"a":{"dtype":"F32","shape":[0],"data_offsets":[-1,0]}}'),
     "InvalidHeaderDeserialization"),
    ("offset beyond u64", _mk('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551616]}}', Z4),
     "InvalidHeaderDeserialization"),
    ("three offsets", _mk('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,4]}}', Z4),
     "InvalidHeaderDeserialization"),
    ("short sequence info", _mk('{"a":["F32",[1]]}', Z4), "InvalidHeaderDeserialization"),
    ("null info", _mk('{"a":null}'), "InvalidHeaderDeserialization"),
    ("float out of range", _mk('{"a":{%s,"z":-1e400}}' % T, Z4), "InvalidHeaderDeserialization"),
    ("NaN", _mk('{"a":{%s,"z":NaN}}' % T, Z4), "InvalidHeaderDeserialization"),
    ("lone surrogate", _mk('{"\\ud800":{%s}}' % T, Z4), "InvalidHeaderDeserialization"),
    ("lone surrogate in ignored field", _mk('{"a":{%s,"z":"\\udc00"}}' % T, Z4), "InvalidHeaderDeserialization"),
    ("control character", _mk('{"a\x01":{%s}}' % T, Z4), "InvalidHeaderDeserialization"),
    ("trailing NUL in header", _mk(b'{"a":{%s}}\x00' % T.encode(), Z4), "InvalidHeaderDeserialization"),
    ("byte order mark", _mk(b'\xef\xbb\xbf{"a":{%s}}' % T.encode(), Z4), "InvalidHeaderDeserialization"),
    ("dtype map with value", _mk('{"a":{"dtype":{"F32":1},"shape":[1],"data_offsets":[0,4]}}', Z4),
     "InvalidHeaderDeserialization"),
    ("dtype map two keys", _mk('{"a":{"dtype":{"F32":null,"I32":null},"shape":[1],"data_offsets":[0,4]}}', Z4),
     "InvalidHeaderDeserialization"),
    ("nesting 128 deep", _mk(('{"a":{%s,"z":' % T) + "[" * 126 + "]" * 126 + "}}", Z4),
     "InvalidHeaderDeserialization"),
]

# Odd files the official reader accepts: so must we.
ACCEPTED = [
    ("plain", GOOD),
    ("empty object", _mk("{}")),
    ("repeated name, last wins", _mk('{"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]},"a":{%s}}' % T, Z4)),
    ("repeated metadata key", _mk('{"__metadata__":{"x":"1","x":"2"},"a":{%s}}' % T, Z4)),
    ("null metadata", _mk('{"__metadata__":null,"a":{%s}}' % T, Z4)),
    ("sequence info", _mk('{"a":["F32",[1],[0,4]]}', Z4)),
    ("tagged dtype", _mk('{"a":{"dtype":{"F32":null},"shape":[1],"data_offsets":[0,4]}}', Z4)),
    ("unknown fields ignored", _mk('{"a":{%s,"z":[1,-5,1e300,100000000000000000000000],"__metadata__":5}}' % T, Z4)),
    ("whitespace around", _mk(' \n{"a":{%s}}\t\r ' % T, Z4)),
    ("surrogate pair", _mk('{"\\ud83d\\ude00":{%s}}' % T, Z4)),
    ("scalar", _mk('{"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}', Z4)),
    ("zero sizes", _mk('{"a":{"dtype":"F32","shape":[0,9223372036854775807],"data_offsets":[0,0]},'
                       '"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', Z4)),
    ("nesting 127 deep", _mk(('{"a":{%s,"z":' % T) + "[" * 125 + "]" * 125 + "}}", Z4)),
    ("F6", _mk('{"a":{"dtype":"F6_E2M3","shape":[4],"data_offsets":[0,3]}}', b"\0" * 3)),
    ("empty name", _mk('{"":{%s}}' % T, Z4)),
]


def _official_accepts(raw: bytes) -> bool:
    try:
        safetensors.deserialize(raw)
        return True
    except Exception:  # noqa: BLE001 - the official binding raises its SafetensorError (not importable)
        return False


@pytest.mark.parametrize("name,raw,kind", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_refused_like_official(tmp_path, name, raw, kind):
    assert not _official_accepts(raw)
    p = tmp_path / "m.safetensors"
    p.write_bytes(raw)
    with pytest.raises(TorchforgeError) as ei:
        load_safetensors(p)
    assert isinstance(ei.value, SafetensorsError) and ei.value.kind == kind
    assert ei.value.path == str(p) and ei.value.offset is not None and 0 <= ei.value.offset <= len(raw)


@pytest.mark.parametrize("name,raw", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_odd_but_valid_accepted_like_official(tmp_path, name, raw):
    assert _official_accepts(raw)
    p = tmp_path / "ok.safetensors"
    p.write_bytes(raw)
    f = load_safetensors(p)
    official = {k: v for k, v in safetensors.deserialize(raw)}
    assert set(f) == set(official)
    for k, v in official.items():
        assert f.infos[k].dtype == v["dtype"] and list(f.infos[k].shape) == v["shape"]
        if v["dtype"] not in ("F6_E2M3", "F6_E3M2"):
            assert _bits(f[k]) == bytes(v["data"])


def _ours_accepts(raw: bytes) -> bool:
    try:
        parse_header(raw, len(raw))
        return True
    except SafetensorsError:
        return False


SEEDS = [GOOD, st.save({"w": torch.ones(2, 3), "b": torch.arange(4, dtype=torch.int16)}, metadata={"k": "v"}),
         _mk('{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"U8","shape":[2],'
             '"data_offsets":[0,2]}}', b"\1\2")]


@settings(max_examples=300, deadline=None)
@given(hs.sampled_from(SEEDS), hs.lists(hs.tuples(hs.sampled_from(["flip", "set", "cut", "add", "del"]),
                                                  hs.integers(0, 10_000), hs.integers(0, 255)), min_size=1, max_size=3))
def test_fuzz_same_verdict_as_official(seed, edits):
    raw = bytearray(seed)
    for op, pos, val in edits:
        if not raw:
            break
        i = pos % len(raw)
        if op == "flip":
            raw[i] ^= 1 << (val % 8)
        elif op == "set":
            raw[i] = val
        elif op == "cut":
            del raw[i:]
        elif op == "add":
            raw.insert(i, val)
        else:
            del raw[i]
    raw = bytes(raw)
    assert _ours_accepts(raw) == _official_accepts(raw), raw


def test_lying_header_length_does_not_read_outside(tmp_path):
    raw = bytearray(GOOD)
    raw[:8] = struct.pack("<Q", len(GOOD))  # claims the whole file (and more) is header
    p = tmp_path / "lie.safetensors"
    p.write_bytes(bytes(raw))
    with pytest.raises(SafetensorsError, match="past the end"):
        load_safetensors(p)
    assert os.path.getsize(p) == len(GOOD)


_json_scalar = hs.one_of(hs.none(), hs.booleans(), hs.integers(-3, 2**64 + 1), hs.floats(allow_nan=False),
                         hs.text(max_size=3))
_dtype_value = hs.one_of(hs.sampled_from(list(DTYPES)), hs.sampled_from(["f32", "F31", "", "BF16 "]), _json_scalar,
                         hs.fixed_dictionaries({"F32": hs.one_of(hs.none(), hs.integers(0, 1))}))
_dim = hs.one_of(hs.integers(0, 5), hs.sampled_from([-1, 1.0, True, None, "2", 2**63, 2**64 - 1, 2**64]))
_entry = hs.one_of(
    hs.fixed_dictionaries({"dtype": _dtype_value, "shape": hs.lists(_dim, max_size=3),
                           "data_offsets": hs.lists(hs.integers(-1, 40), min_size=1, max_size=3)},
                          optional={"extra": _json_scalar}),
    hs.tuples(_dtype_value, hs.lists(_dim, max_size=2), hs.lists(hs.integers(0, 40), min_size=2, max_size=2)).map(list),
    _json_scalar)
_metadata = hs.one_of(hs.none(), hs.dictionaries(hs.text(max_size=3), hs.one_of(hs.text(max_size=3), _json_scalar),
                                                 max_size=2), _json_scalar)


_structured = hs.tuples(hs.dictionaries(hs.sampled_from(["a", "b", "c", "a.offsets"]), _entry, max_size=3),
                        hs.one_of(hs.just(()), hs.tuples(_metadata)), hs.one_of(hs.none(), hs.integers(-2, 48)))


def _structured_verdict(case: tuple) -> bool:
    """Build the file a structured case describes; check that both readers agree; return the verdict."""
    entries, meta, data_len = case
    header = dict(entries)
    if meta:
        header["__metadata__"] = meta[0]
    if data_len is None:  # the length the offsets claim, so that valid headers occur often
        ends = [e["data_offsets"][-1] if isinstance(e, dict) else e[2][-1] if isinstance(e, list) else 0
                for e in entries.values()]
        data_len = max([0] + [x for x in ends if isinstance(x, int)])
    return _same_verdict(json.dumps(header).encode(), b"\0" * max(0, data_len))


def _same_verdict(header: bytes, data: bytes) -> bool:
    """Our reader and the official one accept or reject the file alike; return that verdict."""
    raw = struct.pack("<Q", len(header)) + header + data
    ours = _ours_accepts(raw)
    assert ours == _official_accepts(raw), raw
    return ours


def _verdicts(strategy: hs.SearchStrategy, verdict: Callable[[Any], bool], n: int) -> dict[bool, int]:
    """Run ``verdict`` on ``n`` cases drawn the same way on every run; count the accepted and refused."""
    counts = {True: 0, False: 0}

    @settings(max_examples=n, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(case):
        counts[verdict(case)] += 1

    run()
    return counts


@settings(max_examples=400, deadline=None)
@given(_structured)
def test_structured_headers_same_verdict_as_official(case):
    _structured_verdict(case)


def test_structured_fuzz_reached_both_verdicts():
    # its own cases: the property test above agrees on whatever it draws, this one shows that the
    # strategy draws files both readers accept and files both refuse
    counts = _verdicts(_structured, _structured_verdict, 300)
    assert counts[True] > 0 and counts[False] > 0, counts


@hs.composite
def _valid_then_lie(draw):
    names = draw(hs.lists(hs.text("abc.", min_size=1, max_size=4), min_size=1, max_size=4, unique=True))
    header, pos = {}, 0
    for name in names:
        code = draw(hs.sampled_from(list(DTYPES)))
        shape = draw(hs.lists(hs.integers(0, 4), max_size=3))
        n = 1
        for d in shape:
            n *= d
        if n * DTYPES[code][0] % 8:  # sub-byte dtypes (F4, F6) need whole bytes: 4 values always are
            shape, n = [4], 4
        size = n * DTYPES[code][0] // 8
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [pos, pos + size]}
        pos += size
    data_len = pos
    lie = draw(hs.sampled_from(["none", "offset", "dtype", "shape", "length", "meta"]))
    victim = header[draw(hs.sampled_from(names))]
    delta = draw(hs.sampled_from([-2, -1, 1, 2]))
    if lie == "offset":
        i = draw(hs.integers(0, 1))
        victim["data_offsets"][i] = max(0, victim["data_offsets"][i] + delta)
    elif lie == "dtype":
        victim["dtype"] = draw(hs.sampled_from(list(DTYPES)))
    elif lie == "shape":
        victim["shape"] = victim["shape"] + [2] if delta > 0 else victim["shape"][:-1]
    elif lie == "length":
        data_len += delta
    elif lie == "meta":
        header["__metadata__"] = draw(hs.one_of(hs.dictionaries(hs.text(max_size=2), hs.text(max_size=2)),
                                                hs.dictionaries(hs.text(max_size=2), hs.integers(), min_size=1)))
    return header, max(0, data_len)


def _lie_verdict(case: tuple) -> bool:
    header, data_len = case
    data = bytes(range(256)) * (data_len // 256) + bytes(data_len % 256)
    return _same_verdict(json.dumps(header, ensure_ascii=False).encode(), data)


@settings(max_examples=300, deadline=None)
@given(_valid_then_lie())
def test_valid_files_with_one_lie_same_verdict_as_official(case):
    _lie_verdict(case)


def test_lie_fuzz_reached_both_verdicts():
    counts = _verdicts(_valid_then_lie(), _lie_verdict, 300)
    assert counts[True] > 20 and counts[False] > 20, counts


def test_file_pickles_by_path(tmp_path):
    import pickle

    p = tmp_path / "p.safetensors"
    save_safetensors({"x": torch.arange(1000)}, p)
    f = load_safetensors(p)
    blob = pickle.dumps(f)
    assert len(blob) < 1000 and torch.equal(pickle.loads(blob)["x"], torch.arange(1000))


@pytest.mark.skipif(os.name != "posix", reason="file modes and umask are POSIX")
def test_saved_file_gets_the_mode_of_the_umask_at_save_time(tmp_path):
    old = os.umask(0o027)  # set after the module was imported: the save must see this one
    try:
        save_safetensors({"x": torch.zeros(3)}, tmp_path / "a.safetensors")
        assert os.umask(0o027) == 0o027  # the save read the umask without changing it
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "a.safetensors").st_mode & 0o777 == 0o640
