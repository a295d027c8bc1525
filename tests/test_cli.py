"""The torchforge command line on good and damaged data."""
import json
import os
import shutil
import subprocess
import sys

import orjson
import pytest
from expected import same

from torchforge.cli import main
from torchforge.datasets.base import open_dataset

HERE = os.path.dirname(__file__)
INTEROP = os.path.join(HERE, "fixtures", "interop")


@pytest.fixture
def fixture_copy(tmp_path):
    def copy(name):
        dst = tmp_path / name
        shutil.copytree(os.path.join(INTEROP, name), dst)
        return str(dst)
    return copy


def _plain(sample):
    m = getattr(sample, "materialize", None)
    return m() if callable(m) else sample


def _all(path):
    return [_plain(s) for s in open_dataset(path)]


def test_convert_mds_to_jinx_to_mds_preserves_every_sample(fixture_copy, tmp_path, capsys):
    src = fixture_copy("mds-streaming-none")
    jinx, back = str(tmp_path / "j"), str(tmp_path / "m")
    assert main(["convert", src, jinx, "--to", "jinx", "-q", "-o", "encoding=b64", "-o", "binary_threshold=256"]) == 0
    assert main(["convert", jinx, back, "--to", "mds", "-q", "-o", "compression=zstd"]) == 0
    assert "wrote 200 samples" in capsys.readouterr().out
    a, b, c = _all(src), _all(jinx), _all(back)
    assert len(a) == len(b) == len(c) == 200
    for x, y, z in zip(a, b, c):
        assert same(x, y) == "" and same(x, z) == ""
    # the column encodings survive the round trip where MDS has them
    assert open_dataset(back).format_name == "mds"


def test_convert_writes_mds_hashes_given_as_an_option(fixture_copy, tmp_path, capsys):
    """`-o hashes=sha1` (the README's advice for HTTP) was split into characters and always refused."""
    src = fixture_copy("mds-streaming-none")
    for spec, algos in (("sha1", ["sha1"]), ("sha1,xxh64", ["sha1", "xxh64"])):
        dst = str(tmp_path / spec.replace(",", "-"))
        assert main(["convert", src, dst, "--to", "mds", "-q", "-o", f"hashes={spec}"]) == 0, capsys.readouterr()
        with open(os.path.join(dst, "index.json")) as f:
            shards = json.load(f)["shards"]
        assert shards and all(sorted(s["raw_data"]["hashes"]) == algos for s in shards)
        assert main(["verify", dst]) == 0
    assert len(_all(dst)) == 200


def test_convert_jinx_to_mds_refuses_up_front_naming_the_field(fixture_copy, tmp_path, capsys):
    src = fixture_copy("jinx-b64-zst-binx")  # meta.nested.blob holds bytes
    dst = str(tmp_path / "out")
    assert main(["convert", src, dst, "--to", "mds", "-q"]) == 1
    err = capsys.readouterr().err
    assert "meta.nested.blob" in err and "bytes" in err
    assert not os.path.exists(dst) or not os.listdir(dst)  # nothing written


@pytest.mark.parametrize(("to", "wrong", "right"), [("mds", "shard_size", "size_limit"),
                                                    ("jinx", "size_limit", "shard_size"),
                                                    ("safetensors", "shard_size", "max_shard_size")])
def test_convert_names_an_option_the_target_writer_does_not_take_and_lists_its_options(
        fixture_copy, tmp_path, capsys, to, wrong, right):
    """-o shard_size=... (the help's example) with --to mds was a TypeError from MDSWriter's constructor,
    after the source had been read for MDS's columns."""
    src = fixture_copy("mds-streaming-none")
    dst = str(tmp_path / "out")
    if to == "safetensors":
        src = str(tmp_path / "t")
        import torch

        from torchforge.datasets.safetensors import SafetensorsShardWriter
        with SafetensorsShardWriter(src) as w:
            w.write({"x": torch.arange(3)})
    assert main(["convert", src, dst, "--to", to, "-q", "-o", f"{wrong}=4096"]) == 1
    err = capsys.readouterr().err
    assert f"takes no option '{wrong}'" in err and right in err and "Error:" in err, err
    assert not os.path.exists(dst)


