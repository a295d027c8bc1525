"""The benchmark harness (benchmarks/table1.py, benchmarks/report.py) on a tiny dataset.

Correctness only: every reader returns the generated samples, a measurement yields a result or a
reason per (row, op), a failing or missing script is reported. No timing is asserted.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import report
import table1

N = 24
MAIN_ENV_ADAPTERS = ("JsonlReader", "TorchforgeJinx", "TorchforgeMDS")


@pytest.fixture(scope="module")
def meta(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("table1"))
    return workdir, table1.build(workdir, N, seed=3)


def test_build_writes_every_folder_and_records_storage(meta):
    workdir, m = meta
    folders = {row.data for row in table1.ROWS}
    assert set(m["storage"]) == folders
    for name in folders:
        on_disk = sum(os.path.getsize(os.path.join(workdir, name, f)) for f in m["files"][name])
        assert m["storage"][name] == on_disk > 0
    assert m["key_path"] == ["messages", 0, "content"]
    assert m["binary_fields"] == ["image"]


@pytest.mark.parametrize("op", table1.OPS)
@pytest.mark.parametrize("adapter", MAIN_ENV_ADAPTERS)
def test_every_reader_returns_the_generated_samples(meta, adapter, op):
    workdir, m = meta
    for row in (r for r in table1.ROWS if r.adapter == adapter):
        out = table1.run_op(table1.ADAPTERS[adapter], os.path.join(workdir, row.data), m, op)
        assert out["samples"] == N
        assert out["digest"] == m["reference"][op], (row, op)
        assert out["rate"] > 0 and out["peak_rss"] > 0 and out["peak_anon"] > 0


def test_digest_sees_a_changed_byte_and_ignores_key_order():
    s = {"id": 1, "messages": [{"role": "user", "content": "hi"}], "image": bytes(10000)}
    same = {"image": memoryview(bytes(10000)), "messages": [{"content": "hi", "role": "user"}], "id": 1}
    assert table1.digest(s) == table1.digest(same)
    img = bytearray(10000)
    img[4096] = 1  # a sampled byte
    assert table1.digest({**s, "image": bytes(img)}) != table1.digest(s)
    assert table1.digest({**s, "image": bytes(9999)}) != table1.digest(s)
    assert table1.digest({**s, "id": 2}) != table1.digest(s)
    assert table1.digest({**s, "id": np.int64(1)}) == table1.digest(s)
    nested = {**s, "messages": [{"role": np.str_("user"), "content": "hi"}]}
    assert table1.digest(nested) == table1.digest(s)


def test_ratio_lines_pick_out_ratios():
    out = "header\niterate  5.0x\nn=10  time x0.69, peak\nspeed-up 3\nbox 3 items\n"
    assert report.ratio_lines(out) == ["iterate  5.0x", "n=10  time x0.69, peak", "speed-up 3"]


def test_measure_in_a_child_gives_a_result_per_op_and_reasons_for_failures(meta, monkeypatch):
    workdir, m = meta
    result = table1.run_table(N, 3, workdir, only="jsonl/", timeout=120, log=lambda line: None, repeat=2)
    rows = [(r["fmt"], r["reader"], r["compression"]) for r in result["rows"]]
    assert rows == [("JSONL", "orjson (anchor)", "none")]
    for op, r in result["rows"][0]["results"].items():
        assert "error" not in r, r
        assert r["samples"] == N and r["rate"] > 0 and r["peak_rss"] >= r["base_rss"] > 0
        assert len(r["rates"]) == 2 and r["rate"] == max(r["rates"])
    # the MLDataForge env missing: the row says why instead of disappearing
    monkeypatch.setattr(table1, "MLDF_PY", os.path.join(workdir, "no-such-python"))
    table1.python_for.cache_clear()
    mldf = next(r for r in table1.ROWS if r.env == "mldf")
    missing = {op: table1.measure(mldf, op, workdir, m, timeout=60) for op in table1.OPS}
    table1.python_for.cache_clear()
    assert all("Python >= 3.12" in r["error"] for r in missing.values())
    result["rows"].append({**table1.asdict(mldf), "storage": m["storage"][mldf.data], "results": missing})
    # a reader that returns other data is caught by the digest (here: one id changed in the file)
    os.makedirs(os.path.join(workdir, "jsonl-bad"), exist_ok=True)
    with open(os.path.join(workdir, "jsonl", "data.jsonl"), "rb") as f:
        lines = f.readlines()
    lines[5] = lines[5].replace(b'"id":5,', b'"id":7,', 1)
    with open(os.path.join(workdir, "jsonl-bad", "data.jsonl"), "wb") as f:
        f.writelines(lines)
    m_bad = {**m, "files": {**m["files"], "jsonl-bad": {"data.jsonl": 0}}}
    bad = table1.Row("JSONL", "none", "wrong", "jsonl-bad", "JsonlReader")
    for op in table1.OPS:
        assert "wrong data: digest" in table1.measure(bad, op, workdir, m_bad, timeout=60)["error"]

    md = table1.table_markdown(result)
    lines = md.splitlines()
    assert lines[0].startswith("| Format | Compression | Reader | Storage (MiB) | iterate (samples/s)")
    assert lines[2].startswith("| JSONL | none | orjson (anchor) |")
    assert "failed [1]" in lines[3] and "[1] MLDataForge needs Python >= 3.12" in md


def _fake_table() -> dict:
    def res(rate, rss):
        return {op: {"op": op, "samples": 10, "seconds": 10 / rate, "rate": rate, "peak_rss": rss << 20,
                     "base_rss": 50 << 20, "peak_anon": 40 << 20, "digest": "0:10"} for op in table1.OPS}
    rows = []
    for row, rate in zip(table1.ROWS[:3], (100.0, 400.0, 200.0)):
        rows.append({**table1.asdict(row), "storage": 5 << 20, "results": res(rate, 100)})
    rows[2]["results"]["sort"] = {"op": "sort", "error": "boom"}
    return {"n": 10, "seed": 0, "key_path": ["messages", 0, "content"], "build_seconds": {}, "rows": rows}


def test_ratios_are_torchforge_over_each_competitor():
    table = _fake_table()
    by = {(r["format"], r["versus"]): r for r in table1.ratios(table)}
    mldf = by[("JINX + sidecar none", "MLDataForge 0.6.10")]
    assert mldf["iterate"] == pytest.approx(2.0) and mldf["sort"] is None
    assert by[("JINX + sidecar none", "orjson (anchor) (JSONL)")]["shuffle"] == pytest.approx(4.0)
    expected = "| JINX + sidecar none | MLDataForge 0.6.10 | 2.00x | 2.00x | n/a |"
    assert expected in table1.ratios_markdown(table)


def test_scripts_that_fail_or_are_missing_are_reported(tmp_path):
    ok = tmp_path / "good.py"
    ok.write_text("print('iterate: 3.50x faster than X')\nprint('noise')\n")
    bad = tmp_path / "bad.py"
    bad.write_text("raise SystemExit('no data here')\n")
    good = report.run_script(str(ok), timeout=60)
    assert good.status == "ok" and good.ratios == ["iterate: 3.50x faster than X"]
    failed = report.run_script(str(bad), timeout=60)
    assert failed.status == "failed" and "no data here" in failed.reason
    missing = report.run_script(str(tmp_path / "absent.py"), timeout=60)
    assert missing.status == "missing"
    slow = tmp_path / "slow.py"
    slow.write_text("import time\nprint('started', flush=True)\ntime.sleep(30)\n")
    timed_out = report.run_script(str(slow), timeout=1)
    assert timed_out.status == "timed out"

    table = _fake_table()
    plots, why = report.plot_table(table, str(tmp_path / "plots"))
    if importlib.util.find_spec("matplotlib") is None:
        assert plots == [] and "matplotlib" in why
    else:
        assert [os.path.basename(p) for p in plots] == [f"table1_{op}.png" for op in table1.OPS]
        for p in plots:
            with open(p, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    mach = {"date": "today", "CPU": "test cpu"}
    text = report.render(mach, table, "", [good, failed, missing, timed_out], plots, why,
                         str(tmp_path / "RESULTS.md"), "python benchmarks/report.py", 1.0)
    assert "| CPU | test cpu |" in text
    assert "| JINX + sidecar | none | MLDataForge 0.6.10 | 5 | 200 | 100 (40) |" in text
    assert "| bad | failed — exit code 1: no data here |" in text
    assert "| absent | missing — benchmarks/absent.py does not exist |" in text
    assert "| slow | timed out — killed after 1 s |" in text
    assert "- `iterate: 3.50x faster than X`" in text
    if plots:
        assert "![table1_iterate.png](plots/table1_iterate.png)" in text


def test_best_of_repeats_keeps_the_fastest_and_never_hides_a_failure():
    ok1 = {"rate": 10.0, "peak_rss": 1}
    ok2 = {"rate": 20.0, "peak_rss": 2}
    assert table1.best_of([ok1, ok2]) == {"rate": 20.0, "peak_rss": 2, "rates": [10.0, 20.0]}
    flaky = table1.best_of([ok1, {"error": "boom"}])
    assert flaky["error"] == "boom (in 1 of 2 runs)"
    assert table1.best_of([{"error": "a"}, {"error": "b"}])["error"] == "a"
