"""Conversions: JSONL sources, MDS column inference, and round trips between formats."""
import gzip

import numpy as np
import orjson
import pytest
import torch
import zstandard

from torchforge.convert import ConversionStats, infer_mds_columns, iter_jsonl
from torchforge.errors import FormatError

ROWS = [{"id": i, "text": f"héllo {i} 漢字", "tags": ["a"] * (i % 3), "score": i / 7} for i in range(50)]


def _jsonl_bytes(rows, bad_every=0):
    out = []
    for i, r in enumerate(rows):
        out.append(orjson.dumps(r))
        if bad_every and i % bad_every == 0:
            out.append(b'{"id": 1, "text": "unterminated')  # malformed
            out.append(b"[1, 2, 3]")  # valid JSON, not an object
            out.append(b"")  # blank: ignored, not counted
    return b"\n".join(out) + b"\n"


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_iter_jsonl_skips_and_counts_malformed_lines(tmp_path, suffix):
    raw = _jsonl_bytes(ROWS, bad_every=10)
    data = {".jsonl": raw, ".jsonl.gz": gzip.compress(raw),
            ".jsonl.zst": zstandard.ZstdCompressor().compress(raw)}[suffix]
    p = tmp_path / f"rows{suffix}"
    p.write_bytes(data)
    stats = ConversionStats()
    got = list(iter_jsonl(str(p), stats))
    assert got == ROWS
    assert stats.skipped == 10  # 5 malformed + 5 non-objects
    first = stats.skipped_where[0]
    assert f"{p}:2 (byte " in first and "not JSON" in first
    # the reported byte offset is where the bad line starts in the uncompressed stream
    off = int(first.split("(byte ")[1].split(")")[0])
    assert raw[off:].startswith(b'{"id": 1, "text": "unterminated')


def test_infer_mds_columns_kinds():
    rows = [{"i": 1, "f": 0.5, "s": "x", "b": b"\x00", "j": {"a": [1, None]}, "n": None,
             "a": np.zeros((2, 3), np.float32), "v": np.zeros(i + 1, np.int16), "x": np.float16(1),
             "t": torch.ones(4, dtype=torch.int64), "big": 2**70, "flag": True}
            for i in range(3)]
    cols = infer_mds_columns(rows)
    assert cols == {"i": "int", "f": "float64", "s": "str", "b": "bytes", "j": "json", "n": "json",
                    "a": "ndarray:float32:2,3", "v": "ndarray:int16", "x": "float16",
                    "t": "ndarray:int64:4", "big": "json", "flag": "json"}


def test_infer_mds_columns_mixed_json_kinds_become_json():
    assert infer_mds_columns([{"k": 1}, {"k": "one"}, {"k": None}]) == {"k": "json"}


@pytest.mark.parametrize("rows, field", [
    ([{"id": 1, "meta": {"blob": b"\x01"}}], "meta.blob"),
    ([{"id": 1, "m": [{"x": np.zeros(2)}]}], "m[0].x"),
    ([{"id": 1, "k": b"x"}, {"id": 2, "k": "text"}], "'k' mixes kinds"),
    ([{"id": 1, "k": 1}, {"id": 2}], "same columns"),
    # a bare TypeError (Got unsupported ScalarType BFloat16) naming nothing, before
    ([{"id": 1, "emb": torch.ones(4)}, {"id": 2, "emb": torch.ones(4, dtype=torch.bfloat16)}],
     "field 'emb' cannot be converted to MDS \\(sample 1\\): its torch.bfloat16 values have no numpy type"),
    ([{"id": 1, "emb": torch.zeros(2, dtype=torch.float8_e4m3fn)}], "'emb' .*float8_e4m3fn"),
])
def test_infer_mds_columns_refuses_naming_the_field(rows, field):
    with pytest.raises(FormatError, match=field.replace("[", r"\[").replace("]", r"\]")):
        infer_mds_columns(rows)


@pytest.mark.parametrize("to", ["jinx", "mds", "safetensors"])
def test_convert_logs_each_skipped_line_once(tmp_path, caplog, to):
    # MDS infers its columns and safetensors checks every row in passes before the writing one: those
    # look-ahead passes must not log the same skipped line again
    from torchforge.convert import convert

    src = tmp_path / "rows.jsonl"
    src.write_bytes(b'{"x": 1.5, "y": 2}\n{"x": 3.0, \n{"x": 5.5, "y": 6}\n')
    with caplog.at_level("WARNING", logger="torchforge.convert"):
        stats = convert(str(src), str(tmp_path / "out"), to=to)
    assert stats.written == 2 and stats.skipped == 1
    logged = [r for r in caplog.records if "skipped malformed record" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in logged]
    assert f"{src}:2 (byte 19)" in logged[0].getMessage()


def test_jsonl_integers_past_64_bits_stay_exact_and_a_byte_order_mark_is_not_a_record(tmp_path):
    """orjson read 123456789012345678901234567890 as the float 1.2345678901234568e+29 (written so, with no
    word); a file starting with a UTF-8 byte order mark lost its first record as malformed."""
    from torchforge.convert import convert
    from torchforge.datasets.mds import MDSDataset

    big = 123456789012345678901234567890
    src = tmp_path / "rows.jsonl"
    src.write_bytes(b'\xef\xbb\xbf{"id": 1, "n": 5}\n' + f'{{"id": 2, "n": {big}}}\n'.encode()
                    + b'{"id": 3, "n": -9223372036854775809}\n{"id": 4, "n": 1234567890123456789, "x": NaN}\n')
    stats = ConversionStats()
    rows = list(iter_jsonl(str(src), stats))
    assert [r["id"] for r in rows] == [1, 2, 3] and rows[1]["n"] == big and type(rows[1]["n"]) is int
    assert rows[2]["n"] == -9223372036854775809 and stats.skipped == 1  # NaN is not JSON, as orjson has it
    stats = convert(str(src), str(tmp_path / "mds"), to="mds")
    assert stats.written == 3
    assert [s["n"] for s in MDSDataset(str(tmp_path / "mds"))] == [5, big, -9223372036854775809]  # a json column
    with pytest.raises(FormatError, match=f"field 'n'.*integer {big} does not fit in 64 bits"):
        convert(str(src), str(tmp_path / "jinx"), to="jinx")


def test_an_array_dtype_mds_cannot_hold_is_refused_naming_the_field():
    with pytest.raises(FormatError, match="field 'mask' cannot be converted to MDS \\(sample 0\\): its values are "
                                         "bool arrays"):
        infer_mds_columns([{"id": 1, "mask": np.array([True, False])}])
    with pytest.raises(FormatError, match="field 'flag'.*bool arrays"):
        infer_mds_columns([{"flag": torch.tensor(True)}])


def test_a_line_with_a_long_digit_run_is_judged_as_any_other_line(tmp_path):
    """The exact-integer reading of a line with 19 digits in a row (json) took what orjson refuses: 1e400
    became inf, a lone surrogate stopped the conversion, deep nesting raised RecursionError out of it."""
    digits = "1234567890123456789012"
    lines = [f'{{"id": 1, "x": 1e400, "s": "{digits}"}}', f'{{"id": 2, "s": "\\ud800{digits}"}}',
             '{"id": 3, "d": ' + "[" * 5000 + "]" * 5000 + f', "s": "{digits}"}}', f'{{"id": 4, "s": "{digits}"}}']
    src = tmp_path / "rows.jsonl"
    src.write_text("\n".join(lines) + "\n")
    stats = ConversionStats()
    assert [r["id"] for r in iter_jsonl(str(src), stats)] == [4] and stats.skipped == 3