def test_convert_jsonl_skips_malformed_lines(tmp_path, capsys):
    src = tmp_path / "rows.jsonl"
    lines = [orjson.dumps({"id": i, "text": "x" * i}) for i in range(30)]
    lines.insert(5, b'{"id": broken')
    src.write_bytes(b"\n".join(lines) + b"\n")
    dst = str(tmp_path / "out")
    assert main(["convert", str(src), dst, "--to", "jinx", "-q"]) == 0
    out = capsys.readouterr().out
    assert "wrote 30 samples" in out and "skipped 1 malformed" in out and f"{src}:6" in out
    assert [s["id"] for s in _all(dst)] == list(range(30))


def test_convert_refuses_to_overwrite(tmp_path, fixture_copy, capsys):
    src = fixture_copy("mds-streaming-none")
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep").write_text("mine")
    assert main(["convert", src, str(dst), "--to", "jinx", "-q"]) == 2
    assert (dst / "keep").read_text() == "mine"


def test_convert_overwrite_keeps_the_old_destination_until_the_new_one_is_whole(tmp_path, fixture_copy, capsys):
    src = fixture_copy("mds-streaming-none")
    dst = str(tmp_path / "out")
    assert main(["convert", src, dst, "--to", "jinx", "-q"]) == 0
    before = sorted(os.listdir(dst))
    bad = fixture_copy("jinx-b64-zst-binx")  # bytes nested in a dict: MDS refuses it
    assert main(["convert", bad, dst, "--to", "mds", "-q", "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "meta.nested.blob" in err and "unchanged" in err
    assert sorted(os.listdir(dst)) == before and len(open_dataset(dst)) == 200  # the old dataset, whole
    assert [n for n in os.listdir(tmp_path) if "converting" in n] == []  # nothing left beside it
    assert main(["convert", src, dst, "--to", "mds", "-q", "--overwrite"]) == 0  # a conversion that works
    assert open_dataset(dst).format_name == "mds" and len(open_dataset(dst)) == 200
    link = tmp_path / "link"
    link.symlink_to(dst)  # a link is replaced by the new folder; what it pointed to is left alone
    assert main(["convert", src, str(link), "--to", "jinx", "-q", "--overwrite"]) == 0
    assert not link.is_symlink() and open_dataset(str(link)).format_name == "jinx"
    assert open_dataset(dst).format_name == "mds"


def test_convert_errors_are_one_line_with_no_traceback(tmp_path, fixture_copy, capsys):
    src = fixture_copy("mds-streaming-none")
    (tmp_path / "afile").write_text("x")
    for argv, code, says in (
            (["--to", "jinx", "-o", "bogus=1"], 1, "takes no option 'bogus'"),
            (["--to", "mds", "--columns", "{bad"], 2, "--columns is not JSON"),
            (["--to", "mds", "--columns", '{"id": "str"}'], 1, "fields ['arr', 'image', 'label'"),
    ):
        assert main(["convert", src, str(tmp_path / "x"), "-q", *argv]) == code, argv
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and err.count("\n") == 1, err
    assert main(["convert", src, str(tmp_path / "afile" / "x"), "--to", "jinx", "-q"]) == 2
    assert "cannot make the folder" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x")


def test_convert_of_an_empty_dataset(tmp_path, capsys):
    from torchforge.formats.jinx import JinxWriter

    with JinxWriter(str(tmp_path / "empty")):
        pass
    assert main(["convert", str(tmp_path / "empty"), str(tmp_path / "j"), "--to", "jinx", "-q"]) == 0
    assert len(open_dataset(str(tmp_path / "j"))) == 0
    for to, says in (("mds", "give them"), ("safetensors", "no samples")):  # nothing to infer columns from
        assert main(["convert", str(tmp_path / "empty"), str(tmp_path / to), "--to", to, "-q"]) == 1
        assert says in capsys.readouterr().err and not os.path.exists(tmp_path / to)
    assert main(["convert", str(tmp_path / "empty"), str(tmp_path / "m"), "--to", "mds", "-q",
                 "--columns", '{"id": "int"}']) == 0
    assert open_dataset(str(tmp_path / "m")).format_name == "mds" and len(open_dataset(str(tmp_path / "m"))) == 0


@pytest.mark.parametrize("where", ["same", "parent", "inside"])
def test_convert_refuses_a_destination_that_is_contains_or_lies_inside_the_source(where, tmp_path, capsys):
    root = tmp_path / "data"
    shutil.copytree(os.path.join(INTEROP, "mds-streaming-none"), root / "src")
    src = root / "src"
    dst = {"same": src, "parent": root, "inside": src / "out"}[where]
    before = sorted((p.name, p.stat().st_size) for p in src.iterdir())
    assert main(["convert", str(src), str(dst), "--to", "jinx", "-q", "--overwrite"]) == 2
    assert "outside the source" in capsys.readouterr().err
    assert sorted((p.name, p.stat().st_size) for p in src.iterdir()) == before  # nothing deleted or added


@pytest.mark.parametrize("opener", ["open_dataset", "JinxDataset", "MDSDataset", "SafetensorsDataset"])
def test_missing_path_is_a_torchforge_error_and_a_file_not_found_error(opener, tmp_path, capsys):
    import torchforge
    from torchforge.errors import TorchforgeError

    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as e:
        getattr(torchforge, opener)(missing)
    assert isinstance(e.value, TorchforgeError) and str(missing) in str(e.value)
    assert main(["inspect", str(missing)]) != 0


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(INTEROP) if n.startswith(("jinx-", "mds-"))))
def test_inspect_and_verify_good_fixtures(name, fixture_copy, capsys):
    path = fixture_copy(name)
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    fmt = name.split("-")[0]
    n = len(open_dataset(path))
    assert f"format: {fmt}" in out and f"samples: {n}" in out and "fields:" in out
    assert main(["verify", path]) == 0
    assert f"{n} samples decoded, 0 problems" in capsys.readouterr().out


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_verify_names_file_and_offset_of_damage_jinx(fixture_copy, capsys):
    path = fixture_copy("jinx-b64-zst-binx")
    binx = os.path.join(path, "shard-00000.binx")
    _flip(binx, 20)  # inside the first sidecar value: stored raw, so decoding succeeds...
    shard = os.path.join(path, "shard-00000.jinx")
    with open(shard, "rb") as f:
        data = f.read()
    first_b64 = data.index(b'"arr.npy":"') + len(b'"arr.npy":"')
    with open(shard, "r+b") as f:  # ...but a broken base64 value in the body is caught
        f.seek(first_b64)
        f.write(b"!")
    assert main(["verify", path]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "shard-00000.jinx" in out and "byte " in out


@pytest.mark.parametrize("name, shard, cut", [
    ("jinx-a85-zst-inline", "shard-00000.jinx", lambda size: size - 40),  # footer offset line cut
    ("mds-streaming-none", "shard.00001.mds", lambda size: size // 2),  # shorter than index.json says
])
def test_verify_truncated_shard(fixture_copy, capsys, name, shard, cut):
    path = fixture_copy(name)
    shard = os.path.join(path, shard)
    os.truncate(shard, cut(os.path.getsize(shard)))
    assert main(["verify", path]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and os.path.basename(shard) in out


def test_verify_mds_hash_mismatch(tmp_path, capsys):
    from torchforge.formats.mds import MDSWriter

    path = str(tmp_path / "hashed")
    with MDSWriter(out=path, columns={"id": "int", "blob": "bytes"}, hashes=["md5", "sha1"]) as w:
        for i in range(50):
            w.write({"id": i, "blob": bytes([i]) * 100})
    assert main(["verify", path]) == 0
    capsys.readouterr()
    shard = os.path.join(path, "shard.00000.mds")
    _flip(shard, os.path.getsize(shard) - 10)  # inside a sample's bytes: only the hash can tell
    assert main(["verify", path]) == 1
    out = capsys.readouterr().out
    assert "sha1 hash differs" in out and "shard.00000.mds" in out and "byte 0" in out


def test_bench_prints_rates(fixture_copy, capsys):
    path = fixture_copy("jinx-b64-multishard")
    assert main(["bench", path, "--field", "image", "--sort-key", "text"]) == 0
    out = capsys.readouterr().out
    for op in ("iterate", "shuffle", "sort"):
        assert op in out
    assert "samples/s" in out


def _peak_rss_of_conversion(tmp_path, n_lines, tag):
    src = tmp_path / f"{tag}.jsonl"
    payload = os.urandom(600).hex()  # ~1.2 KB of incompressible text per line
    line = orjson.dumps({"id": 0, "text": payload, "meta": {"k": [1, 2, 3]}})
    with open(src, "wb") as f:
        chunk = (line + b"\n") * 1000
        f.writelines(chunk for _ in range(n_lines // 1000))
    code = ("import resource, sys; from torchforge.cli import main; "
            "rc = main(sys.argv[1:]); "
            "print('RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, "convert", str(src), str(tmp_path / f"{tag}-out"),
                          "--to", "jinx", "-q", "-o", "compression=none"],
                         capture_output=True, text=True, check=True).stdout
    shutil.rmtree(tmp_path / f"{tag}-out")
    size = os.path.getsize(src)
    os.remove(src)
    return size, int(out.split("RSS")[1].split()[0]) * 1024


@pytest.mark.slow
def test_conversion_of_a_gigabyte_has_bounded_memory(tmp_path):
    small_size, small_rss = _peak_rss_of_conversion(tmp_path, 50_000, "small")
    big_size, big_rss = _peak_rss_of_conversion(tmp_path, 850_000, "big")
    assert big_size > 1_000_000_000
    # 17x the input: peak memory may not grow by more than a fixed 64 MiB (buffers, shard index)
    assert big_rss - small_rss < 64 << 20, (small_rss, big_rss)
    print(f'peak RSS {small_rss >> 20} MiB for {small_size >> 20} MiB, {big_rss >> 20} MiB for {big_size >> 20} MiB')


def test_convert_to_safetensors_and_back(tmp_path, capsys):
    import numpy as np

    from torchforge.formats.jinx import JinxWriter

    src = str(tmp_path / "j")
    rows = [{"id": i, "image": bytes(range(i % 7 + 1)), "emb": np.full(4, i, np.float32)} for i in range(20)]
    with JinxWriter(src, binary_threshold=4) as w:
        for r in rows:
            w.write(r)
    dst = str(tmp_path / "st")
    assert main(["convert", src, dst, "--to", "safetensors", "-q"]) == 0
    got = _all(dst)
    assert len(got) == 20
    for r, g in zip(rows, got):
        assert int(g["id"]) == r["id"]
        assert bytes(np.asarray(g["image"]).tobytes()) == r["image"]  # bytes travel as uint8
        assert np.array_equal(np.asarray(g["emb"]), r["emb"])


def test_convert_to_safetensors_refuses_text_up_front(fixture_copy, tmp_path, capsys):
    src = fixture_copy("mds-streaming-none")
    dst = str(tmp_path / "st")
    assert main(["convert", src, dst, "--to", "safetensors", "-q"]) == 1
    err = capsys.readouterr().err
    assert "cannot be converted to safetensors (sample 0)" in err
    assert "field 'messages'" in err or "field 'text'" in err  # MDS gives columns in sorted order
    assert not os.path.exists(dst) or not os.listdir(dst)


def test_convert_parquet_file_and_folder(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow", reason="Parquet sources need the optional pyarrow extra")
    import pyarrow.parquet as pq

    rows = [{"id": i, "text": f"row {i} ✓", "blob": bytes([i % 256]) * (i % 5)} for i in range(2500)]
    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:1200]), folder / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(rows[1200:]), folder / "part-1.parquet")
    dst = str(tmp_path / "out")
    assert main(["convert", str(folder), dst, "--to", "mds", "-q"]) == 0
    got = _all(dst)
    assert [g["id"] for g in got] == list(range(2500))
    assert all(g["text"] == r["text"] and bytes(g["blob"]) == r["blob"] for g, r in zip(got, rows))
    one = str(tmp_path / "one")
    assert main(["convert", str(folder / "part-0.parquet"), one, "--to", "jinx", "-q"]) == 0
    assert len(open_dataset(one)) == 1200


def test_python_dash_m_torchforge_runs_the_cli():
    """``python -m torchforge`` is the ``torchforge`` command (before: no ``__main__``)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "torchforge", "--help"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0 and "convert" in out.stdout


def test_verify_of_a_path_that_does_not_exist_is_a_command_error_not_damage(tmp_path, capsys):
    """A typo in the path printed 'DAMAGED ... no such file or folder, 1 problems': it looked like damage."""
    missing = str(tmp_path / "no-such-dataset")
    assert main(["verify", missing]) == 1
    out, err = capsys.readouterr()
    assert "DAMAGED" not in out and "NotFoundError" in err and missing in err, (out, err)


def test_convert_refuses_fields_the_mds_columns_leave_out_and_values_they_cannot_hold(tmp_path, capsys):
    from torchforge.formats.jinx import JinxWriter

    src = str(tmp_path / "src")
    with JinxWriter(src) as w:
        w.write({"id": 1, "label": "cat", "x": 0.5})
        w.write({"id": 2, "label": "dog", "x": 1e40})
    for columns, says in (
            ('{"id": "int"}', "sample 0 has fields ['label', 'x'] that the MDS columns ['id'] do not hold"),
            ('{"id": "int", "label": "str", "x": "float32"}', "sample 1: column 'x' (float32)"),
            ('{"id": "int8", "label": "str", "x": "float64"}', None),
    ):
        dst = tmp_path / "out"
        code = main(["convert", src, str(dst), "--to", "mds", "-q", "--columns", columns])
        err = capsys.readouterr().err
        if says is None:  # (float64 holds 1e40)
            assert code == 0 and [float(s["x"]) for s in open_dataset(str(dst))] == [0.5, 1e40]
            continue
        assert code == 1 and says in err and src in err and not dst.exists(), err  # was: exit 0, fields or
        #                                                                             values dropped or inf


def test_convert_removes_what_a_killed_convert_into_the_same_destination_left(tmp_path, fixture_copy, capsys):
    from torchforge._proc import host_name

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead, alive = int(done.stdout), os.getppid()  # (this process is the convert itself: main() runs here)
    for pid in (dead, alive):
        stage = tmp_path / f".dst.converting-h{host_name()}-p{pid}"
        stage.mkdir()
        (stage / "shard.00000.mds").write_bytes(b"x" * 1000)
    assert main(["convert", fixture_copy("mds-streaming-none"), str(tmp_path / "dst"), "--to", "jinx", "-q"]) == 0
    left = sorted(n for n in os.listdir(tmp_path) if n.startswith(".dst"))
    assert left == [f".dst.converting-h{host_name()}-p{alive}"]  # a live convert's is left alone


def test_a_convert_killed_between_its_renames_gets_its_old_destination_back(tmp_path, fixture_copy, capsys):
    """SIGKILL right after DST was moved aside (before the new one took its place): the next convert into
    DST deleted the moved-aside folder with the dead convert's stage, and DST was gone for good."""
    src, dst = fixture_copy("jinx-b64-zst-binx"), fixture_copy("mds-streaming-none")
    want = _all(dst)
    code = ("import os, signal, sys\nr = os.rename\n"
            "def rn(a, b):\n    r(a, b)\n    if b.endswith('.old'): os.kill(os.getpid(), signal.SIGKILL)\n"
            "os.rename = rn\nfrom torchforge.cli import main\nsys.exit(main(sys.argv[1:]))")
    run = subprocess.run([sys.executable, "-c", code, "convert", src, dst, "--to", "jinx", "--overwrite", "-q"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == -9 and not os.path.exists(dst)  # killed with DST moved aside
    assert main(["convert", src, dst, "--to", "jinx", "-q"]) == 2  # DST is back: it exists, no --overwrite
    assert "exists" in capsys.readouterr().err
    got = _all(dst)
    assert len(got) == len(want) and all(same(x, y) == "" for x, y in zip(got, want))
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".old")]


@pytest.mark.parametrize("fifo", ["shard-00000.jinx", "shard-00000.binx"])
def test_a_jinx_shard_or_sidecar_that_is_a_fifo_is_named_not_waited_on(tmp_path, fixture_copy, fifo):
    """open() of a FIFO blocks until a writer comes: verify and inspect hung for ever on one."""
    folder = fixture_copy("jinx-b64-zst-binx")
    os.remove(os.path.join(folder, fifo))
    os.mkfifo(os.path.join(folder, fifo))
    for cmd in ("verify", "inspect"):
        run = subprocess.run([sys.executable, "-m", "torchforge", cmd, folder], capture_output=True, text=True,
                             timeout=60, check=False)
        assert run.returncode == 1 and "not a regular file" in run.stdout + run.stderr
        assert fifo in run.stdout + run.stderr and "Traceback" not in run.stderr


def test_bad_command_line_values_are_one_line_errors(fixture_copy, capsys):
    """-o without '=' (a dict() error about 'update sequence element'), a missing --field or --sort-key (a
    KeyError traceback), negative --limit / --max-shards (accepted: 'shuffle 195 samples')."""
    folder = fixture_copy("jinx-b64-zst-binx")
    for argv in (["convert", folder, folder + "-out", "--to", "mds", "-o", "compression"],
                 ["bench", folder, "--limit", "-5"], ["inspect", folder, "--max-shards", "-1"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "is not KEY=VALUE" in err or "is not a count" in err
    for opt in ("--field", "--sort-key"):
        assert main(["bench", folder, opt, "nosuch"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{opt} 'nosuch'" in err and "Traceback" not in err


@pytest.mark.parametrize("lost", ["shard-00005", "shard-00000"])
def test_verify_reports_a_shard_missing_from_a_jinx_chain(fixture_copy, capsys, lost):
    """A deleted middle or first shard: its samples were silently not read, and verify said 0 problems."""
    folder = fixture_copy("jinx-b64-multishard")
    for ext in (".jinx", ".binx"):
        if os.path.exists(os.path.join(folder, lost + ext)):
            os.remove(os.path.join(folder, lost + ext))
    assert main(["verify", folder]) == 1
    out = capsys.readouterr().out
    assert f"none here has number [{int(lost[-5:])}]" in out and "DAMAGED" in out


@pytest.mark.parametrize("index", [b"", b'{"version": 2, "sh', b'{"shards": {}}', b"\xff\xfe{", b"[" * 100000])
def test_a_damaged_mds_index_is_named_not_taken_for_no_dataset(fixture_copy, capsys, index):
    """An index.json cut short or not an MDS index was 'not a dataset of any known format'."""
    folder = fixture_copy("mds-streaming-none")
    with open(os.path.join(folder, "index.json"), "wb") as f:
        f.write(index)
    assert main(["inspect", folder]) == 1
    err = capsys.readouterr().err
    assert os.path.join(folder, "index.json") in err and "known format" not in err


def test_verify_counts_a_hash_it_cannot_compute_as_no_checksum(fixture_copy, capsys):
    folder = fixture_copy("mds-streaming-none")
    path = os.path.join(folder, "index.json")
    with open(path) as f:
        index = json.load(f)
    for shard in index["shards"]:
        (shard.get("zip_data") or shard["raw_data"])["hashes"] = {"md7": "0000"}
    with open(path, "w") as f:
        json.dump(index, f)
    assert main(["verify", folder]) == 0
    n = len(index["shards"])
    assert f"NOTE {n} of {n} shards carry no checksum this machine can compute" in capsys.readouterr().out


def test_verify_of_shard_files_named_alone_counts_no_chain(fixture_copy, capsys):
    folder = fixture_copy("jinx-b64-multishard")
    shards = sorted(n for n in os.listdir(folder) if n.endswith(".jinx"))
    for name in (shards[0], shards[5], shards[-1]):  # the chain's end alone is no chain missing its start
        assert main(["verify", os.path.join(folder, name)]) == 0, capsys.readouterr().out


def test_a_half_deleted_old_destination_is_not_put_back(tmp_path, fixture_copy, capsys):
    """A convert killed while deleting the moved-aside old DST (the new one already in place) leaves a
    .old folder with no stage beside it: when DST is gone later, that is no dataset to put back."""
    from torchforge._proc import host_name

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    old = tmp_path / f".dst.converting-h{host_name()}-p{int(done.stdout)}.old"
    old.mkdir()
    (old / "shard.00007.mds").write_bytes(b"x" * 100)
    assert main(["convert", fixture_copy("mds-streaming-none"), str(tmp_path / "dst"), "--to", "jinx", "-q"]) == 0
    assert not old.exists() and min(os.listdir(tmp_path / "dst")).startswith("shard-")


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys, tmp_path):
    from torchforge import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_verify", interrupted)
    assert main(["verify", str(tmp_path)]) == 130
    assert capsys.readouterr().err == "torchforge verify: interrupted\n"


def test_a_text_option_that_looks_like_a_number_stays_text(tmp_path, capsys):
    """-o split=2024 became the int 2024, and the JINX writer refused it (split takes a name)."""
    src = tmp_path / "rows.jsonl"
    src.write_text('{"id": 1}\n{"id": 2}\n')
    dst = tmp_path / "out"
    assert main(["convert", str(src), str(dst), "--to", "jinx", "-q", "-o", "split=2024",
                 "-o", "shard_size=1000000"]) == 0, capsys.readouterr()
    from torchforge.datasets.jinx import JinxDataset

    assert [int(s["id"]) for s in JinxDataset(str(dst), split="2024")] == [1, 2]  # the footers name the split
    assert len(JinxDataset(str(dst), split="other")) == 0
