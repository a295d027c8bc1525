"""Writing datasets to object storage: the fetcher's put/list/delete, ``convert`` to a URL (data first,
the index last, nothing half-written after a failure) and the CLI on URLs, against moto's S3 server on
127.0.0.1 behind a proxy that records every request and fails chosen PUTs."""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch
from expected import mds_rows, same

pytest.importorskip("obstore")
pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

import torchforge
from torchforge.cli import main
from torchforge.convert import convert
from torchforge.errors import CorruptShardError
from torchforge.lazy import materialize
from torchforge.remote import (
    FetcherClient,
    RemoteAccessError,
    RemoteError,
    RemoteExistsError,
    RemoteReadOnlyError,
    publish_phases,
)

BUCKET = "tf-write"
HERE = os.path.dirname(__file__)
INTEROP = os.path.join(HERE, "fixtures", "interop")


class Proxy:
    """Forwards every request to ``upstream`` and records it; ``fail(path, nth_put)`` returns a status to
    answer a PUT with instead (None forwards it); ``deny(method, path)`` the same for any request;
    ``lose(method, path)`` returns ``(seconds, status)``: wait, forward, then answer ``status`` instead of
    the server's reply (the object is stored, the client sees a failure) or the reply if it is None."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.split("://", 1)[1]
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status), in arrival order
        self.fail: Callable[[str, int], int | None] | None = None
        self.deny: Callable[[str, str], int | None] | None = None
        self.lose: Callable[[str, str], tuple[float, int | None]] | None = None
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> bytes | None:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        n = int(self.rfile.readline().split(b";")[0], 16)
                        if n == 0:
                            self.rfile.readline()
                            return out
                        out += self.rfile.read(n)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else None

            def _error(self, status: int) -> None:
                msg = b"<Error><Code>InternalError</Code></Error>"
                self.send_response(status)
                self.send_header("Content-Length", str(len(msg)))
                self.end_headers()
                self.wfile.write(msg)

            def _forward(self) -> None:
                body = self._body()
                with proxy.lock:
                    puts = sum(m == "PUT" for m, _, _ in proxy.requests)
                    status = proxy.fail(self.path, puts) if self.command == "PUT" and proxy.fail else None
                    if status is None and proxy.deny:
                        status = proxy.deny(self.command, self.path)
                    delay, lost = proxy.lose(self.command, self.path) if proxy.lose else (0.0, None)
                if delay:
                    time.sleep(delay)
                if status is not None:
                    with proxy.lock:
                        proxy.requests.append((self.command, self.path, status))
                    self._error(status)
                    return
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("connection", "transfer-encoding")}
                if body is not None:
                    headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                with proxy.lock:
                    proxy.requests.append((self.command, self.path, resp.status))
                if lost is not None:  # stored upstream; the client is told otherwise
                    self._error(lost)
                    return
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "server", "date",
                                         "content-length"):
                        self.send_header(k, v)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reset(self) -> None:
        with self.lock:
            self.requests, self.fail, self.deny, self.lose = [], None, None, None

    def puts(self) -> list[str]:
        """The object keys written (whole PUTs and multipart parts' objects), in the order they succeeded."""
        out = []
        for method, path, status in self.requests:
            key = path.split("?", 1)[0].removeprefix(f"/{BUCKET}/")
            if status == 200 and (method == "PUT" and "partNumber=" not in path
                                  or method == "POST" and "uploadId=" in path):
                out.append(key)
        return out


@pytest.fixture(scope="module")
def s3(moto_endpoint):
    """This module's bucket on the session's moto server, and a recording proxy in front of it."""
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    client.create_bucket(Bucket=BUCKET)
    proxy = Proxy(moto_endpoint)
    yield moto_endpoint, proxy, client
    proxy.server.shutdown()


@pytest.fixture
def env(s3, aws_env, monkeypatch, tmp_path):
    """AWS variables pointing at moto; requests go through the proxy (``storage_options``); returns a
    namespace of the fetcher client, the proxy, boto3's client, the options and the cache folder."""
    _endpoint, proxy, s3_client = s3
    monkeypatch.setenv("TORCHFORGE_CACHE_DIR", str(tmp_path / "user-cache"))
    proxy.reset()

    cache = str(tmp_path / "cache")

    def keys(prefix: str) -> list[str]:
        res = s3_client.list_objects_v2(Bucket=BUCKET, Prefix=prefix.rstrip("/") + "/")
        return sorted(o["Key"] for o in res.get("Contents", []))

    ns = SimpleNamespace(cache=cache, client=FetcherClient(cache), opts={"endpoint": proxy.url}, keys=keys,
                         proxy=proxy, s3=s3_client)
    yield ns
    ns.client.close()


def _write_mds(folder, n=60, seed=3, **opts):
    from torchforge.formats.mds import MDSWriter

    rows = list(mds_rows(n, seed))
    cols = {"id": "int", "text": "str", "image": "bytes", "messages": "json"}
    with MDSWriter(str(folder), cols, **opts) as w:
        for r in rows:
            w.write({k: r[k] for k in cols})
    return str(folder)


def _uploads_left(env) -> list[str]:
    folder = os.path.join(os.environ["TORCHFORGE_CACHE_DIR"], "uploads")
    return os.listdir(folder) if os.path.isdir(folder) else []


# -- the fetcher's writes --------------------------------------------------------------------------------
def test_put_list_delete_round_trip_with_multipart(env, tmp_path):
    small, big = tmp_path / "small.bin", tmp_path / "big.bin"
    small.write_bytes(b"hello")
    data = os.urandom(11 * 1024 * 1024 + 7)  # above obstore's 5 MiB part size: a multipart upload
    big.write_bytes(data)
    base = f"s3://{BUCKET}/rt"
    info = env.client.put(f"{base}/a/small.bin", small, storage_options=env.opts)
    assert info.size == 5 and info.etag
    assert env.client.put(f"{base}/big.bin", big, storage_options=env.opts).size == len(data)
    assert any(m == "PUT" and "partNumber=" in p for m, p, _ in env.proxy.requests)
    assert env.client.head(f"{base}/big.bin").size == len(data)
    (back,) = env.client.get_ranges(f"{base}/big.bin", [(0, len(data))])
    assert hashlib.sha1(back).digest() == hashlib.sha1(data).digest()
    listed = env.client.list_objects(base + "/", storage_options=env.opts)
    assert listed == [(f"{base}/a/small.bin", 5), (f"{base}/big.bin", len(data))]
    assert env.client.list_objects(f"s3://{BUCKET}/r") == []  # a folder prefix, not a string prefix
    env.client.delete([u for u, _ in listed] + [f"{base}/never-there"], storage_options=env.opts)
    assert env.keys("rt") == []


def test_put_retries_transient_failures_and_names_the_url_when_it_gives_up(env, tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"x" * 1000)
    url = f"s3://{BUCKET}/retry/x.bin"
    env.proxy.fail = lambda path, n: 503 if n < 2 else None
    assert env.client.put(url, f, storage_options=env.opts).size == 1000
    assert [s for m, _, s in env.proxy.requests if m == "PUT"] == [503, 503, 200]
    env.proxy.fail = lambda path, n: 500
    with pytest.raises(RemoteError, match="retries") as e:
        env.client.put(f"s3://{BUCKET}/retry/y.bin", f, storage_options=env.opts)
    assert e.value.url == f"s3://{BUCKET}/retry/y.bin" and "retry/y.bin" in str(e.value)
    env.proxy.reset()
    env.proxy.fail = lambda path, n: 403
    with pytest.raises(RemoteAccessError) as e:
        env.client.put(f"s3://{BUCKET}/retry/z.bin", f, storage_options=env.opts)
    assert e.value.url.endswith("retry/z.bin")
    assert sum(m == "PUT" for m, _, _ in env.proxy.requests) == 1  # denied: not retried
    assert env.keys("retry") == ["retry/x.bin"]


def test_writing_to_http_is_refused_clearly(env, tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"x")
    with pytest.raises(RemoteReadOnlyError, match="read-only") as e:
        env.client.put("https://example.com/data/x.bin", f)
    assert e.value.url == "https://example.com/data/x.bin" and isinstance(e.value, PermissionError)
    src = _write_mds(tmp_path / "src")
    with pytest.raises(RemoteReadOnlyError, match="read-only"):
        convert(src, "http://127.0.0.1:9/data", to="mds", cache_dir=env.cache)
    assert main(["convert", src, "http://127.0.0.1:9/data", "--to", "mds", "-q"]) == 1


def test_publish_phases_put_the_file_a_reader_trusts_last(tmp_path):
    mds = tmp_path / "mds"
    _write_mds(mds, size_limit=16384)
    phases = publish_phases(mds)
    assert phases[-1] == ["index.json"] and len(phases) == 2 and len(phases[0]) > 2
    jinx = tmp_path / "jinx"
    jinx.mkdir()
    for name in ("shard-00000.jinx", "shard-00000.binx", "shard-00001.jinx", "shard-00002.jinx",
                 "shard-00002.binx", ".hidden"):
        (jinx / name).write_bytes(b"")
    assert publish_phases(jinx) == [["shard-00000.binx", "shard-00002.binx"],
                                    ["shard-00000.jinx", "shard-00001.jinx"], ["shard-00002.jinx"]]
    other = tmp_path / "st"
    other.mkdir()
    for name in ("b.safetensors", "a.safetensors"):
        (other / name).write_bytes(b"")
    assert publish_phases(other) == [["a.safetensors"], ["b.safetensors"]]


# -- convert to a URL ------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["mds-streaming-none", "jinx-b64-zst-binx-mds-safe"])
def test_convert_to_s3_uploads_the_index_last_and_reads_back_every_sample(env, tmp_path, source):
    if source == "mds-streaming-none":
        src = os.path.join(INTEROP, source)
    else:  # a JINX source with a sidecar, of columns MDS holds
        from torchforge.formats.jinx import JinxWriter

        src = str(tmp_path / "jinx-src")
        with JinxWriter(src, shard_size=2048, encoding="b64", binary_threshold=64) as w:
            for r in mds_rows(40, 5):
                w.write({"id": r["id"], "text": r["text"], "image": r["image"]})
    url = f"s3://{BUCKET}/conv/{source}"
    stats = convert(src, url, to="mds", cache_dir=env.cache, storage_options=env.opts, hashes=["sha1"],
                    size_limit=8192)
    assert stats.out == url
    written = env.proxy.puts()
    assert written[-1] == f"conv/{source}/index.json" and written.count(f"conv/{source}/index.json") == 1
    assert len(written) >= 3 and env.keys(f"conv/{source}") == sorted(written)
    assert not _uploads_left(env)  # the temporary folder is gone
    want = [materialize(s) for s in torchforge.open_dataset(src)]
    for mode in ("shards", "ranges"):
        got = torchforge.open_dataset(url, cache_dir=tmp_path / f"read-{mode}", mode=mode,
                                      storage_options=env.opts)
        assert len(got) == len(want) == stats.written
        for i, (a, b) in enumerate(zip(want, got)):
            assert same(a, materialize(b)) == "", (mode, i)


def test_convert_jinx_to_s3_uploads_sidecars_then_shards_then_the_last_shard(env, tmp_path):
    src = os.path.join(INTEROP, "mds-streaming-none")
    url = f"s3://{BUCKET}/jx/out"
    convert(src, url, to="jinx", cache_dir=env.cache, storage_options=env.opts, shard_size=4096,
            binary_threshold=64)
    written = [k.removeprefix("jx/out/") for k in env.proxy.puts()]
    jinx = sorted(k for k in written if k.endswith(".jinx"))
    sidecars = [k for k in written if k.endswith(".binx")]
    assert len(jinx) > 2 and sidecars and len(written) == len(jinx) + len(sidecars)
    assert written[-1] == jinx[-1]  # the shard whose footer ends the chain
    first_shard = min(written.index(k) for k in jinx)
    assert all(written.index(k) < first_shard for k in sidecars)
    assert env.keys("jx/out") == sorted(f"jx/out/{k}" for k in written)
    local = tmp_path / "back"  # the uploaded objects are the dataset a local reader reads
    local.mkdir()
    for k in written:
        env.s3.download_file(BUCKET, f"jx/out/{k}", str(local / k))
    want = [materialize(s) for s in torchforge.open_dataset(src)]
    got = [materialize(s) for s in torchforge.open_dataset(str(local))]
    assert len(got) == len(want) and all(same(a, b) == "" for a, b in zip(want, got))
    one = f"s3://{BUCKET}/jx/one.jinx"  # shard_size=None: one file, uploaded to the URL itself
    convert(src, one, to="jinx", cache_dir=env.cache, storage_options=env.opts, shard_size=None)
    with pytest.raises(RemoteExistsError):
        convert(src, one, to="jinx", cache_dir=env.cache, storage_options=env.opts, shard_size=None)
    env.s3.download_file(BUCKET, "jx/one.jinx", str(tmp_path / "one.jinx"))
    got = [materialize(s) for s in torchforge.open_dataset(str(tmp_path / "one.jinx"))]
    assert len(got) == len(want) and all(same(a, b) == "" for a, b in zip(want, got))


def test_a_destination_holding_objects_is_refused_unless_overwrite(env, tmp_path):
    url = f"s3://{BUCKET}/ow/data"
    convert(_write_mds(tmp_path / "a", n=60), url, to="mds", cache_dir=env.cache, storage_options=env.opts,
            size_limit=16384)
    before = env.keys("ow/data")
    assert len(before) > 3
    src_b = _write_mds(tmp_path / "b", n=5, seed=9)
    with pytest.raises(RemoteExistsError, match="overwrite") as e:
        convert(src_b, url, to="mds", cache_dir=env.cache, storage_options=env.opts)
    assert e.value.url == url and isinstance(e.value, FileExistsError)
    assert main(["convert", src_b, url, "--to", "mds", "-q", "--cache-dir", env.cache]) == 2
    assert env.keys("ow/data") == before
    convert(src_b, url, to="mds", cache_dir=env.cache, storage_options=env.opts, overwrite=True)
    after = env.keys("ow/data")
    assert after == ["ow/data/index.json", "ow/data/shard.00000.mds"]  # no stale shard of the old one
    ds = torchforge.open_dataset(url, cache_dir=tmp_path / "read", storage_options=env.opts)
    assert [s["id"] for s in ds] == [r["id"] for r in mds_rows(5, 9)]


@pytest.mark.parametrize("when", ["index", "after-3"])
def test_a_failed_upload_leaves_no_index(env, tmp_path, when):
    src = _write_mds(tmp_path / "src", n=60)
    url = f"s3://{BUCKET}/fail/{when}"
    if when == "index":
        env.proxy.fail = lambda path, n: 500 if "index.json" in path else None
    else:
        env.proxy.fail = lambda path, n: 500 if n >= 3 else None
    with pytest.raises(RemoteError) as e:
        convert(src, url, to="mds", cache_dir=env.cache, storage_options=env.opts, size_limit=16384)
    assert e.value.url.startswith(url + "/")
    if when == "index":
        assert e.value.url == f"{url}/index.json"
    env.proxy.fail = None
    assert f"fail/{when}/index.json" not in env.keys(f"fail/{when}")
    assert env.keys(f"fail/{when}") == []  # the shards it wrote are removed again
    assert not _uploads_left(env)
    with pytest.raises(RemoteError):
        torchforge.open_dataset(url, cache_dir=tmp_path / "read", storage_options=env.opts)


# -- the CLI on URLs -------------------------------------------------------------------------------------
def test_cli_convert_inspect_verify_bench_on_a_url(env, tmp_path, capsys):
    src = os.path.join(INTEROP, "mds-streaming-none")
    url = f"s3://{BUCKET}/cli/ds"
    so = ["--storage-option", f"endpoint={env.proxy.url}"]
    assert main(["convert", src, url, "--to", "mds", "-q", "-o", "size_limit=8192", "--cache-dir", env.cache,
                 *so]) == 0
    assert f"wrote 200 samples to {url}" in capsys.readouterr().out
    assert main(["inspect", url, "--json", "--cache-dir", str(tmp_path / "c1"), *so]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["path"] == url and info["format"] == "mds" and info["samples"] == 200
    assert info["shards"] and sum(s["bytes"] for s in info["shards"]) == info["bytes"]
    assert set(info["fields"]) >= {"id"}
    assert main(["inspect", url, "--mode", "ranges", "--cache-dir", str(tmp_path / "c2"), *so]) == 0
    assert "samples: 200" in capsys.readouterr().out
    assert main(["verify", url, "--cache-dir", str(tmp_path / "c3"), "--cache-limit", "10MB", *so]) == 0
    assert "200 samples decoded, 0 problems" in capsys.readouterr().out
    assert main(["verify", url, "--mode", "ranges", *so]) == 2
    capsys.readouterr()
    assert main(["bench", url, "--mode", "ranges", "--limit", "50", "--cache-dir", str(tmp_path / "c4"),
                 *so]) == 0
    out = capsys.readouterr().out
    assert "iterate" in out and "shuffle" in out
    back = str(tmp_path / "back")  # and a URL as the source
    assert main(["convert", url, back, "--to", "jinx", "-q", "--cache-dir", str(tmp_path / "c5"), *so]) == 0
    want = [materialize(s) for s in torchforge.open_dataset(src)]
    got = [materialize(s) for s in torchforge.open_dataset(back)]
    assert len(got) == 200 and all(same(a, b) == "" for a, b in zip(want, got))
    with pytest.raises(SystemExit):
        main(["inspect", url, "--storage-option", "no-equals-sign"])


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_verify_names_a_damaged_remote_shard(env, tmp_path, capsys, damage):
    src = _write_mds(tmp_path / "src", n=60)
    url = f"s3://{BUCKET}/bad/{damage}"
    convert(src, url, to="mds", cache_dir=env.cache, storage_options=env.opts, size_limit=16384,
            hashes=["sha1"])
    shard = sorted(k for k in env.keys(f"bad/{damage}") if k.endswith(".mds"))[1]
    data = bytearray(env.s3.get_object(Bucket=BUCKET, Key=shard)["Body"].read())
    if damage == "flipped":
        data[-3] ^= 0xFF
    else:
        data = data[:-10]
    env.s3.put_object(Bucket=BUCKET, Key=shard, Body=bytes(data))
    code = main(["verify", url, "--cache-dir", str(tmp_path / "verify"), "--storage-option",
                 f"endpoint={env.proxy.url}"])
    out = capsys.readouterr().out
    assert code == 1
    damaged = [line for line in out.splitlines() if line.startswith("DAMAGED")]
    assert len(damaged) == 1 and f"s3://{BUCKET}/{shard}" in damaged[0]
    assert ("sha1" if damage == "flipped" else "bytes") in damaged[0]
    n_bad = torchforge.open_dataset(url, cache_dir=env.cache, storage_options=env.opts).metas[1].samples
    assert f"{60 - n_bad} samples decoded, 1 problems" in out


def test_file_urls_are_local_paths(env, tmp_path, capsys):
    src = _write_mds(tmp_path / "src", n=10)
    dst = tmp_path / "out"
    assert main(["convert", src, f"file://{dst}", "--to", "jinx", "-q"]) == 0
    assert main(["verify", f"file://{dst}"]) == 0
    assert "10 samples decoded, 0 problems" in capsys.readouterr().out
    shutil.rmtree(dst)


# -- failures the client cannot see the end of -------------------------------------------------------------
def test_an_index_stored_though_its_put_failed_is_removed_with_the_rest(env, tmp_path):
    src = _write_mds(tmp_path / "src", n=60)
    url = f"s3://{BUCKET}/lost/index"
    env.proxy.lose = lambda method, path: (0.0, 500) if method == "PUT" and "index.json" in path else (0.0, None)
    with pytest.raises(RemoteError) as e:
        convert(src, url, to="mds", cache_dir=env.cache, storage_options=env.opts, size_limit=16384)
    assert e.value.url == f"{url}/index.json"
    env.proxy.lose = None
    assert env.keys("lost/index") == []  # before: index.json stayed, naming shards that were removed


def test_an_interrupt_while_the_index_is_in_flight_leaves_nothing_behind(env, tmp_path):
    import signal

    src = _write_mds(tmp_path / "src", n=60)
    url = f"s3://{BUCKET}/lost/interrupt"
    sent = threading.Event()

    def lose(method, path):  # the proxy, as the index's PUT reaches it: Ctrl-C (a real SIGINT), then store it late
        if method == "PUT" and "index.json" in path and not sent.is_set():
            sent.set()
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            return 2.0, None
        return 0.0, None

    from torchforge.remote.upload import upload

    local = tmp_path / "mds"
    convert(src, str(local), to="mds", size_limit=16384)
    env.proxy.lose = lose
    with pytest.raises(KeyboardInterrupt):
        upload(local, url, cache_dir=env.cache, storage_options=env.opts)
    assert sent.is_set()
    time.sleep(2.5)  # a PUT left in flight (the fetcher finishes what it was handed) has landed by now
    env.proxy.lose = None
    assert env.keys("lost/interrupt") == []  # before: the index landed after the shards were removed


def test_an_interrupt_while_a_phase_starts_its_threads_still_waits_for_their_puts(env, tmp_path, monkeypatch):
    """Ctrl-C landing in ThreadPoolExecutor.submit after the thread started, before the pool recorded it:
    the pool's shutdown does not wait for that thread, which may already be sending the index; the cleanup
    must wait for it all the same (seen under load in CI-like runs: the index alone was left behind)."""
    src = _write_mds(tmp_path / "src", n=60)
    url = f"s3://{BUCKET}/lost/starting"
    env.proxy.lose = lambda method, path: (1.0, None) if method == "PUT" and "index.json" in path else (0.0, None)
    start, pools = threading.Thread.start, []

    def interrupted_start(self):
        start(self)
        if self.name.startswith("torchforge-upload") and self.name.endswith("_0"):
            pools.append(self.name)
            if len(pools) == 2:  # the second phase's first thread: the index's
                time.sleep(0.1)  # (it has taken the index and sent it)
                raise KeyboardInterrupt

    from torchforge.remote.upload import upload

    local = tmp_path / "mds"
    convert(src, str(local), to="mds", size_limit=16384)
    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        upload(local, url, cache_dir=env.cache, storage_options=env.opts)
    monkeypatch.undo()
    assert len(pools) == 2
    time.sleep(1.5)
    env.proxy.lose = None
    assert env.keys("lost/starting") == []  # before: the index, stored after the cleanup


def test_a_refused_listing_is_an_access_error_at_once_not_retried(env, tmp_path):
    src = _write_mds(tmp_path / "src", n=5)
    env.proxy.deny = lambda method, path: 403 if method == "GET" and "list-type" in path else None
    with pytest.raises(RemoteAccessError, match="access denied"):
        convert(src, f"s3://{BUCKET}/denied/x", to="mds", cache_dir=env.cache, storage_options=env.opts)
    assert sum(m == "GET" for m, _, _ in env.proxy.requests) == 1  # before: 7 (six retries of a 403)


def test_a_jinx_dataset_missing_the_end_of_its_chain_is_refused_not_read_short(env, tmp_path):
    from torchforge.errors import FormatError

    local = tmp_path / "jx"
    convert(os.path.join(INTEROP, "mds-streaming-none"), str(local), to="jinx", shard_size=4096,
            binary_threshold=64)
    names = sorted(os.listdir(local))
    shards = [n for n in names if n.endswith(".jinx")]
    assert len(shards) >= 3
    n_all = len(torchforge.open_dataset(str(local)))
    for n in names:  # what a reader lists while the last shard, which ends the chain, is on its way
        if n != shards[-1]:
            env.s3.upload_file(str(local / n), BUCKET, f"chain/uploading/{n}")
    with pytest.raises(FormatError, match="the dataset is incomplete: no shard ends its chain") as e:
        torchforge.open_dataset(f"s3://{BUCKET}/chain/uploading", cache_dir=tmp_path / "read-uploading",
                                storage_options=env.opts)  # before: it opened, short
    assert e.value.path == f"s3://{BUCKET}/chain/uploading/{shards[-2]}"
    for n in names:  # whole, and with its shards renumbered after writing (the footers name the old names)
        env.s3.upload_file(str(local / n), BUCKET, f"chain/whole/{n}")
        k = int(n.split("-")[1].split(".")[0])
        env.s3.upload_file(str(local / n), BUCKET, f"chain/renamed/shard-{k + 100:05d}.{n.rsplit('.', 1)[1]}")
    for case in ("whole", "renamed"):
        ds = torchforge.open_dataset(f"s3://{BUCKET}/chain/{case}", cache_dir=tmp_path / f"read-{case}",
                                     storage_options=env.opts)
        assert len(ds) == n_all, case


def test_a_convert_killed_mid_upload_has_its_staging_folder_removed_by_the_next(env, tmp_path):
    from torchforge._proc import host_name

    base = os.path.join(env.cache, "uploads")
    dead = os.path.join(base, f"convert-h{host_name()}-p999999999-abc")  # a convert SIGKILLed mid-upload
    other_host = os.path.join(base, f"convert-h{host_name()}x-p999999999-abc")  # a shared cache's other node
    for d in (dead, other_host):
        os.makedirs(os.path.join(d, "dataset"))
        with open(os.path.join(d, "dataset", "shard.00000.mds"), "wb") as f:
            f.write(b"x" * 1000)
    convert(_write_mds(tmp_path / "src", n=5), f"s3://{BUCKET}/staging/x", to="mds", cache_dir=env.cache,
            storage_options=env.opts)
    assert sorted(os.listdir(base)) == [os.path.basename(other_host)]  # before: the dead one stayed for good


_S3_ERR = "Generic S3 error: Error performing {m} http://127.0.0.1:9/tf/{key} in 3ms - Server returned non-2xx status code: {s}"


@pytest.mark.parametrize(("method", "key", "reply", "kind"), [
    # a key that reads like a status says nothing about the reply (before: a 503 on it was "not found")
    ("GET", "logs/status404.json", "503 Service Unavailable: <Error><Code>SlowDown</Code></Error>", "_Transient"),
    ("PUT", "logs/status403.json", "500 Internal Server Error", "_Transient"),
    ("GET", "notes/nosuchkey.txt", "503 Service Unavailable", "_Transient"),
    ("GET", "status200.bin", "400 Bad Request: <Error><Code>InvalidArgument</Code></Error>", "RemoteError"),
    # S3 sends a stalled upload 400 RequestTimeout, which its SDKs retry
    ("PUT", "k", "400 Bad Request: <Error><Code>RequestTimeout</Code></Error>", "_Transient"),
    ("GET", "k", "409 Conflict: <Error><Code>OperationAborted</Code></Error>", "_Transient"),
    ("GET", "k", "403 Forbidden: <Error><Code>SignatureDoesNotMatch</Code></Error>", "RemoteAccessError"),
    ("GET", "k", "404 Not Found: <Error><Code>NoSuchKey</Code></Error>", "RemoteNotFoundError"),
])
def test_obstore_errors_are_classified_by_the_reply_not_the_url(method, key, reply, kind):
    from obstore import exceptions as ox

    from torchforge.remote.fetcher import _classify

    err = _classify(ox.GenericError(_S3_ERR.format(m=method, key=key, s=reply)), f"s3://tf/{key}")
    assert type(err).__name__ == kind, err


def test_the_fetcher_runs_in_its_own_session_so_a_terminal_ctrl_c_does_not_kill_it(env, tmp_path):
    import psutil

    env.client.list_objects(f"s3://{BUCKET}/none/", storage_options=env.opts)  # starts this cache's fetcher
    fetchers = [p for p in psutil.Process().children() if env.cache in " ".join(p.cmdline())]
    assert len(fetchers) == 1
    # Ctrl-C signals the terminal's foreground process group: before, the fetcher was in the job's and
    # died mid-request, and the upload's cleanup then raced a second fetcher re-sending the PUTs
    assert os.getpgid(fetchers[0].pid) != os.getpgid(0) and os.getsid(fetchers[0].pid) != os.getsid(0)


# -- overwrites and cleanups that fail half-way (found by review) --------------------------------------------
def test_an_overwrite_replaces_the_old_dataset_and_keeps_other_objects(env, tmp_path):
    """--overwrite deletes the old dataset's files only: a README, notes and a sub-folder's other files at
    the destination stay (before, every object below the prefix was deleted)."""
    url = f"s3://{BUCKET}/keep/ds"
    convert(_write_mds(tmp_path / "a", n=60), url, to="mds", cache_dir=env.cache, storage_options=env.opts,
            size_limit=16384)
    for key in ("keep/ds/README.md", "keep/ds/notes/labels.csv", "keep/ds/val/index.json.bak"):
        env.s3.put_object(Bucket=BUCKET, Key=key, Body=b"mine")
    convert(_write_mds(tmp_path / "b", n=5, seed=9), url, to="mds", cache_dir=env.cache, storage_options=env.opts,
            overwrite=True)
    assert env.keys("keep/ds") == ["keep/ds/README.md", "keep/ds/index.json", "keep/ds/notes/labels.csv",
                                   "keep/ds/shard.00000.mds", "keep/ds/val/index.json.bak"]
    ds = torchforge.open_dataset(url, cache_dir=tmp_path / "read", storage_options=env.opts)
    assert [s["id"] for s in ds] == [r["id"] for r in mds_rows(5, 9)]


def test_an_overwrite_whose_deletes_fail_half_way_leaves_no_shorter_old_dataset(env, tmp_path):
    """A JINX overwrite deletes the shard that ends the old chain first, then the others last first: when a
    later delete fails, what is left is refused as an incomplete chain (before, the old dataset's head was
    deleted first, and a failure left its tail, which opened as a short dataset and passed verify)."""
    url = f"s3://{BUCKET}/half/ds"
    convert(_write_mds(tmp_path / "a", n=60), url, to="jinx", cache_dir=env.cache, storage_options=env.opts,
            shard_size=4096, compression=None)
    old = [k for k in env.keys("half/ds") if k.endswith(".jinx")]
    assert len(old) >= 3
    deletes: list[str] = []

    def deny(method, path):
        if method == "POST" and "delete" in path.split("?", 1)[-1]:
            deletes.append(path)
            return 500 if len(deletes) > 1 else None  # the first group goes, every later request fails
        return None

    env.proxy.deny = deny
    try:
        with pytest.raises(RemoteError):
            convert(_write_mds(tmp_path / "b", n=5, seed=9), url, to="jinx", cache_dir=env.cache,
                    storage_options={**env.opts, "max_retries": 0}, overwrite=True)
    finally:
        env.proxy.deny = None
    left = [k for k in env.keys("half/ds") if k.endswith(".jinx") and "/.torchforge-upload-" not in k]
    assert left == old[:-1]  # the chain's end went first; nothing new was copied into place
    with pytest.raises(CorruptShardError, match="incomplete"):
        torchforge.open_dataset(url, cache_dir=tmp_path / "read", storage_options=env.opts)


@pytest.mark.parametrize("to", ["mds", "jinx"])
def test_a_failed_upload_whose_last_file_cannot_be_removed_keeps_its_data_files(env, tmp_path, to):
    """The last file (index.json, the chain's last shard) is stored though its PUT's reply was lost, and
    removing it fails: the cleanup then leaves every file in place, so the dataset there is whole (before, it
    removed the rest: an index naming no shards, or a lone last shard that opened as a 5-sample dataset)."""
    src = _write_mds(tmp_path / "src", n=60)
    local = tmp_path / "local"
    opts = {"size_limit": 8192} if to == "mds" else {"shard_size": 8192, "compression": None}
    convert(src, str(local), to=to, **opts)
    last = "index.json" if to == "mds" else max(f for f in os.listdir(local) if f.endswith(".jinx"))
    url = f"s3://{BUCKET}/dangling/{to}"
    deletes: list[str] = []

    def deny(method, path):
        if method == "POST" and "delete" in path.split("?", 1)[-1]:
            deletes.append(path)
            return 500  # every delete fails
        return None

    env.proxy.lose = lambda m, p: (0.0, 500) if m == "PUT" and p.split("?")[0].endswith(last) else (0.0, None)
    env.proxy.deny = deny
    try:
        with pytest.raises(RemoteError):
            convert(src, url, to=to, cache_dir=env.cache, storage_options={**env.opts, "max_retries": 0}, **opts)
    finally:
        env.proxy.lose = env.proxy.deny = None
    assert len(deletes) == 1  # the last file's delete failed: no other delete was tried
    ds = torchforge.open_dataset(url, cache_dir=tmp_path / "read", storage_options=env.opts)
    assert sorted(int(s["id"]) for s in ds) == sorted(r["id"] for r in mds_rows(60, 3))


def test_verify_says_when_no_checksum_covers_the_shards(env, tmp_path, capsys):
    """A byte changed inside a string value still decodes: verify cannot see it where the writer recorded
    no hashes, and now says so on a NOTE line (before: '0 problems' and nothing else)."""
    url = f"s3://{BUCKET}/nohash/ds"
    convert(_write_mds(tmp_path / "src", n=20), url, to="mds", cache_dir=env.cache, storage_options=env.opts)
    assert main(["verify", url, "--cache-dir", str(tmp_path / "v"), "--storage-option",
                 f"endpoint={env.proxy.url}"]) == 0
    out = capsys.readouterr().out
    assert "NOTE 1 of 1 shards carry no checksum this machine can compute (mds: no hashes, or of unknown" in out


def test_errors_of_a_remote_mds_shard_name_its_url(env, tmp_path):
    """A shard whose header contradicts index.json is found when it is mapped from the node's cache; the
    error names its URL (before, the cache file)."""
    url = f"s3://{BUCKET}/named/ds"
    convert(_write_mds(tmp_path / "src", n=60), url, to="mds", cache_dir=env.cache, storage_options=env.opts,
            size_limit=16384)
    shard = sorted(k for k in env.keys("named/ds") if k.endswith(".mds"))[1]
    data = bytearray(env.s3.get_object(Bucket=BUCKET, Key=shard)["Body"].read())
    data[0] ^= 0x01  # the sample count in the shard's header
    env.s3.put_object(Bucket=BUCKET, Key=shard, Body=bytes(data))
    ds = torchforge.open_dataset(url, cache_dir=tmp_path / "read", cache_limit="1GB", storage_options=env.opts)
    with pytest.raises(CorruptShardError, match="index.json says") as e:
        ds[ds.metas[0].samples]  # the first sample of shard.00001
    assert e.value.path == f"s3://{BUCKET}/{shard}"


def test_a_safetensors_dataset_missing_its_last_shard_is_refused_not_read_short(env, tmp_path):
    from torchforge.datasets.safetensors import SafetensorsShardWriter
    from torchforge.errors import CorruptShardError

    local = tmp_path / "st"
    with SafetensorsShardWriter(local, samples_per_shard=7) as w:
        for i in range(30):
            w.write({"x": torch.arange(i % 5 + 1) + i, "y": i})
    names = sorted(os.listdir(local))
    assert len(names) == 5
    for n in names[:-1]:  # what a reader lists while the last shard, uploaded last, is on its way
        env.s3.upload_file(str(local / n), BUCKET, f"st/uploading/{n}")
    for mode in ("shards", "ranges"):
        with pytest.raises(CorruptShardError, match="the dataset is incomplete: none of its 4 shards") as e:
            torchforge.open_dataset(f"s3://{BUCKET}/st/uploading", cache_dir=tmp_path / f"r-{mode}", mode=mode,
                                    storage_options=env.opts)  # before: it opened with 28 of 30 samples
        assert e.value.path == f"s3://{BUCKET}/st/uploading"
    url = f"s3://{BUCKET}/st/whole"
    convert(str(local), url, to="safetensors", cache_dir=env.cache, storage_options=env.opts, samples_per_shard=7)
    assert env.proxy.puts()[-1] == f"st/whole/{names[-1]}"  # the marked shard is the last one stored
    for mode in ("shards", "ranges"):
        ds = torchforge.open_dataset(url, cache_dir=tmp_path / f"w-{mode}", mode=mode, storage_options=env.opts)
        assert len(ds) == 30 and ds[29]["y"].item() == 29 and ds[29]["x"].tolist() == [29, 30, 31, 32, 33]


@pytest.mark.parametrize("prefix", ["run#1/ds", "q?x=1/ds", "pct%41/ds", "sp ace+eq=/ds"])
def test_a_key_with_url_characters_is_the_key_as_written(env, tmp_path, prefix):
    """'#', '?' and '%' are characters of an object key, as for the cloud CLIs: no fragment, query or
    percent-decoding (a '#' once cut the key, and every file of a convert went to one key before it)."""
    head = prefix.split("/")[0][:3]
    env.s3.put_object(Bucket=BUCKET, Key=head, Body=b"unrelated")
    url = f"s3://{BUCKET}/{prefix}"
    src = _write_mds(tmp_path / "src", n=12)
    convert(src, url, to="mds", cache_dir=env.cache, storage_options=env.opts)
    assert env.keys(prefix) == [f"{prefix}/index.json", f"{prefix}/shard.00000.mds"]
    assert env.s3.get_object(Bucket=BUCKET, Key=head)["Body"].read() == b"unrelated"
    ds = torchforge.open_dataset(url, cache_dir=tmp_path / "read", storage_options=env.opts)
    assert [s["id"] for s in ds] == [r["id"] for r in mds_rows(12, 3)]


def test_file_urls_take_every_form_and_the_options_a_url_takes(tmp_path):
    src = _write_mds(tmp_path / "m", n=10)
    for url in (f"file://{src}", f"FILE://{src}", f"file://localhost{src}"):
        assert len(torchforge.open_dataset(url)) == 10, url
        assert len(torchforge.MDSDataset(url)) == 10, url
    for opts in ({"mode": "ranges"}, {"cache_limit": "1GB"}, {"storage_options": {}}, {"cache_policy": "lru"}):
        assert len(torchforge.open_dataset(f"file://{src}", **opts)) == 10, opts  # no object store: no effect


def test_cli_errors_on_urls_are_one_line(env, tmp_path, capsys):
    url = f"s3://{BUCKET}/cli-err/ds"
    convert(_write_mds(tmp_path / "m", n=40), url, to="mds", cache_dir=env.cache, storage_options=env.opts,
            size_limit=4096)
    so = ["--cache-dir", env.cache, "--storage-option", f"endpoint={env.proxy.url}"]
    for argv, says in ((["inspect", url, "--cache-limit", "abc"], "cache_limit='abc'"),
                       (["inspect", "s3://", *so], "names no bucket"),
                       (["verify", url, "--cache-limit", "1kB"], "exceed cache_limit")):
        assert main([*argv, *so] if argv[1] != "s3://" else argv) == 1, argv
        err = capsys.readouterr()
        assert says in err.err and "Traceback" not in err.err and "DAMAGED" not in err.out, (argv, err)


def test_a_destination_containing_its_source_is_refused_however_the_urls_are_spelled(env, tmp_path, capsys):
    """convert --overwrite to a folder URL that holds the source deleted the source: the CLI compared the
    raw strings (s3a:// passed), and convert() did not check at all."""
    src = f"s3://{BUCKET}/nest/x/sub"
    convert(_write_mds(tmp_path / "a", n=5), src, to="mds", cache_dir=env.cache, storage_options=env.opts)
    before = env.keys("nest/x/sub")
    for s, d in ((src, f"s3://{BUCKET}/nest/x"), (f"s3a://{BUCKET}/nest/x/sub/", f"S3://{BUCKET}//nest/x/")):
        with pytest.raises(torchforge.TorchforgeError, match="contains SRC"):
            convert(s, d, to="jinx", cache_dir=env.cache, storage_options=env.opts, overwrite=True)
        assert main(["convert", s, d, "--to", "jinx", "-q", "--overwrite", "--cache-dir", env.cache]) == 2
        assert "contains SRC" in capsys.readouterr().err
    assert env.keys("nest/x/sub") == before


def test_a_read_only_destination_is_named_as_given(env, tmp_path):
    with pytest.raises(RemoteReadOnlyError) as e:
        convert(_write_mds(tmp_path / "a", n=3), "http://127.0.0.1:9/bkt/x", to="mds", cache_dir=env.cache)
    assert e.value.url == "http://127.0.0.1:9/bkt/x" and "/_" not in str(e.value)


@pytest.mark.parametrize("to", ["mds", "jinx"])
def test_a_failed_overwrite_leaves_the_old_dataset_intact(env, tmp_path, to):
    """An overwrite deleted the old dataset before the first PUT of the new one: one failed PUT, and the
    URL held nothing. Now the new files go to a staging prefix first; the old dataset is deleted only once
    they are all there, and a failed upload leaves it as it was (and no staging objects)."""
    url = f"s3://{BUCKET}/intact/{to}"
    opts = {"size_limit": 16384} if to == "mds" else {"shard_size": 16384}
    convert(_write_mds(tmp_path / "a", n=60), url, to=to, cache_dir=env.cache, storage_options=env.opts, **opts)
    before = {k: env.s3.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in env.keys(f"intact/{to}")}
    assert len(before) > 3
    env.proxy.fail = lambda path, n: 503 if n >= 2 else None  # the third PUT and every one after it
    try:
        with pytest.raises(RemoteError, match="retries"):
            convert(_write_mds(tmp_path / "b", n=60, seed=9), url, to=to, cache_dir=env.cache,
                    storage_options={**env.opts, "max_retries": 1}, overwrite=True, **opts)
    finally:
        env.proxy.fail = None
    after = {k: env.s3.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in env.keys(f"intact/{to}")}
    assert after == before  # every old object, byte for byte, and nothing else
    ds = torchforge.open_dataset(url, cache_dir=tmp_path / "read", storage_options=env.opts)
    assert [s["id"] for s in ds] == [r["id"] for r in mds_rows(60, 3)]
    # and an overwrite that succeeds leaves the new dataset only
    convert(_write_mds(tmp_path / "c", n=7, seed=9), url, to=to, cache_dir=env.cache, storage_options=env.opts,
            overwrite=True, **opts)
    assert not [k for k in env.keys(f"intact/{to}") if ".torchforge-upload-" in k]
    ds = torchforge.open_dataset(url, cache_dir=tmp_path / "read2", storage_options=env.opts)
    assert [s["id"] for s in ds] == [r["id"] for r in mds_rows(7, 9)]


def test_an_overwrite_whose_server_side_copy_is_refused_uploads_that_file_again(env, tmp_path, monkeypatch):
    """S3 copies at most 5 GiB in one request: a refused copy came after the old dataset was deleted, and
    the URL was left empty. The local file is still there: it is uploaded again instead."""
    url = f"s3://{BUCKET}/recopy/ds"
    convert(_write_mds(tmp_path / "a", n=60), url, to="mds", cache_dir=env.cache, storage_options=env.opts,
            size_limit=16384)
    copy = FetcherClient.copy

    def refuse_one(self, source, dst, **kw):
        if dst.endswith("shard.00001.mds"):
            raise RemoteError("InvalidRequest: the specified copy source is larger than the maximum allowable "
                              "size for a copy source", url=dst)
        return copy(self, source, dst, **kw)

    monkeypatch.setattr(FetcherClient, "copy", refuse_one)
    convert(_write_mds(tmp_path / "b", n=60, seed=9), url, to="mds", cache_dir=env.cache, storage_options=env.opts,
            overwrite=True, size_limit=16384)
    ds = torchforge.open_dataset(url, cache_dir=tmp_path / "read", storage_options=env.opts)
    assert [s["id"] for s in ds] == [r["id"] for r in mds_rows(60, 9)]
    assert not [k for k in env.keys("recopy/ds") if ".torchforge-upload-" in k]


def test_an_overwrite_at_a_file_url_leaves_no_staging_folder(tmp_path):
    from torchforge.remote.upload import upload

    dst = tmp_path / "out"
    for seed in (3, 9):
        local = tmp_path / f"mds-{seed}"
        convert(_write_mds(tmp_path / f"src-{seed}", n=20, seed=seed), str(local), to="mds")
        upload(local, f"file://{dst}", overwrite=True, cache_dir=tmp_path / "cache")
    assert sorted(os.listdir(dst)) == ["index.json", "shard.00000.mds"]
    assert [s["id"] for s in torchforge.open_dataset(str(dst))] == [r["id"] for r in mds_rows(20, 9)]


def test_a_loader_state_is_refused_over_a_dataset_overwritten_since(env, tmp_path):
    """A state saved mid-epoch over version 1 of a dataset, loaded over version 2 (overwritten at its URL with
    as many samples): the rest of the pass was read from version 2, half of one epoch and half of another."""
    from torchforge import DataLoader, GlobalSampler

    url = f"s3://{BUCKET}/versioned/ds"
    convert(_write_mds(tmp_path / "a", n=40), url, to="mds", cache_dir=env.cache, storage_options=env.opts)

    def loader():
        ds = torchforge.open_dataset(url, cache_dir=env.cache, storage_options=env.opts)
        return DataLoader(ds, 4, sampler=GlobalSampler(ds, seed=0), collate_fn=lambda b: [s["id"] for s in b])

    first = loader()
    it = iter(first)
    seen = [next(it) for _ in range(3)]
    state = first.state_dict()
    del it
    again = loader()  # the same version: resumes
    again.load_state_dict(state)
    assert sorted(x for b in seen + list(again) for x in b) == [r["id"] for r in mds_rows(40, 3)]
    convert(_write_mds(tmp_path / "b", n=40, seed=9), url, to="mds", cache_dir=env.cache, storage_options=env.opts,
            overwrite=True)
    with pytest.raises(ValueError, match="the dataset is not the one the state was saved over"):
        loader().load_state_dict(state)


def test_a_loader_state_resumes_over_a_server_side_copy_of_its_jinx_dataset(env, tmp_path):
    """A JINX dataset's version hashed its objects' URLs: a copy in another folder of the bucket, the same
    bytes and ETags, was refused as another version."""
    from torchforge import DataLoader, GlobalSampler

    src, dst = f"s3://{BUCKET}/orig/ds", f"s3://{BUCKET}/copy/ds"
    convert(_write_mds(tmp_path / "a", n=40), src, to="jinx", cache_dir=env.cache, storage_options=env.opts,
            shard_size=4096)
    for key in env.keys("orig/ds"):
        env.s3.copy_object(Bucket=BUCKET, Key=key.replace("orig/", "copy/", 1),
                           CopySource={"Bucket": BUCKET, "Key": key})

    def loader(url):
        ds = torchforge.open_dataset(url, cache_dir=env.cache, storage_options=env.opts)
        return DataLoader(ds, 4, sampler=GlobalSampler(ds, seed=0), collate_fn=lambda b: [s["id"] for s in b])

    first = loader(src)
    it = iter(first)
    seen = [next(it) for _ in range(3)]
    state = first.state_dict()
    del it
    again = loader(dst)
    again.load_state_dict(state)
    assert sorted(x for b in seen + list(again) for x in b) == [r["id"] for r in mds_rows(40, 3)]
