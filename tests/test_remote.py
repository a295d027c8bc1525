"""torchforge.remote against a real S3-compatible server (moto's, on 127.0.0.1) and a fault-injecting proxy.

The proxy forwards to moto, counts requests and bytes, and injects faults on a schedule: 503, 429, 403, a
connection reset mid-body, a truncated body (fewer bytes than Content-Length), and delays.
"""
from __future__ import annotations

import bisect
import hashlib
import http.client
import itertools
import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

from torchforge.errors import CorruptShardError, TorchforgeError
from torchforge.remote import (
    CacheFullError,
    ObjectCache,
    RemoteAccessError,
    RemoteChangedError,
    RemoteCorruptError,
    RemoteError,
    RemoteNotFoundError,
    coalesce,
    connect,
    is_remote,
    store_spec,
)
from torchforge.remote.cache import url_key

BUCKET = "tf-test"


def _put(endpoint: str, path: str, data: bytes | None = None) -> None:
    req = urllib.request.Request(f"{endpoint}/{path}", data=data, method="PUT",
                                 headers={"Content-Type": "application/octet-stream"})
    urllib.request.urlopen(req).read()


class FaultProxy:
    """A ThreadingHTTPServer forwarding to ``upstream``; ``faults`` is a list of actions taken by the next
    GET requests, one each ("503", "429", "403", "reset", "truncate", "flip", "ok"; "flip": the whole body,
    every 7th byte from the middle on flipped); ``delay`` slows each body."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.split("://", 1)[1]
        self.faults: list[str] = []
        self.gets: list[tuple[str, str | None]] = []  # (path, Range header)
        self.heads = 0
        self.bytes_sent = 0
        self.delay = 0.0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                with proxy.lock:
                    fault = proxy.faults.pop(0) if self.command == "GET" and proxy.faults else "ok"
                    if self.command == "GET":
                        proxy.gets.append((self.path, self.headers.get("Range")))
                    elif self.command == "HEAD":
                        proxy.heads += 1
                if fault in ("503", "429", "403"):
                    msg = b"<Error><Code>SlowDown</Code></Error>"
                    self.send_response(int(fault))
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=30)
                conn.request(self.command, self.path, body=body,
                             headers={k: v for k, v in self.headers.items() if k.lower() != "connection"})
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "server", "date"):
                        self.send_header(k, v)
                self.end_headers()
                if self.command == "HEAD":
                    return
                if fault in ("reset", "truncate"):
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    with proxy.lock:
                        proxy.bytes_sent += len(data) // 2
                    if fault == "reset":  # RST instead of FIN
                        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    self.connection.close()
                    return
                if fault == "flip":  # damaged on the way, length intact (no TLS to catch it)
                    data = bytes(b ^ 0x5A if i >= len(data) // 2 and i % 7 == 0 else b for i, b in enumerate(data))
                for i in range(0, len(data), 64 * 1024):
                    if proxy.delay:
                        time.sleep(proxy.delay)
                    self.wfile.write(data[i:i + 64 * 1024])
                with proxy.lock:
                    proxy.bytes_sent += len(data)

            do_GET = do_HEAD = do_PUT = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reset(self) -> None:
        with self.lock:
            self.faults, self.gets, self.heads, self.bytes_sent, self.delay = [], [], 0, 0, 0.0

    def gets_of(self, key: str) -> int:
        return sum(path.endswith(key) for path, _ in self.gets)


@pytest.fixture(scope="module")
def s3(moto_endpoint):
    """This module's bucket on the session's moto server, and a fault proxy in front of it."""
    _put(moto_endpoint, BUCKET)
    proxy = FaultProxy(moto_endpoint)
    yield moto_endpoint, proxy
    proxy.server.shutdown()


@pytest.fixture
def env(s3, aws_env, tmp_path):
    """The standard AWS variables pointing at moto; a fresh cache folder; returns (client, proxy, put)."""
    endpoint, proxy = s3
    proxy.reset()
    client = connect(tmp_path / "cache")

    s3_client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                             aws_secret_access_key="testing")

    def put(key: str, data: bytes) -> str:  # signed (moto refuses an unsigned overwrite)
        s3_client.put_object(Bucket=BUCKET, Key=key, Body=data)
        return f"s3://{BUCKET}/{key}"

    yield client, proxy, put
    client.close()


def _via(proxy: FaultProxy) -> dict:
    return {"endpoint": proxy.url}


def _objects(client) -> list[str]:
    return sorted(os.listdir(client.cache.objects))


def test_urls_and_store_config(monkeypatch):
    assert is_remote("s3://b/k") and is_remote("https://h/x") and is_remote("gs://b/k") and is_remote("az://c/k")
    assert not is_remote("/data") and not is_remote("file:///data") and not is_remote(None)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    spec, key = store_spec("s3://bkt/a/b.mds")
    assert (spec.kind, spec.root, key) == ("s3", "bkt", "a/b.mds")
    assert dict(spec.config)["endpoint"] == "http://127.0.0.1:9000" and dict(spec.config)["region"] == "eu-west-1"
    assert dict(spec.client)["allow_http"] is True
    spec, _ = store_spec("s3://bkt/x", {"region": "us-east-2", "anonymous": True})
    assert dict(spec.config)["region"] == "us-east-2" and dict(spec.config)["skip_signature"] is True
    assert store_spec("file:///tmp/x")[0].kind == "file"
    for bad in ("s3://bkt", "ftp://h/x", "s3:///x"):
        with pytest.raises(ValueError):
            store_spec(bad)
    assert coalesce([(0, 10), (12, 20), (100, 110), (5, 8)], gap=5) == [(0, 20), (100, 110)]


def test_head_ranges_fetch_round_trip(env):
    client, _, put = env
    data = os.urandom(200_000)
    url = put("rt/shard.0.mds", data)
    info = client.head(url)
    assert info.size == len(data) and info.etag
    ranges = [(0, 0), (5, 17), (150_000, 200_000), (0, 200_000), (7, 9)]
    assert client.get_ranges(url, ranges, etag=info.etag) == [data[s:e] for s, e in ranges]
    path = client.fetch(url, len(data), hashes={"sha1": hashlib.sha1(data).hexdigest(),
                                                "md5": hashlib.md5(data).hexdigest()}, etag=info.etag)
    with open(path, "rb") as f:
        assert f.read() == data
    assert client.downloaded
    assert client.fetch(url, len(data), etag=info.etag) == path  # a hit, without asking the fetcher
    assert not client.downloaded
    assert os.path.commonpath([path, client.cache.root]) == client.cache.root


def test_ranges_are_coalesced(env):
    client, proxy, put = env
    data = os.urandom(1_000_000)
    url = put("co/shard.mds", data)
    etag = client.head(url).etag
    ranges = [(i * 4096 + 64, i * 4096 + 4096) for i in range(40)]  # 4032-byte reads, 64-byte gaps
    ranges += [(900_000 + i * 1000, 900_000 + i * 1000 + 990) for i in range(20)]
    proxy.reset()
    out = client.get_ranges(url, ranges, etag=etag, storage_options=_via(proxy))
    assert out == [data[s:e] for s, e in ranges]
    requested = sum(e - s for s, e in ranges)
    assert proxy.gets_of("co/shard.mds") < len(ranges) and proxy.gets_of("co/shard.mds") == 2
    assert proxy.bytes_sent <= 1.1 * requested
    proxy.reset()
    out = client.get_ranges(url, ranges[:3], etag=etag, gap=0, storage_options=_via(proxy))
    assert out == [data[s:e] for s, e in ranges[:3]] and proxy.gets_of("co/shard.mds") == 3


def test_one_get_per_node_from_four_processes(env):
    client, proxy, put = env
    data = os.urandom(2_000_000)
    url = put("one/shard.mds", data)
    etag = client.head(url).etag
    proxy.reset()
    proxy.delay = 0.01  # ~0.3 s per download: the four requests overlap
    r, w = os.pipe()
    pids = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:  # the main process never touched obstore: forked children may use the fetcher
            os.close(w)
            os.read(r, 1)
            try:
                path = connect(client.cache_dir).fetch(url, len(data), etag=etag, storage_options=_via(proxy))
                with open(path, "rb") as f:
                    ok = f.read() == data
            except BaseException:  # noqa: BLE001 - a forked child exits here, never returns into pytest
                ok = False
            os._exit(0 if ok else 1)
        pids.append(pid)
    os.close(r)
    os.write(w, b"gogo")
    os.close(w)
    assert [os.waitpid(p, 0)[1] for p in pids] == [0, 0, 0, 0]
    assert proxy.gets_of("one/shard.mds") == 1


def test_faults_are_retried_and_verified(env):
    client, proxy, put = env
    data = os.urandom(600_000)
    url = put("faults/shard.mds", data)
    etag = client.head(url).etag
    sha1 = hashlib.sha1(data).hexdigest()
    proxy.reset()
    proxy.faults = ["503", "429", "reset", "truncate"]
    path = client.fetch(url, len(data), hashes={"sha1": sha1}, etag=etag, storage_options=_via(proxy))
    with open(path, "rb") as f:
        assert f.read() == data
    assert not proxy.faults and proxy.gets_of("faults/shard.mds") == 5
    assert _objects(client) == [os.path.basename(path)]
    proxy.reset()
    proxy.faults = ["truncate", "503", "reset", "429"]
    ranges = [(0, 1000), (300_000, 400_000)]
    assert client.get_ranges(url, ranges, etag=etag, storage_options=_via(proxy)) == [data[s:e] for s, e in ranges]
    assert not proxy.faults


def test_the_retry_budget_is_set_by_storage_options(env):
    """``max_retries`` and ``retry_timeout`` in ``storage_options``: an outage longer than the default
    budget (6 retries) is waited out when asked, and a budget of 0 gives up at the first failure; every
    path (HEAD, range reads, whole downloads) uses the dataset's budget."""
    client, proxy, put = env
    data = os.urandom(300_000)
    url = put("budget/shard.mds", data)
    etag = client.head(url).etag
    proxy.reset()
    proxy.faults = ["503"] * 8  # the default budget is spent before the store recovers
    with pytest.raises(RemoteError, match=r"failed after 6 retries in [\d.]+ s") as e:
        client.get_ranges(url, [(0, 1000)], etag=etag, storage_options=_via(proxy))
    assert e.value.url == url and proxy.gets_of("budget/shard.mds") == 7
    proxy.reset()
    proxy.faults = ["503"] * 8
    assert client.get_ranges(url, [(0, 1000)], etag=etag, storage_options={**_via(proxy), "max_retries": 8}) \
        == [data[:1000]]
    assert not proxy.faults and proxy.gets_of("budget/shard.mds") == 9
    proxy.reset()
    proxy.faults = ["503"] * 9
    path = client.fetch(url, len(data), etag=etag, storage_options={**_via(proxy), "retry_timeout": 60})
    with open(path, "rb") as f:
        assert f.read() == data
    assert not proxy.faults and proxy.gets_of("budget/shard.mds") == 10
    proxy.reset()
    proxy.faults = ["503"]
    with pytest.raises(RemoteError, match="after 0 retries"):
        client.get_ranges(url, [(0, 10)], etag=etag, storage_options={**_via(proxy), "max_retries": "0"})
    assert proxy.gets_of("budget/shard.mds") == 1
    proxy.reset()
    proxy.faults = ["503"] * 10_000
    t = time.monotonic()
    with pytest.raises(RemoteError, match="retries in"):  # a time budget alone: as many retries as fit
        client.get_ranges(url, [(0, 10)], etag=etag, storage_options={**_via(proxy), "retry_timeout": 4})
    # (the longest backoffs, 0.05 s doubling up to 2 s, reach 3.15 s at the 6th retry: a 7th fits in 4 s)
    assert 3.9 < time.monotonic() - t < 15 and proxy.gets_of("budget/shard.mds") >= 8
    proxy.faults = []
    for bad in ({"max_retries": -1}, {"max_retries": 1.5}, {"max_retries": True}, {"retry_timeout": 0},
                {"retry_timeout": "soon"}, {"retry_timeout": float("inf")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            client.head(url, storage_options={**_via(proxy), **bad})


def test_bad_hash_or_size_leaves_nothing(env):
    client, _, put = env
    data = os.urandom(100_000)
    url = put("bad/shard.mds", data)
    with pytest.raises(RemoteCorruptError, match="sha1") as e:
        client.fetch(url, len(data), hashes={"sha1": "0" * 40})
    assert e.value.url == url and url in str(e.value)
    with pytest.raises(RemoteCorruptError, match="index records"):
        client.fetch(url, len(data) + 1)
    assert _objects(client) == []
    assert client.cache.usage() == 0


def _served(proxy: FaultProxy, key: str) -> list[tuple[int, int]]:
    """The byte ranges of ``key`` the proxy served, in request order (a GET without Range: the whole)."""
    out = []
    for path, rng in proxy.gets:
        if path.endswith(key):
            s, e = (rng or "bytes=0-").split("=", 1)[1].split("-")
            out.append((int(s), int(e) + 1 if e else -1))
    return out


def _parted(env, tmp_path, monkeypatch, key: str, size: int):
    """An object of ``size`` random bytes at ``key``, and a client of a fetcher of its own (a fresh cache
    folder) that downloads in 64 KiB blocks and 512 KiB parts, one part in order at a time; returns
    (client, proxy, URL, bytes, ETag) with the proxy's counts reset."""
    from torchforge.remote.client import FetcherClient

    _, proxy, put = env
    monkeypatch.setenv("TORCHFORGE_FETCH_BLOCK", str(64 * 1024))
    monkeypatch.setenv("TORCHFORGE_FETCH_THREADS", "1")
    client = FetcherClient(tmp_path / key.replace("/", "_"))
    data = os.urandom(size)
    url = put(key, data)
    etag = client.head(url).etag
    proxy.reset()
    return client, proxy, url, data, etag


def test_a_download_a_batch_started_outlives_its_readers_and_the_fetchers_idle_time(env, tmp_path, monkeypatch):
    """The fetcher exits once no client has been connected for IDLE_EXIT, but not while a download is in
    progress: a batch read a few blocks of a shard and left, and the download goes on to the whole file
    (fails before: the fetcher exited mid-download, and the next reader fetched the shard again)."""
    from torchforge.remote.client import FetcherClient

    monkeypatch.setenv("TORCHFORGE_FETCHER_IDLE_EXIT", "0.4")  # the fetcher reads it when it starts
    client, proxy, url, data, etag = _parted(env, tmp_path, monkeypatch, "parts/left.mds", 3_000_000)
    proxy.delay = 0.05  # per 64 KiB: the whole object takes about 2.4 s, six idle times
    blobs, path = client.read(url, len(data), [(10, 20)], etag=etag, storage_options=_via(proxy))
    assert blobs == [data[10:20]] and path is None
    folder = client.cache_dir
    client.close()  # no client is left: only the download keeps the fetcher
    deadline = time.monotonic() + 30
    while FetcherClient(folder).cached(url, len(data), etag=etag) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    path = FetcherClient(folder).cached(url, len(data), etag=etag)
    assert path is not None, "the download died with the fetcher"
    with open(path, "rb") as f:
        assert f.read() == data
    assert sum(e - s for s, e in _served(proxy, "parts/left.mds")) == len(data)  # every byte once


def test_a_read_is_served_from_the_download_before_it_completes(env, tmp_path, monkeypatch):
    client, proxy, url, data, etag = _parted(env, tmp_path, monkeypatch, "parts/shard.mds", 3_000_000)
    proxy.delay = 0.01  # per 64 KiB: a part in order takes 0.08 s, the whole object about 0.5 s
    want = [(2_500_000, 2_500_100), (10, 20)]
    blobs, path = client.read(url, len(data), want, etag=etag, storage_options=_via(proxy))
    assert blobs == [data[s:e] for s, e in want]
    assert path is None  # served from the download, not after it
    # the blocks read were taken first, each a GET of its own: the first GETs out (parts in order go on
    # beside them, so the one part in order may overtake the second block's GET; no more than that)
    first = _served(proxy, "parts/shard.mds")[:3]
    assert {(0, 65536), (2_490_368, 2_555_904)} <= set(first), first
    # the download goes on to the whole object: cached once, every byte fetched exactly once
    path = client.fetch(url, len(data), etag=etag, storage_options=_via(proxy))
    with open(path, "rb") as f:
        assert f.read() == data
    served = sorted(_served(proxy, "parts/shard.mds"))
    assert served[0][0] == 0 and served[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(served)), served  # no gap, no overlap
    assert len(served) < 12  # 6 parts in order and the 2 blocks read, give or take a split part
    # a read of a cached object comes from the cache, with its path; nothing fetched
    proxy.reset()
    assert client.read(url, len(data), [(5, 9)], etag=etag, storage_options=_via(proxy)) == ([data[5:9]], path)
    assert not proxy.gets
    client.close()


def test_parts_under_faults_and_hashes(env, tmp_path, monkeypatch):
    client, proxy, url, data, etag = _parted(env, tmp_path, monkeypatch, "parts/faulty.mds", 1_500_000)
    put = env[2]
    proxy.faults = ["503", "reset", "truncate", "429", "ok", "reset", "truncate"]
    blobs, _ = client.read(url, len(data), [(1_000_000, 1_200_000)], etag=etag, storage_options=_via(proxy))
    assert blobs == [data[1_000_000:1_200_000]]
    path = client.fetch(url, len(data), etag=etag, storage_options=_via(proxy))
    with open(path, "rb") as f:
        assert f.read() == data
    assert not proxy.faults and _objects(client) == [os.path.basename(path)]
    # an object whose hash can be checked is served only once complete and verified...
    url = put("parts/hashed.mds", data)
    sha1 = hashlib.sha1(data).hexdigest()
    blobs, path = client.read(url, len(data), [(7, 70)], hashes={"sha1": sha1}, storage_options=_via(proxy))
    assert blobs == [data[7:70]] and path is not None
    # ...and one whose bytes do not match it serves nothing and leaves nothing
    url = put("parts/lying.mds", data)
    with pytest.raises(RemoteCorruptError, match="sha1") as e:
        client.read(url, len(data), [(7, 70)], hashes={"sha1": "0" * 40}, storage_options=_via(proxy))
    assert e.value.url == url
    assert len(_objects(client)) == 2
    # a download that cannot even start (a bad policy) fails its readers, it never leaves them waiting
    url = put("parts/policy.mds", data)
    done: list[BaseException] = []

    def bad_policy() -> None:
        try:
            client.read(url, len(data), [(0, 10)], policy="bogus", storage_options=_via(proxy))
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
            done.append(exc)

    t = threading.Thread(target=bad_policy, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive() and len(done) == 1 and "bogus" in str(done[0]), done
    client.close()


def test_missing_or_denied_fails_fast(env):
    client, proxy, _ = env
    for url in (f"s3://{BUCKET}/no/such.mds", "s3://no-such-bucket/x.mds"):
        t = time.monotonic()
        with pytest.raises(RemoteNotFoundError) as e:
            client.head(url)
        assert time.monotonic() - t < 1.0
        assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, TorchforgeError)
        assert url in str(e.value) and e.value.url == url
        t = time.monotonic()
        with pytest.raises(RemoteNotFoundError):
            client.fetch(url, 10, etag='"x"')
        assert time.monotonic() - t < 1.0
    proxy.reset()
    proxy.faults = ["403"]
    t = time.monotonic()
    with pytest.raises(RemoteAccessError):
        client.get_ranges(f"s3://{BUCKET}/no/such.mds", [(0, 1)], storage_options=_via(proxy))
    assert time.monotonic() - t < 1.0


def test_a_range_past_the_objects_end_fails_at_once_naming_the_url_and_size(env):
    """A lying index asks for bytes past an object's end: the server clips the range (or answers 416), and
    that short body is no transient fault to retry six times but a typed error naming the URL and size."""
    from torchforge.remote import RemoteCorruptError

    client, proxy, put = env
    data = os.urandom(1000)
    url = put("end/shard.mds", data)
    etag = client.head(url).etag
    for ranges in ([(10, 20), (900, 1100)], [(1500, 1600)]):
        proxy.reset()
        t = time.monotonic()
        with pytest.raises(RemoteCorruptError) as e:
            client.get_ranges(url, ranges, etag=etag, gap=0, storage_options=_via(proxy))
        assert time.monotonic() - t < 1.0 and url in str(e.value) and "past the object's end" in str(e.value)
        assert proxy.gets_of("end/shard.mds") == len(ranges)  # one try each, no retry
    assert e.value.offset is None or e.value.offset == 1000
    with pytest.raises(RemoteCorruptError) as e:
        client.get_ranges(url, [(999, 1001)], etag=etag)
    assert e.value.offset == 1000 and "(1000 bytes)" in str(e.value)
    assert client.get_ranges(url, [(990, 1000)], etag=etag) == [data[990:]]  # up to the end still reads


def test_an_interrupted_request_never_answers_the_next_one(env):
    """Ctrl-C between a request and its reply (here a SIGINT while the proxy slows a range read): the
    reply must not be read as the next call's answer, which asks another object."""
    import signal

    client, proxy, put = env
    a = put("intr/a.bin", os.urandom(4 << 20))
    b_data = os.urandom(1000)
    b = put("intr/b.bin", b_data)
    client.head(b)  # the fetcher is up
    proxy.delay = 0.5
    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            client.get_ranges(a, [(0, 4 << 20)], storage_options=_via(proxy))
            time.sleep(5)  # (not reached: the read takes longer than the timer)
    finally:
        timer.cancel()
        proxy.delay = 0.0
    assert client.get_ranges(b, [(10, 20)], storage_options=_via(proxy)) == [b_data[10:20]]
    assert client.head(b).size == 1000


def test_overwritten_object_raises_changed(env):
    client, _, put = env
    old = os.urandom(50_000)
    url = put("ow/shard.mds", old)
    etag = client.head(url).etag
    put("ow/shard.mds", os.urandom(50_000))
    assert client.head(url).etag != etag
    with pytest.raises(RemoteChangedError) as e:
        client.get_ranges(url, [(0, 10)], etag=etag)
    assert url in str(e.value)
    with pytest.raises(RemoteChangedError):
        client.fetch(url, len(old), etag=etag)
    assert _objects(client) == []


def _writer(data: bytes):
    def download(f):
        f.write(data)
    return download


def test_cache_limit_and_belady(tmp_path):
    cache = ObjectCache(tmp_path, limit=300)
    foreign = os.path.join(cache.objects, "someone-elses-file")
    with open(foreign, "wb") as f:
        f.write(b"x" * 1000)  # not ours: never counted, never removed
    urls = [f"s3://b/{c}" for c in "abcd"]
    for u in urls[:3]:
        cache.fill(u, "v1", 100, _writer(b"y" * 100))
    assert cache.usage() == 300

    seen = []

    def watching(f):
        seen.append(cache.usage())  # the partial download is counted at its full size
        f.write(b"z" * 100)

    # next uses: a, then c, then b: b's lies furthest, so b goes
    cache.fill(urls[3], "v1", 100, watching, next_use={url_key(urls[0]): 0, url_key(urls[2]): 1,
                                                      url_key(urls[1]): 2})
    assert seen == [300]
    assert cache.lookup(urls[1], "v1") is None and all(cache.lookup(u, "v1") for u in (urls[0], urls[2], urls[3]))
    assert cache.usage() == 300 and os.path.exists(foreign)
    # the furthest (a) is in use: the next furthest (c) goes instead
    with cache.pinned(urls[0]):
        cache.fill(urls[1], "v1", 100, _writer(b"y" * 100),
                   next_use={url_key(urls[3]): 0, url_key(urls[2]): 1, url_key(urls[0]): 2})
        assert cache.lookup(urls[0], "v1") and cache.lookup(urls[2], "v1") is None
        with cache.pinned(urls[1]), cache.pinned(urls[3]), pytest.raises(CacheFullError):
            cache.fill(urls[2], "v1", 100, _writer(b"y" * 100))
    assert cache.usage() <= 300
    with pytest.raises(CacheFullError):
        cache.fill("s3://b/huge", "v1", 301, _writer(b"y" * 301))
    lru = ObjectCache(tmp_path, limit=300, policy="lru")
    os.utime(cache.lookup(urls[0], "v1"), (1, 1))  # a: least recently used
    lru.fill(urls[2], "v1", 100, _writer(b"y" * 100))
    assert lru.lookup(urls[0], "v1") is None
    with pytest.raises(ValueError):
        ObjectCache(tmp_path, policy="mru")


@pytest.mark.parametrize("limit", ["10MB", None])
def test_killed_download_leaves_nothing_used(env, limit):
    """A process killed mid-download leaves a partial file under a name nothing reads; the next download
    removes it, with or without a cache_limit (it holds the whole size, preallocated)."""
    client, _, put = env
    data = os.urandom(300_000)
    url = put("kill/shard.mds", data)
    etag = client.head(url).etag
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        cache = ObjectCache(client.cache_dir)

        def half(f):
            f.write(data[: len(data) // 2])
            f.flush()
            os.write(w, b"x")
            time.sleep(60)

        cache.fill(url, etag, len(data), half)
        os._exit(0)
    assert os.read(r, 1) == b"x"
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    left = _objects(client)
    assert len(left) == 1 and ".tmp." in left[0]  # the partial download, under a name nothing uses
    assert client.cache.lookup(url, etag) is None
    path = client.fetch(url, len(data), etag=etag, cache_limit=limit)
    with open(path, "rb") as f:
        assert f.read() == data
    assert _objects(client) == [os.path.basename(path)]  # the stale partial file is gone


def test_a_partial_download_of_another_pid_namespace_is_never_swept(tmp_path):
    """Containers of one machine may share a host name and a cache folder but not their process ids: a
    partial download named by a process of another PID namespace is left alone, whatever that pid means
    here (fails before: the host token was the host name alone, so a pid dead here swept a live download)."""
    import shutil

    from torchforge._proc import host_name

    unshare = shutil.which("unshare")
    probe = "from torchforge._proc import host_name; print(host_name())"
    proc = (subprocess.run([unshare, "-p", "-f", sys.executable, "-c", probe], capture_output=True, text=True,
                           timeout=60, check=False) if unshare else None)
    if proc is None or proc.returncode:
        pytest.skip(f"no new PID namespace here (unshare -p: {proc and proc.stderr.strip()[-200:]})")
    theirs, ours = proc.stdout.strip(), host_name()
    assert theirs != ours
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its pid is now dead here
    cache = ObjectCache(tmp_path / "cache")
    final = f"{'0' * 32}-shard.mds"
    names = {who: f"{final}.tmp.{who}.{child.pid}.0123abcd" for who in (theirs, ours)}
    for name in names.values():
        with open(os.path.join(cache.objects, name), "wb") as f:
            f.write(b"x" * 100)
    cache._sweep()
    assert sorted(os.listdir(cache.objects)) == [names[theirs]]  # ours was stale; theirs may be running


def test_fork_after_use(env):
    client, _, put = env
    data = os.urandom(10_000)
    url = put("fork/shard.mds", data)
    assert client.get_ranges(url, [(0, 100)]) == [data[:100]]  # the main process uses the remote API
    pid = os.fork()
    if pid == 0:
        try:
            c = connect(client.cache_dir)
            ok = c.head(url).size == len(data) and c.get_ranges(url, [(10, 20)]) == [data[10:20]]
        except BaseException:  # noqa: BLE001 - a forked child exits here, never returns into pytest
            ok = False
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert status == 0
            break
        time.sleep(0.02)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("a forked child hung on its first remote call")


def test_errors_pickle_with_url():
    import pickle

    e = pickle.loads(pickle.dumps(RemoteChangedError("changed", url="s3://b/k")))
    assert e.url == "s3://b/k" and "s3://b/k" in str(e) and isinstance(e, RemoteError)


# --- an MDS dataset at a URL (torchforge.datasets.remote) ------------------------------------------------
def _put_mds(put, local, prefix: str, rows: list[dict], size_limit: int, **options) -> list[int]:
    """``rows`` ({"id": int, "blob": bytes}) written as MDS in ``local`` and uploaded below ``prefix``, the
    index last (never half a dataset); returns the shard files' sizes."""
    from torchforge.formats.mds import MDSWriter

    with MDSWriter(str(local), {"id": "int", "blob": "bytes"}, size_limit=size_limit, **options) as w:
        for r in rows:
            w.write(r)
    shards = [name for name in sorted(os.listdir(local)) if name != "index.json"]
    for name in shards:
        put(f"{prefix}/{name}", (local / name).read_bytes())
    put(f"{prefix}/index.json", (local / "index.json").read_bytes())
    return [(local / name).stat().st_size for name in shards]


def _upload_mds(tmp_path, put, prefix: str, n: int = 60, marker: int = 0, hashes=("sha1",)) -> list[dict]:
    rows = [{"id": i, "blob": bytes([(i + marker) % 251]) * (200 + 37 * i)} for i in range(n)]
    _put_mds(put, tmp_path / f"mds-{prefix.replace('/', '_')}-{marker}", prefix, rows, 1 << 13, hashes=list(hashes))
    return rows


@pytest.mark.parametrize("mode", ["ranges", "shards"])
def test_an_mds_dataset_at_a_url_pickles_after_it_has_read(env, tmp_path, mode):
    """Spawned DataLoader workers get the dataset pickled: after a batch (which makes the shards' sample
    decoders, holding struct.Structs) it must still pickle, and the copy read the same samples."""
    import pickle

    import torchforge

    _client, proxy, put = env
    rows = _upload_mds(tmp_path, put, f"ds/pickled-{mode}")
    url = f"s3://{BUCKET}/ds/pickled-{mode}"
    ds = torchforge.open_dataset(url, mode=mode, cache_dir=tmp_path / "cache", storage_options=_via(proxy))
    assert [int(s["id"]) for s in ds.__getitems__([0, 41, 59])] == [0, 41, 59]
    again = pickle.loads(pickle.dumps(ds))
    assert [bytes(s["blob"]) for s in again.__getitems__([59, 3])] == [rows[59]["blob"], rows[3]["blob"]]
    import torch

    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="spawn",
                                         collate_fn=_collate_ids)
    assert sorted(i for b in loader for i, _ in b) == list(range(60))


def test_an_mds_dataset_without_hashes_pins_every_shard_when_it_opens(env, tmp_path):
    """index.json records no hashes: the folder's listing pins each shard's ETag at open, so a shard
    overwritten afterwards raises RemoteChangedError naming it, and a shard the node cached is found by
    that version with no request (no HEAD per shard before its download either)."""
    import torchforge

    _client, proxy, put = env
    rows = [{"id": i, "blob": bytes([i % 251]) * (300 + 11 * i)} for i in range(60)]
    local = tmp_path / "mds-nohash"
    _put_mds(put, local, "ds/nohash", rows, 1 << 13)
    url = f"s3://{BUCKET}/ds/nohash"
    ds = torchforge.open_dataset(url, cache_dir=tmp_path / "cache", storage_options=_via(proxy))
    assert all(ds._objects(k)[0][2] for k in range(len(ds.metas)))  # every shard pinned, hashless
    proxy.reset()
    assert [int(s["id"]) for s in ds.__getitems__(list(range(60)))] == list(range(60))
    assert proxy.heads == 0  # the pinned ETag: no HEAD before a download
    again = torchforge.open_dataset(url, cache_dir=tmp_path / "cache", storage_options=_via(proxy))
    assert all(again._at_hand(k) for k in range(len(again.metas)))  # nothing mapped: found in the cache by version
    proxy.reset()
    assert bytes(again[59]["blob"]) == rows[59]["blob"] and not proxy.gets and not proxy.heads
    last = max(n for n in os.listdir(local) if n != "index.json")
    fresh = torchforge.open_dataset(url, cache_dir=tmp_path / "other", storage_options=_via(proxy))
    data = (local / last).read_bytes()
    put(f"ds/nohash/{last}", data[:-1] + bytes([data[-1] ^ 1]))  # the same size, another version
    with pytest.raises(RemoteChangedError, match=last):
        fresh[59]
    assert int(fresh[0]["id"]) == 0  # the shards that did not change still read


def test_an_mds_index_overwritten_while_the_dataset_opens_is_a_changed_error(env, tmp_path, monkeypatch):
    """The dataset is overwritten between the read of index.json and the folder's listing that pins the
    shards: the new shards' ETags must not be pinned against the old index. The overwrite is made for real
    on the server, from inside the listing call."""
    import torchforge
    from torchforge.remote.client import FetcherClient

    _client, proxy, put = env
    rows = [{"id": i, "blob": bytes([i % 251]) * (300 + 11 * i)} for i in range(40)]
    _put_mds(put, tmp_path / "old", "ds/race", rows, 1 << 13)
    url = f"s3://{BUCKET}/ds/race"
    real = FetcherClient.list_versions

    def overwritten_first(self, *a, **k):
        new = [{"id": r["id"], "blob": r["blob"][::-1] + b"x"} for r in rows]
        _put_mds(put, tmp_path / f"new-{len(os.listdir(tmp_path))}", "ds/race", new, 1 << 13)
        return real(self, *a, **k)

    monkeypatch.setattr(FetcherClient, "list_versions", overwritten_first)
    with pytest.raises(RemoteChangedError, match="ds/race/index.json.*overwritten while the dataset opened"):
        torchforge.open_dataset(url, cache_dir=tmp_path / "cache", storage_options=_via(proxy))
    monkeypatch.setattr(FetcherClient, "list_versions", real)
    ds = torchforge.open_dataset(url, cache_dir=tmp_path / "cache", storage_options=_via(proxy))  # settled
    assert bytes(ds[3]["blob"]) == rows[3]["blob"][::-1] + b"x"


def test_open_dataset_at_an_s3_url_reads_every_sample_once_per_node(env, tmp_path, monkeypatch):
    import torch

    import torchforge
    from torchforge.datasets.remote import RemoteMDSDataset

    _client, proxy, put = env
    rows = _upload_mds(tmp_path, put, "ds/a")
    proxy.reset()
    opts = _via(proxy)
    ds = torchforge.open_dataset(f"s3://{BUCKET}/ds/a", cache_dir=tmp_path / "cache", storage_options=opts)
    assert isinstance(ds, RemoteMDSDataset) and len(ds) == len(rows)
    assert proxy.gets_of("index.json") == 1
    shards = [m.raw_basename for m in ds.metas]
    assert len(shards) >= 4
    got = {}
    loader = torch.utils.data.DataLoader(ds, batch_size=None, shuffle=True, num_workers=2)  # forked workers
    for s in loader:
        got[int(s["id"])] = bytes(s["blob"])
    assert got == {r["id"]: r["blob"] for r in rows}
    assert all(proxy.gets_of(name) == 1 for name in shards), [(n, proxy.gets_of(n)) for n in shards]
    # a second open of the same version (through the format's own class): everything from the node's cache
    proxy.reset()
    again = torchforge.MDSDataset(f"s3://{BUCKET}/ds/a", cache_dir=tmp_path / "cache", storage_options=opts)
    assert isinstance(again, RemoteMDSDataset)
    assert [again[i]["id"] for i in range(len(rows))] == list(range(len(rows)))
    assert sum(proxy.gets_of(name) for name in shards) == 0
    # nothing was written next to the data: the cache is the folder given
    assert os.path.isdir(tmp_path / "cache")


def test_a_first_batch_waits_for_parts_not_whole_shards(env, tmp_path, monkeypatch):
    import torchforge
    from torchforge.sampler import GlobalSampler

    _, proxy, put = env
    monkeypatch.setenv("TORCHFORGE_FETCH_BLOCK", str(64 * 1024))
    monkeypatch.setenv("TORCHFORGE_FETCH_THREADS", "1")
    rows = [{"id": i, "blob": bytes([i % 251]) * 40_000} for i in range(200)]
    sizes = _put_mds(put, tmp_path / "early", "ds/early", rows, 1 << 21)  # no hashes: bytes served early
    ds = torchforge.open_dataset(f"s3://{BUCKET}/ds/early", cache_dir=tmp_path / "early-cache",
                                 storage_options=_via(proxy))
    names = [m.raw_basename for m in ds.metas]
    assert len(names) == len(sizes) >= 4
    order = GlobalSampler(len(ds), seed=3).indices(0, len(ds)).tolist()
    proxy.reset()
    proxy.delay = 0.02  # per 64 KiB sent
    first = ds.__getitems__(order[:16])
    assert [(int(s["id"]), bytes(s["blob"])) for s in first] == [(i, rows[i]["blob"]) for i in order[:16]]
    assert len({ds._locate(i)[0] for i in order[:16]}) == len(names)  # the batch touches every shard...
    assert proxy.bytes_sent < sum(sizes) / 2  # ...and did not wait for them whole
    got = [s for k in range(16, len(order), 16) for s in ds.__getitems__(order[k:k + 16])]
    assert [(int(s["id"]), bytes(s["blob"])) for s in got] == [(i, rows[i]["blob"]) for i in order[16:]]
    ds.prefetch(order, wait=True)  # (the downloads in progress, to their end)
    for name, size in zip(names, sizes):  # every byte of every shard fetched exactly once
        served = sorted(_served(proxy, f"ds/early/{name}"))
        assert served[0][0] == 0 and served[-1][1] in (size, -1), (name, served)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(served)), (name, served)
    proxy.reset()
    assert [int(s["id"]) for s in ds.__getitems__(order[:50])] == order[:50]
    assert not proxy.gets  # complete shards are mapped from the node's cache


def test_a_jinx_first_batch_waits_for_parts_not_whole_shards_or_sidecars(env, tmp_path, monkeypatch):
    """mode="shards", no cache_limit: a JINX batch of an exact shuffle reads its lines and sidecar values
    from the shards' and sidecars' downloads as their parts arrive, as MDS does; every byte is still
    fetched once, and complete shards are mapped from the node's cache."""
    import torchforge
    from torchforge.formats.jinx import JinxWriter
    from torchforge.sampler import GlobalSampler

    _, proxy, put = env
    monkeypatch.setenv("TORCHFORGE_FETCH_BLOCK", str(64 * 1024))
    monkeypatch.setenv("TORCHFORGE_FETCH_THREADS", "1")
    rows = [{"id": i, "text": f"sample {i}", "blob": bytes([i % 251]) * 40_000} for i in range(200)]
    local = tmp_path / "jearly"
    with JinxWriter(local, shard_size=4096, compression=None, binary_threshold=1024) as w:  # lines only
        for r in rows:
            w.write(r)
    _upload_folder(put, str(local), "jx/early")
    names = sorted(os.listdir(local))
    sizes = {n: os.path.getsize(local / n) for n in names}
    assert sum(n.endswith(".binx") for n in names) >= 3  # the blobs live in the sidecars
    ds = torchforge.open_dataset(f"s3://{BUCKET}/jx/early", cache_dir=tmp_path / "jearly-cache",
                                 storage_options=_via(proxy))
    order = GlobalSampler(len(ds), seed=3).indices(0, len(ds)).tolist()
    proxy.reset()
    proxy.delay = 0.02  # per 64 KiB sent
    first = ds.__getitems__(order[:16])
    assert [(int(s["id"]), s["text"], bytes(s["blob"])) for s in first] == \
        [(i, rows[i]["text"], rows[i]["blob"]) for i in order[:16]]
    copy = pickle.loads(pickle.dumps(ds))  # for spawned workers, with the shards' indexes made for the batch
    assert [bytes(s["blob"]) for s in copy.__getitems__(order[16:20])] == [rows[i]["blob"] for i in order[16:20]]
    assert len({ds.locate(i)[0] for i in order[:16]}) >= 4  # nearly every shard touched...
    assert proxy.bytes_sent < sum(sizes.values()) / 2  # ...and none waited for whole
    got = [s for k in range(16, len(order), 16) for s in ds.__getitems__(order[k:k + 16])]
    assert [(int(s["id"]), bytes(s["blob"])) for s in got] == [(i, rows[i]["blob"]) for i in order[16:]]
    ds.prefetch(order, wait=True)  # (the downloads in progress, to their end)
    for name in names:  # every byte of every shard and sidecar fetched exactly once
        served = sorted(_served(proxy, f"jx/early/{name}"))
        assert served[0][0] == 0 and served[-1][1] in (sizes[name], -1), (name, served)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(served)), (name, served)
    proxy.reset()
    assert [int(s["id"]) for s in ds.__getitems__(order[:50])] == order[:50]
    assert not proxy.gets  # complete shards are mapped from the node's cache
    assert all(ds._jshards[k] is not None for k in {ds.locate(i)[0] for i in order[:50]})


def test_a_safetensors_first_batch_waits_for_parts_not_whole_shards(env, tmp_path, monkeypatch):
    """The same for safetensors column shards: a batch's rows (ragged columns' offsets included) come from
    the downloads in progress; every byte is fetched once, complete shards are mapped."""
    import torch

    import torchforge
    from torchforge.sampler import GlobalSampler

    _, proxy, put = env
    monkeypatch.setenv("TORCHFORGE_FETCH_BLOCK", str(64 * 1024))
    monkeypatch.setenv("TORCHFORGE_FETCH_THREADS", "1")
    g = torch.Generator().manual_seed(7)
    local = tmp_path / "stearly"
    expected, _ = _put_columns(put, local, "st/early", 40, (
        {"img": torch.randint(0, 255, (40_000,), dtype=torch.uint8, generator=g),
         "ids": torch.arange(i % 9 + 1), "y": torch.tensor(float(i))} for i in range(200)))
    names = sorted(os.listdir(local))
    sizes = {n: os.path.getsize(local / n) for n in names}
    assert len(names) >= 5
    ds = torchforge.open_dataset(f"s3://{BUCKET}/st/early", cache_dir=tmp_path / "stearly-cache",
                                 storage_options=_via(proxy))
    order = GlobalSampler(len(ds), seed=3).indices(0, len(ds)).tolist()

    def same(samples, which):
        return all(int(s["y"]) == i and all(torch.equal(s[c], expected[i][c]) for c in ("img", "ids"))
                   for s, i in zip(samples, which, strict=True))

    proxy.reset()
    proxy.delay = 0.02  # per 64 KiB sent
    assert same(ds.__getitems__(order[:16]), order[:16])
    assert len({bisect.bisect_right(ds._ends, i) for i in order[:16]}) >= 4  # most shards touched...
    assert proxy.bytes_sent < sum(sizes.values()) / 2  # ...none waited for whole
    for k in range(16, len(order), 16):
        assert same(ds.__getitems__(order[k:k + 16]), order[k:k + 16])
    ds.prefetch(order, wait=True)
    for name in names:  # every byte of every shard fetched exactly once
        served = sorted(_served(proxy, f"st/early/{name}"))
        assert served[0][0] == 0 and served[-1][1] in (sizes[name], -1), (name, served)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(served)), (name, served)
    proxy.reset()
    assert same(ds.__getitems__(order[:50]), order[:50])
    assert not proxy.gets  # complete shards are mapped from the node's cache


def test_a_dataset_overwritten_at_its_url_is_a_new_version_never_mixed(env, tmp_path):
    import torchforge

    _client, proxy, put = env
    old = _upload_mds(tmp_path, put, "ds/b", marker=0)
    opts = _via(proxy)
    first = torchforge.open_dataset(f"s3://{BUCKET}/ds/b", cache_dir=tmp_path / "cache", storage_options=opts)
    assert bytes(first[5]["blob"]) == old[5]["blob"]
    new = _upload_mds(tmp_path, put, "ds/b", marker=7)  # same names, other bytes
    second = torchforge.open_dataset(f"s3://{BUCKET}/ds/b", cache_dir=tmp_path / "cache", storage_options=opts)
    assert second.version != first.version and second.folder != first.folder
    assert [bytes(second[i]["blob"]) for i in range(len(new))] == [r["blob"] for r in new]
    # the old handle's shards that were not cached yet now fail their recorded hash: a typed error, not mixing
    with pytest.raises(torchforge.TorchforgeError) as e:
        for i in range(len(old)):
            assert bytes(first[i]["blob"]) == old[i]["blob"]
    assert f"s3://{BUCKET}/ds/b/" in str(e.value)


def test_open_dataset_at_a_missing_url_names_it(env, tmp_path):
    import torchforge
    from torchforge.remote import RemoteNotFoundError

    _client, proxy, _put = env
    start = time.monotonic()
    with pytest.raises(RemoteNotFoundError, match=f"s3://{BUCKET}/nothing/here/index.json"):
        torchforge.open_dataset(f"s3://{BUCKET}/nothing/here", cache_dir=tmp_path / "cache",
                                storage_options=_via(proxy))
    assert time.monotonic() - start < 5
    with pytest.raises(ValueError, match=r"mode='whole' is not one of \['shards', 'ranges'\]"):
        torchforge.open_dataset(f"s3://{BUCKET}/nothing/here", mode="whole")
    # an option no format takes names every class, not the first one tried (it said RemoteJinxDataset alone,
    # of a safetensors dataset)
    with pytest.raises(TypeError, match="no dataset class at .* takes these options .*RemoteJinxDataset.*"
                                        "RemoteSafetensorsDataset.*bogus"):
        torchforge.open_dataset(f"s3://{BUCKET}/nothing/here", cache_dir=tmp_path / "cache",
                                storage_options=_via(proxy), bogus=1)


def test_ranges_mode_reads_batches_with_coalesced_requests_and_no_whole_shard(env, tmp_path):
    import random

    import torch

    import torchforge
    from torchforge.datasets.remote import RemoteMDSDataset

    _client, proxy, put = env
    rows = _upload_mds(tmp_path, put, "ds/r", n=100)
    proxy.reset()
    ds = torchforge.open_dataset(f"s3://{BUCKET}/ds/r", mode="ranges", cache_dir=tmp_path / "cache",
                                 storage_options=_via(proxy))
    assert isinstance(ds, RemoteMDSDataset) and len(ds) == 100
    shards = {m.raw_basename for m in ds.metas}
    order = list(range(100))
    random.Random(3).shuffle(order)  # an exact global shuffle
    proxy.reset()
    got = []
    for b in range(0, 100, 50):
        batch = order[b:b + 50]
        got += [(int(s["id"]), bytes(s["blob"])) for s in ds.__getitems__(batch)]
    assert got == [(i, rows[i]["blob"]) for i in order]
    sample_gets = [(p, r) for p, r in proxy.gets if any(p.endswith(s) for s in shards)]
    header_gets = [g for g in sample_gets if g[1] and g[1].startswith("bytes=0-")]
    assert len(sample_gets) - len(header_gets) < 100  # coalescing: fewer GETs than samples
    sample_bytes = sum(len(rows[i]["blob"]) + 16 for i in order)  # + each sample's size header
    header_bytes = sum(4 + 4 * (m.samples + 1) for m in ds.metas)
    assert proxy.bytes_sent <= 1.1 * sample_bytes + header_bytes, (proxy.bytes_sent, sample_bytes)
    assert not any(r is None for _, r in sample_gets)  # never a whole-shard GET
    assert not os.listdir(tmp_path / "cache" / "remote" / "objects") or all(
        n.endswith("index.json") for n in os.listdir(tmp_path / "cache" / "remote" / "objects"))
    # through torch's loader with forked workers: __getitems__ per batch
    loader = torch.utils.data.DataLoader(ds, batch_size=25, shuffle=True, num_workers=2,
                                         collate_fn=lambda b: [(int(s["id"]), bytes(s["blob"])) for s in b])
    seen = sorted(x for batch in loader for x in batch)
    assert seen == [(i, rows[i]["blob"]) for i in range(100)]
    ours = torchforge.DataLoader(ds, batch_size=25, shuffle=True, num_workers=2,
                                 collate_fn=lambda b: [(int(s["id"]), bytes(s["blob"])) for s in b])
    assert sorted(x for batch in ours for x in batch) == [(i, rows[i]["blob"]) for i in range(100)]
    with pytest.raises(ValueError, match="lazy=True needs mode='shards'"):
        torchforge.open_dataset(f"s3://{BUCKET}/ds/r", mode="ranges", lazy=True, storage_options=_via(proxy))


def _collate_ids(batch):
    return [(int(s["id"]), bytes(s["blob"])) for s in batch]


def test_prefetch_fetches_shards_in_the_samplers_order_once(env, tmp_path):
    import torchforge
    from torchforge.sampler import GlobalSampler

    _client, proxy, put = env
    _upload_mds(tmp_path, put, "ds/p", n=80)
    opts = _via(proxy)
    ds = torchforge.open_dataset(f"s3://{BUCKET}/ds/p", cache_dir=tmp_path / "cache", storage_options=opts)
    sampler = GlobalSampler(len(ds), seed=4)
    want = [ds.metas[k].raw_basename for k in ds.shard_order(sampler.indices(0, len(sampler)))]
    assert sorted(want) == sorted(m.raw_basename for m in ds.metas) and want != sorted(want)
    proxy.reset()
    ds.prefetch(sampler.indices(0, len(sampler)), wait=True)
    fetched = [path.rsplit("/", 1)[1] for path, rng in proxy.gets if rng is None]
    assert fetched == want  # whole shards, in the order of first use, each once
    proxy.reset()
    loader = torchforge.DataLoader(ds, batch_size=8, sampler=sampler, num_workers=2, collate_fn=_collate_ids)
    assert sorted(i for b in loader for i, _ in b) == list(range(80))
    assert not proxy.gets  # everything was in the node's cache


def test_the_loader_prefetches_a_global_samplers_order_without_duplicate_gets(env, tmp_path):
    import torchforge
    from torchforge.sampler import GlobalSampler

    _client, proxy, put = env
    rows = _upload_mds(tmp_path, put, "ds/q", n=80)
    ds = torchforge.open_dataset(f"s3://{BUCKET}/ds/q", cache_dir=tmp_path / "cache", storage_options=_via(proxy))
    sampler = GlobalSampler(len(ds), seed=9)
    order = sampler.indices(0, len(sampler)).tolist()
    proxy.reset()
    loader = torchforge.DataLoader(ds, batch_size=8, sampler=sampler, num_workers=2, collate_fn=_collate_ids)
    got = [x for b in loader for x in b]
    assert got == [(i, rows[i]["blob"]) for i in order]
    shards = [m.raw_basename for m in ds.metas]
    assert all(proxy.gets_of(name) == 1 for name in shards), [(n, proxy.gets_of(n)) for n in shards]


@pytest.mark.parametrize("mode", ["shards", "ranges"])
def test_remote_loader_resumes_at_the_exact_next_batch(env, tmp_path, mode):
    import torchforge
    from torchforge.sampler import GlobalSampler

    _client, proxy, put = env
    _upload_mds(tmp_path, put, f"ds/resume-{mode}", n=96)
    url = f"s3://{BUCKET}/ds/resume-{mode}"

    def make():
        ds = torchforge.open_dataset(url, mode=mode, cache_dir=tmp_path / "cache", storage_options=_via(proxy))
        return torchforge.DataLoader(ds, batch_size=8, sampler=GlobalSampler(len(ds), seed=2), num_workers=2,
                                     collate_fn=_collate_ids)

    full = list(make())
    first = make()
    head = []
    for b in first:
        head.append(b)
        if len(head) == 5:
            break
    state = first.state_dict()
    second = make()
    second.load_state_dict(state)
    assert head + list(second) == full


def test_ranges_mode_reads_bytes_damaged_on_the_way_once_more(env, tmp_path):
    """mode="ranges": one GET whose body was damaged on the way (right length, flipped bytes) made the run die
    with CorruptShardError at the shard's offset table, or at a sample that no longer decompressed, though
    the next GET returns good bytes. Bytes that fail the checks are read once more; the same bytes twice
    are the object's own (the error stands). (Damaged bytes that still decode are served as they are: ranges
    cannot be checked against a shard's hash; mode="shards" checks it where index.json records one.)"""
    import torchforge

    _client, proxy, put = env
    rows = [{"id": i, "blob": bytes([i % 251]) * (200 + i)} for i in range(40)]
    _put_mds(put, tmp_path / "src", "ds/flips", rows, size_limit=1 << 13, compression="sample::zstd")
    url = f"s3://{BUCKET}/ds/flips"
    ds = torchforge.open_dataset(url, mode="ranges", cache_dir=tmp_path / "c", storage_options=_via(proxy))
    proxy.reset()
    proxy.faults = ["flip"]  # the offset table's GET
    sample = ds[3]
    assert int(sample["id"]) == 3 and bytes(sample["blob"]) == rows[3]["blob"]
    assert len(proxy.gets) == 3 and proxy.faults == []  # the table twice, then the sample
    proxy.reset()
    proxy.faults = ["flip"]  # a sample's GET: its zstd frame no longer decodes
    assert [int(s["id"]) for s in ds.__getitems__([5, 6, 7])] == [5, 6, 7]
    assert len(proxy.gets) == 2
    fresh = torchforge.open_dataset(url, mode="ranges", cache_dir=tmp_path / "c", storage_options=_via(proxy))
    proxy.reset()
    proxy.faults = ["flip", "flip"]  # damaged twice alike: taken as the object's own bytes, a typed error
    with pytest.raises(torchforge.errors.CorruptShardError) as e:
        fresh[0]
    assert e.value.path == f"{url}/shard.00000.mds" and len(proxy.gets) == 2, (e.value, proxy.gets)


@pytest.mark.parametrize("fmt", ["jinx", "safetensors"])
def test_a_footer_or_header_damaged_on_the_way_is_read_once_more_when_the_dataset_opens(env, tmp_path, fmt):
    """A JINX shard's footer and a safetensors shard's header are read by ranges when the dataset opens (any
    mode): one GET damaged on the way made open_dataset fail; it is read once more, and damage that comes
    back alike is the object's own (a typed error naming the shard)."""
    import torch

    import torchforge
    from torchforge.formats.jinx import JinxWriter

    _client, proxy, put = env
    local = tmp_path / f"{fmt}-src"
    if fmt == "jinx":
        with JinxWriter(local, shard_size=1 << 12, compression=None) as w:
            for i in range(50):
                w.write({"id": i, "text": f"sample {i} " * 8})
        _upload_folder(put, str(local), f"flips/{fmt}")
    else:
        _put_columns(put, local, f"flips/{fmt}", 20, ({"x": torch.full((30,), float(i))} for i in range(50)))
    url, suffix = f"s3://{BUCKET}/flips/{fmt}", f".{fmt}"

    def opened(cache: str):
        return torchforge.open_dataset(url, mode="ranges", cache_dir=tmp_path / cache, storage_options=_via(proxy))

    proxy.reset()
    clean = opened("clean")
    first = next(n for n, (path, rng) in enumerate(proxy.gets) if path.endswith(suffix) and rng)
    proxy.reset()
    proxy.faults = ["ok"] * first + ["flip"]
    ds = opened("once")
    assert len(ds) == len(clean) == 50 and proxy.faults == []
    proxy.reset()
    proxy.faults = ["ok"] * first + ["flip"] * 100  # (footers are read in parallel: every one damaged)
    with pytest.raises((torchforge.errors.CorruptShardError, torchforge.errors.FormatError)) as e:
        opened("twice")
    assert e.value.path.startswith(url) and e.value.path.endswith(suffix), e.value


@pytest.mark.parametrize("mode", ["shards", "ranges"])
def test_an_epoch_under_injected_faults_equals_a_fault_free_one(env, tmp_path, mode):
    """5% 503, 2% resets mid-body, 1% truncated bodies: the same samples in the same order, and every file
    in the cache is whole."""
    import random

    import torchforge
    from torchforge.sampler import GlobalSampler

    _client, proxy, put = env
    _upload_mds(tmp_path, put, f"ds/faults-{mode}", n=120)
    url = f"s3://{BUCKET}/ds/faults-{mode}"

    def epoch(cache):
        opts = {**_via(proxy), "client_options": {"timeout": "4s"}}  # a request lost in the proxy is retried
        ds = torchforge.open_dataset(url, mode=mode, cache_dir=cache, storage_options=opts)
        loader = torchforge.DataLoader(ds, batch_size=10, sampler=GlobalSampler(len(ds), seed=5), num_workers=2,
                                       collate_fn=_collate_ids)
        return [x for b in loader for x in b], ds

    clean, _ = epoch(tmp_path / "clean")
    rng = random.Random(11)
    proxy.reset()
    proxy.faults = rng.choices(["503", "reset", "truncate", "ok"], weights=[5, 2, 1, 92], k=2000)
    assert {"503", "reset", "truncate"} <= set(proxy.faults[:400])
    faulty, ds = epoch(tmp_path / "faulty")
    assert faulty == clean
    objects = tmp_path / "faulty" / "remote" / "objects"
    sizes = {m.raw_basename: m.raw_bytes for m in ds.metas}
    for name in os.listdir(objects) if objects.exists() else []:
        for shard, size in sizes.items():
            if name.endswith(shard):  # cached shards are whole (their hashes were checked on arrival)
                assert os.path.getsize(objects / name) == size, name


def test_two_simulated_nodes_under_torchrun_read_every_sample_once_and_fetch_only_their_shards(s3, env, tmp_path):
    """torchrun, 2 nodes x 2 ranks, gloo; each node its own cache folder and its own counting proxy, shard
    affinity by rendezvous hashing: every sample once per epoch over the 4 ranks, and a node fetches only
    its own shards, each once over two epochs."""
    import json
    import subprocess
    import sys

    import torchforge
    from torchforge.sampler import rendezvous_assign

    endpoint, _ = s3
    _client, _proxy, put = env
    rows = _upload_mds(tmp_path, put, "ds/nodes", n=96)
    url = f"s3://{BUCKET}/ds/nodes"
    ds = torchforge.open_dataset(url, cache_dir=tmp_path / "probe", storage_options={"endpoint": endpoint})
    sizes = [m.samples for m in ds.metas]
    # a seed whose placement gives both nodes the same number of samples, so that no rank pads its share
    seed = next(s for s in range(1000) if 2 * sum(sz for sz, node in zip(sizes, rendezvous_assign(len(sizes), 2, s))
                                                      if node == 0) == sum(sizes))
    placed = rendezvous_assign(len(sizes), 2, seed)
    proxies = [FaultProxy(endpoint), FaultProxy(endpoint)]
    script = os.path.join(os.path.dirname(__file__), "interop", "remote_node.py")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    out.mkdir()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
         script, url, str(tmp_path / f"cache-{node}"), proxies[node].url, str(seed), str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for node in range(2)]
    try:
        logs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            p.kill()
        for proxy in proxies:
            proxy.server.shutdown()
    assert [p.returncode for p in procs] == [0, 0], logs
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]
    for epoch in range(2):
        seen = sorted(i for r in ranks for i in r["epochs"][epoch])
        assert seen == list(range(len(rows)))  # every sample exactly once per epoch
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]  # reshuffled within the node
    for node in range(2):
        mine = {ds.metas[k].raw_basename for k in range(len(sizes)) if placed[k] == node}
        fetched = [path.rsplit("/", 1)[1] for path, _ in proxies[node].gets
                   if not path.endswith("index.json") and "list-type=" not in path]  # the listing that pins ETags
        assert sorted(fetched) == sorted(mine), (node, fetched, mine)  # only its own shards, each once
        bounds = np.cumsum([0] + sizes)
        own = {i for k in range(len(sizes)) if placed[k] == node for i in range(bounds[k], bounds[k + 1])}
        assert all(set(r["epochs"][0]) <= own for r in ranks if r["node"] == node)



def test_a_shard_evicted_between_its_fetch_and_its_open_is_fetched_again(env, tmp_path):
    import torchforge

    _client, proxy, put = env
    rows = _upload_mds(tmp_path, put, "ds/evicted", n=40)
    ds = torchforge.open_dataset(f"s3://{BUCKET}/ds/evicted", cache_dir=tmp_path / "cache",
                                 storage_options=_via(proxy))
    real, calls = ds._fetch, []

    def fetch_then_lose_it(client, k, next_use):  # another process's eviction, right after the fetch
        paths = real(client, k, next_use)
        calls.append(k)
        if len(calls) == 1:
            os.unlink(paths[0])
        return paths

    ds._fetch = fetch_then_lose_it
    proxy.reset()
    assert bytes(ds[0]["blob"]) == rows[0]["blob"]
    assert calls == [0, 0] and proxy.gets_of(ds.metas[0].raw_basename) == 2


def test_a_run_killed_mid_download_resumes_at_the_exact_sample_and_reads_nothing_partial(s3, env, tmp_path):
    """The training process and the node's fetcher are SIGKILLed while shards are downloading; a restart
    with the same cache folder loads the last recorded loader state and reads the rest of the epoch: the
    ids read before and after are the uninterrupted order, and every sample's bytes are checked."""
    import pickle
    import subprocess
    import sys

    from remote_resume import blob

    import torchforge
    from torchforge.formats.mds import MDSWriter
    from torchforge.sampler import GlobalSampler

    endpoint, _ = s3
    _client, _proxy, put = env
    local = tmp_path / "mds-resume"
    with MDSWriter(str(local), {"id": "int", "blob": "bytes"}, size_limit=300_000, hashes=["sha1"]) as w:
        for i in range(48):
            w.write({"id": i, "blob": blob(i)})
    for name in sorted(os.listdir(local), key=lambda n: n == "index.json"):
        put(f"ds/resume-kill/{name}", (local / name).read_bytes())
    url = f"s3://{BUCKET}/ds/resume-kill"
    proxy = FaultProxy(endpoint)
    proxy.delay = 0.05  # 64 KiB every 50 ms: a shard takes about a quarter of a second
    cache, record = tmp_path / "cache", str(tmp_path / "record.pkl")
    script = os.path.join(os.path.dirname(__file__), "interop", "remote_resume.py")
    cmd = [sys.executable, script, url, str(cache), proxy.url, record]
    try:
        first = subprocess.Popen(cmd)
        deadline = time.monotonic() + 60
        while not os.path.exists(record) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.path.exists(record), "the first run recorded no batch"
        time.sleep(0.3)
        fetchers = []  # the node's fetcher process for this cache folder, found by its command line
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    args = f.read().split(b"\0")
            except OSError:
                continue
            if any(b"torchforge.remote.fetcher import serve" in a for a in args) and str(cache).encode() in args:
                fetchers.append(pid)
        first.kill()
        for pid in fetchers:
            os.kill(int(pid), signal.SIGKILL)
        first.wait(10)
        assert fetchers and not os.path.exists(record + ".done")  # killed before the end of the epoch
        left = os.listdir(cache / "remote" / "objects")
        assert any(".tmp." in n for n in left), left  # a download was in progress: its partial file is left
        with open(record, "rb") as f:
            before = pickle.load(f)["ids"]
        proxy.delay = 0.0
        assert subprocess.run(cmd, check=False, timeout=120).returncode == 0  # checks every sample's bytes
    finally:
        proxy.server.shutdown()
    with open(record, "rb") as f:
        ids = pickle.load(f)["ids"]
    assert ids[:len(before)] == before and 0 < len(before) < 48
    assert ids == GlobalSampler(48, seed=3).indices(0, 48).tolist()
    ds = torchforge.open_dataset(url, cache_dir=cache, storage_options={"endpoint": endpoint})
    objects = cache / "remote" / "objects"
    for m in ds.metas:  # whatever the cache holds under a shard's name is the whole shard
        for name in os.listdir(objects):
            if name.endswith(m.raw_basename):
                assert os.path.getsize(objects / name) == m.raw_bytes, name


# Every 10 ms until SIGINT: the cache folder's bytes (partial downloads included), listed under the cache's
# accounting lock (evictions and reservations happen under it; a download renamed into place while the folder
# is listed may show under both its names: counted once), and the cache files that the test process or its
# children (the loader's workers) map after they were removed. Written as JSON to argv[2].
_WATCH = """
import contextlib, fcntl, json, os, sys, time
import psutil
cache, out = sys.argv[1], sys.argv[2]
objects = os.path.join(cache, "remote", "objects")
test = psutil.Process(os.getppid())
peaks, deleted = [], set()
try:
    while True:
        sizes = {}
        with open(os.path.join(cache, "remote", ".accounting"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            for e in os.scandir(objects):
                with contextlib.suppress(FileNotFoundError):
                    sizes[e.name.split(".tmp.")[0]] = e.stat().st_size
        peaks.append(sum(sizes.values()))
        for proc in [test, *test.children(recursive=True)]:
            try:
                with open(f"/proc/{proc.pid}/maps") as f:
                    lines = f.read().splitlines()
            except OSError:
                continue
            deleted.update(ln.split(None, 5)[-1] for ln in lines if objects in ln and ln.endswith("(deleted)"))
        time.sleep(0.01)
except KeyboardInterrupt:
    pass
with open(out, "w") as f:
    json.dump({"peaks": peaks, "deleted": sorted(deleted)}, f)
"""


def test_cache_limit_holds_every_10ms_and_no_mapped_shard_is_evicted(env, tmp_path):
    import torch

    import torchforge

    _client, proxy, put = env
    rows = [{"id": i, "blob": bytes([i % 251]) * 1000} for i in range(240)]
    local = tmp_path / "mds-tight"
    shard_bytes = _put_mds(put, local, "ds/tight", rows, 1 << 13)
    limit = sum(shard_bytes) // 4
    assert len(shard_bytes) >= 20 and limit >= 5 * max(shard_bytes)
    cache = tmp_path / "cache"
    ds = torchforge.open_dataset(f"s3://{BUCKET}/ds/tight", cache_dir=cache, cache_limit=limit,
                                 storage_options=_via(proxy))
    # the watcher is its own process: a lock it held while the loader forks would pass to the workers
    watcher = subprocess.Popen([sys.executable, "-c", _WATCH, str(cache), str(tmp_path / "watch.json")])
    try:
        got = {}
        for epoch in range(2):
            loader = torch.utils.data.DataLoader(ds, batch_size=None, shuffle=True, num_workers=2,
                                                 generator=torch.Generator().manual_seed(epoch))
            for s in loader:
                got[int(s["id"])] = bytes(s["blob"])
            assert got == {r["id"]: r["blob"] for r in rows}
        for i in torch.randperm(len(rows))[:60].tolist():  # the main process reads at random too
            assert bytes(ds[i]["blob"]) == rows[i]["blob"]
    finally:
        watcher.send_signal(signal.SIGINT)
        watcher.wait(30)
    seen = json.loads((tmp_path / "watch.json").read_text())
    peaks, deleted = seen["peaks"], seen["deleted"]
    assert len(peaks) > 20 and max(peaks) <= limit, (max(peaks), limit)
    assert not deleted, f"evicted while mapped: {sorted(deleted)[:3]}"
    assert sum(proxy.gets_of(f"ds/tight/{n}") for n in os.listdir(local) if n != "index.json") > len(shard_bytes)


# --- JINX at a URL -------------------------------------------------------------------------------------
INTEROP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "interop")


def _interop(name: str) -> tuple[str, dict]:
    with open(os.path.join(INTEROP, "manifest.json")) as f:
        return os.path.join(INTEROP, name), json.load(f)[name]


def _upload_folder(put, folder: str, prefix: str) -> int:
    total = 0
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        put(f"{prefix}/{name}", data)
        total += len(data)
    return total


def test_a_jinx_dataset_at_an_s3_url_reads_mldataforges_shards_fetching_each_once(env, tmp_path):
    import torch
    from expected import rich, same

    import torchforge
    from torchforge.datasets.remote import RemoteJinxDataset

    _client, proxy, put = env
    local, m = _interop("jinx-b64-multishard")
    total = _upload_folder(put, local, "jx/multi")
    proxy.reset()
    url = f"s3://{BUCKET}/jx/multi"
    ds = torchforge.open_dataset(url, cache_dir=tmp_path / "cache", storage_options=_via(proxy))
    assert isinstance(ds, RemoteJinxDataset) and len(ds) == m["n"]
    assert proxy.bytes_sent < total / 5  # opening read the footers, not the shards
    names = sorted(os.listdir(local))
    expected = list(rich(m["n"], m["seed"], m["tensors"]))
    proxy.reset()
    got = {}
    loader = torch.utils.data.DataLoader(range(len(ds)), batch_size=None, shuffle=True, num_workers=2,
                                         collate_fn=lambda i: (i, ds[i].to_dict() if hasattr(ds[i], "to_dict") else
                                                               dict(ds[i])))
    for i, sample in loader:
        got[i] = sample
    assert sorted(got) == list(range(m["n"]))
    for i, exp in enumerate(expected):
        assert same(exp, got[i]) == "", i
    # every shard and sidecar fetched whole once by the node (two forked workers share the cache)
    assert all(proxy.gets_of(f"jx/multi/{n}") == 1 for n in names), [(n, proxy.gets_of(f"jx/multi/{n}")) for n in names]
    proxy.reset()
    assert same(expected[-1], ds[-1]) == "" and [same(e, s) for e, s in zip(expected, ds)] == [""] * m["n"]
    assert proxy.bytes_sent == 0  # all from the node's cache now
    assert torchforge.open_dataset(url, split="nope", cache_dir=tmp_path / "cache",
                                   storage_options=_via(proxy)).__len__() == 0
    # the format's own class takes the URL too, with the same options, and pickles (spawned workers)
    direct = torchforge.JinxDataset(url, False, cache_dir=tmp_path / "cache", storage_options=_via(proxy))
    assert isinstance(direct, RemoteJinxDataset) and not direct.lazy and same(expected[7], direct[7]) == ""
    again = pickle.loads(pickle.dumps(direct))
    assert isinstance(again, RemoteJinxDataset) and same(expected[-1], again[-1]) == ""


@pytest.mark.parametrize("mode", ["shards", "ranges"])
def test_a_url_naming_one_shard_object_opens_that_shard_alone_as_a_local_file_does(env, tmp_path, mode):
    """``open_dataset("s3://b/x/shard-00003.jinx")`` is that one shard (with its .binx), as the local file
    is, even though its footer names a next shard; so is one .safetensors object of a marked dataset.
    Before: RemoteNotFoundError, "no index.json (MDS) and no shards below the folder"."""
    import torch
    from expected import same

    import torchforge
    from torchforge.datasets.remote import RemoteJinxDataset, RemoteSafetensorsDataset
    from torchforge.datasets.safetensors import SafetensorsShardWriter

    _client, proxy, put = env
    opts = {"cache_dir": tmp_path / "cache", "mode": mode, "storage_options": _via(proxy)}
    for fixture, name in [("jinx-a85-zst-inline", "shard-00000.jinx"), ("jinx-b64-zst-binx", "shard-00000.jinx"),
                          ("jinx-b64-multishard", "shard-00003.jinx")]:
        local, _m = _interop(fixture)
        _upload_folder(put, local, f"one/{mode}/{fixture}")
        want = torchforge.open_dataset(os.path.join(local, name))
        assert 0 < len(want)
        proxy.reset()
        url = f"s3://{BUCKET}/one/{mode}/{fixture}/{name}"
        ds = torchforge.open_dataset(url, **opts)
        assert isinstance(ds, RemoteJinxDataset) and len(ds) == len(want), fixture
        # HEAD requests found the object and its sidecar: no listing of the folder
        assert proxy.heads and all("?" not in path for path, _ in proxy.gets), proxy.gets
        assert [same(w.materialize(), g) for w, g in zip(want, ds)] == [""] * len(want), fixture
        again = pickle.loads(pickle.dumps(ds))  # (spawned workers open it again)
        assert same(want[len(want) - 1].materialize(), again[len(want) - 1]) == ""
        # no other shard of the folder was read
        assert {path.rsplit("/", 1)[1] for path, _ in proxy.gets} <= {name, name[:-5] + ".binx"}, proxy.gets
    st = tmp_path / "st"
    with SafetensorsShardWriter(str(st), samples_per_shard=5) as w:
        for i in range(12):
            w.write({"x": torch.full((3,), float(i)), "ids": torch.arange(i % 4 + 1)})
    _upload_folder(put, str(st), f"one/{mode}/st")
    proxy.reset()
    ds = torchforge.open_dataset(f"s3://{BUCKET}/one/{mode}/st/shard-00001.safetensors", **opts)
    assert isinstance(ds, RemoteSafetensorsDataset) and len(ds) == 5  # the middle shard, not marked last
    assert all("?" not in path for path, _ in proxy.gets), proxy.gets  # no listing of the folder either
    assert [float(ds[i]["x"][0]) for i in range(5)] == [5.0, 6.0, 7.0, 8.0, 9.0]
    assert torch.equal(ds[4]["ids"], torch.arange(9 % 4 + 1))
    # an object that is not there is still named; a folder is still a folder
    with pytest.raises(RemoteNotFoundError) as e:
        torchforge.open_dataset(f"s3://{BUCKET}/one/{mode}/st/shard-00009.safetensors", **opts)
    assert "shard-00009.safetensors" in str(e.value)
    assert len(torchforge.open_dataset(f"s3://{BUCKET}/one/{mode}/st", **opts)) == 12


def test_a_jinx_shard_overwritten_or_lying_at_its_url_is_a_typed_error_naming_it(env, tmp_path):
    import torchforge
    from torchforge.errors import CorruptShardError
    from torchforge.remote import RemoteChangedError

    _client, proxy, put = env
    local, _ = _interop("jinx-b64-multishard")
    _upload_folder(put, local, "jx/over")
    url = f"s3://{BUCKET}/jx/over"
    ds = torchforge.open_dataset(url, cache_dir=tmp_path / "cache", storage_options=_via(proxy))
    last = ds.locate(len(ds) - 1)[0]
    with open(os.path.join(local, f"shard-{last:05d}.jinx"), "rb") as f:
        data = f.read()
    put(f"jx/over/shard-{last:05d}.jinx", data[:10] + bytes([data[10] ^ 1]) + data[11:])  # another version
    with pytest.raises(RemoteChangedError, match=f"shard-{last:05d}.jinx"):
        ds[len(ds) - 1]
    assert ds[0] is not None  # the shards that did not change still read
    put(f"jx/over/shard-{last:05d}.jinx", data[: len(data) // 2])  # truncated: no footer-offset line
    with pytest.raises(CorruptShardError, match=f"shard-{last:05d}.jinx") as e:
        torchforge.open_dataset(url, cache_dir=tmp_path / "cache", storage_options=_via(proxy))
    assert e.value.offset is not None
    put(f"jx/over/shard-{last:05d}.jinx", data[:-40] + b"\n999999999999\n")  # a lying footer offset
    with pytest.raises(CorruptShardError, match="footer"):
        torchforge.open_dataset(url, cache_dir=tmp_path / "cache", storage_options=_via(proxy))


class _RangeHandler(BaseHTTPRequestHandler):
    """GET (with one ``Range: bytes=a-b``, and ``If-Match`` honoured as a web server does: 412 when the
    ETag differs) and HEAD of the files below the server's folder, with ETags; records (path, ranged) for
    every GET served. A subclass may send no ETag, no Last-Modified, or ignore If-Match."""

    ETAG = True
    LAST_MODIFIED = True
    IF_MATCH = True

    def log_message(self, *args):
        pass

    def _file(self):
        path = os.path.join(self.server.folder, self.path.lstrip("/"))
        if not os.path.isfile(path):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        return path

    def _headers(self, path: str, status: int, length: int, extra: dict) -> None:
        st = os.stat(path)
        self.send_response(status)
        self.send_header("Content-Length", str(length))
        if self.ETAG:
            self.send_header("ETag", f'"{st.st_size}-{st.st_mtime_ns}"')
        if self.LAST_MODIFIED:
            self.send_header("Last-Modified", self.date_time_string(int(st.st_mtime)))
        self.send_header("Accept-Ranges", "bytes")
        for k, v in extra.items():
            self.send_header(k, v)
        self.end_headers()

    def do_HEAD(self):
        path = self._file()
        if path is not None:
            self._headers(path, 200, os.path.getsize(path), {})

    def do_GET(self):
        path = self._file()
        if path is None:
            return
        with open(path, "rb") as f:
            data = f.read()
        st = os.stat(path)
        match = self.headers.get("If-Match")
        if self.IF_MATCH and match is not None and match != f'"{st.st_size}-{st.st_mtime_ns}"':
            self.send_response(412)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        rng = self.headers.get("Range")
        if rng:
            a, b = rng.removeprefix("bytes=").split("-")
            a, b = int(a), (int(b) if b else len(data) - 1)
            body = data[a:b + 1]
            self._headers(path, 206, len(body), {"Content-Range": f"bytes {a}-{a + len(body) - 1}/{len(data)}"})
        else:
            body = data
            self._headers(path, 200, len(body), {})
        self.server.gets.append((self.path, bool(rng)))
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    request_queue_size = 128  # (http.server's 5 drops connections a client opens at once: 1 s SYN retries)


def _serve(folder, handler=None):
    """A ThreadingHTTPServer serving ``folder`` with ``handler`` (:class:`_RangeHandler`) in a thread."""
    server = _Server(("127.0.0.1", 0), handler or _RangeHandler)
    server.folder, server.gets = folder, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class _NoETagHandler(_RangeHandler):
    """A web server that sends Last-Modified but no ETag (and so ignores If-Match), as some static servers
    and CDNs do."""

    ETAG = False
    IF_MATCH = False


class _DeafHandler(_RangeHandler):
    """A web server that sends ETags but ignores If-Match (Python's http.server ignores it too)."""

    IF_MATCH = False


@pytest.mark.parametrize("handler", [_RangeHandler, _NoETagHandler], ids=["etag", "last-modified"])
def test_a_jinx_dataset_at_an_http_url_is_found_by_probing_and_read_with_ranges(tmp_path, handler):
    from expected import rich, same

    import torchforge

    local, m = _interop("jinx-b64-multishard")
    server = _serve(local, handler)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        ds = torchforge.open_dataset(url, cache_dir=tmp_path / "cache")  # http:// itself allows plain HTTP
        assert len(ds) == m["n"]
        assert server.gets and all(ranged for _, ranged in server.gets)  # opening read footers, no whole shard
        for i, exp in enumerate(rich(m["n"], m["seed"], m["tensors"])):
            assert same(exp, ds[i]) == "", i
        whole = [path for path, ranged in server.gets if not ranged]
        assert sorted(whole) == sorted(f"/{n}" for n in os.listdir(local))  # each shard and sidecar once
        one = torchforge.open_dataset(f"{url}/shard-00003.jinx", cache_dir=tmp_path / "cache",
                                      storage_options={"allow_http": True})  # one shard alone, as a local file
        want = torchforge.open_dataset(os.path.join(local, "shard-00003.jinx"))
        assert [same(w.materialize(), g) for w, g in zip(want, one)] == [""] * len(want) and len(one) == len(want)
    finally:
        server.shutdown()


class _SoftMissingHandler(_RangeHandler):
    """A web server that answers a missing path with 200 and a page (a "soft 404")."""

    def _file(self):
        path = os.path.join(self.server.folder, self.path.lstrip("/"))
        return path if os.path.isfile(path) else os.path.join(self.server.folder, "index.html")


class _NoHeadHandler(_RangeHandler):
    """A web server that serves GET (byte ranges too) and refuses HEAD (405), as some gateways do."""

    def do_HEAD(self):
        self.send_response(405)
        self.send_header("Allow", "GET")
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.mark.parametrize("fmt", ["jinx", "safetensors"])
def test_a_server_that_answers_every_path_is_an_error_not_a_probe_for_ever(tmp_path, fmt):
    """An http folder is probed shard-00000, shard-00001, ... up to the first missing one: a server that
    answers a missing path with 200 (a soft 404) made JinxDataset(url) and SafetensorsDataset(url) probe for
    ever (30,000 HEADs in 15 s, memory growing)."""
    import torchforge
    from torchforge.remote import RemoteError

    (tmp_path / "index.html").write_text("<html>not found</html>")
    server = _serve(str(tmp_path), _SoftMissingHandler)
    url = f"http://127.0.0.1:{server.server_address[1]}/ds"
    cls = {"jinx": torchforge.JinxDataset, "safetensors": torchforge.SafetensorsDataset}[fmt]
    result: list = []

    def open_it():
        try:
            result.append(cls(url, cache_dir=tmp_path / "cache"))
        except Exception as e:  # noqa: BLE001 - the outcome is checked below
            result.append(e)

    t = threading.Thread(target=open_it, daemon=True)
    t.start()
    t.join(60)
    server.shutdown()
    assert not t.is_alive(), "still probing after 60 s"
    assert isinstance(result[0], RemoteError) and "answers for an object that does not exist" in str(result[0])


def test_a_server_that_refuses_head_is_read_through_get(tmp_path):
    """A server answering HEAD with 405 (GET served) read as 'no dataset here': the object's size and
    validator now come from a GET of its first byte where HEAD finds nothing."""
    import torchforge
    from torchforge.formats.mds import MDSWriter

    with MDSWriter(str(tmp_path / "ds"), {"id": "int"}) as w:
        for i in range(10):
            w.write({"id": i})
    server = _serve(str(tmp_path), _NoHeadHandler)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/ds"
        for mode in ("shards", "ranges"):
            ds = torchforge.open_dataset(url, cache_dir=tmp_path / f"cache-{mode}", mode=mode)
            assert [int(s["id"]) for s in ds] == list(range(10))
        with pytest.raises(torchforge.remote.RemoteNotFoundError):
            torchforge.open_dataset(url + "-missing", cache_dir=tmp_path / "cache-missing")
    finally:
        server.shutdown()


@pytest.mark.parametrize("handler", [_RangeHandler, _NoETagHandler, _DeafHandler], ids=["etag", "last-modified",
                                                                                       "if-match-ignored"])
@pytest.mark.parametrize("mode", ["ranges", "shards"])
def test_an_mds_dataset_at_an_http_url_pins_every_shard_when_it_opens(tmp_path, mode, handler):
    """http(s) folders cannot be listed: every shard is pinned by a HEAD at open, so a shard overwritten
    mid-run is a RemoteChangedError naming it, in either mode, never its new bytes read with the old
    offsets (before, ranges mode sent no If-Match at all). The pin is the ETag, or the Last-Modified time
    where the server sends no ETag (before, such a shard was cached by its size alone: a rewrite at the same
    size was served from the old cache forever, and ranges mode read the new bytes with the old index), and
    each reply's own validator is checked, for servers that ignore If-Match. Opened again, the dataset
    reads the new version."""
    import shutil

    import torchforge
    from torchforge.formats.mds import MDSWriter

    def write(folder, marker):
        with MDSWriter(str(folder), {"id": "int", "blob": "bytes"}, size_limit=1 << 11) as w:
            for i in range(30):
                w.write({"id": i, "blob": bytes([marker]) * (50 + i)})

    write(tmp_path / "v1", 1)
    write(tmp_path / "v2", 2)
    served = tmp_path / "served"
    shutil.copytree(tmp_path / "v1", served)
    server = _serve(str(served), handler)
    opts = {"mode": mode, "cache_dir": tmp_path / "cache", "storage_options": {"allow_http": True}}
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        ds = torchforge.open_dataset(url, **opts)
        shards = sorted(n for n in os.listdir(served) if n != "index.json")
        assert len(shards) >= 2 and all(ds._etags.get(f"{url}/{n}") for n in shards)
        assert bytes(ds[0]["blob"]) == bytes([1]) * 50
        for name in shards:  # every shard rewritten at its size, a minute later: another ETag and Last-Modified
            shutil.copy(tmp_path / "v2" / name, served / name)
            os.utime(served / name, (time.time() + 60, time.time() + 60))
        with pytest.raises(RemoteChangedError, match=shards[-1]):
            ds[29]
        if mode == "shards":  # the shard fetched before the rewrite reads on from the cache: the pinned version
            assert bytes(ds[1]["blob"]) == bytes([1]) * 51
        else:
            with pytest.raises(RemoteChangedError, match=shards[0]):
                ds[1]
        again = torchforge.open_dataset(url, **opts)
        assert [bytes(again[i]["blob"]) for i in (0, 29)] == [bytes([2]) * 50, bytes([2]) * 79]
    finally:
        server.shutdown()


class _NoRangeHandler(_RangeHandler):
    """A web server that ignores Range and answers every GET with the whole file (200)."""

    def do_GET(self):
        path = self._file()
        if path is not None:
            with open(path, "rb") as f:
                data = f.read()
            self._headers(path, 200, len(data), {})
            self.server.gets.append((self.path, bool(self.headers.get("Range"))))
            self.wfile.write(data)


def test_a_server_without_byte_ranges_serves_shards_whole_and_ranges_mode_says_so(tmp_path, monkeypatch):
    """A shard larger than one part is fetched in range GETs; a server that answers them with the whole
    file (200, obstore's NotSupportedError) gets one plain GET per shard instead, and every sample reads
    (before: the download failed, telling the user to use mode='shards', the mode in use). In
    mode='ranges' the error names the URL and says to use mode='shards'."""
    import torchforge
    from torchforge.formats.mds import MDSWriter

    monkeypatch.setenv("TORCHFORGE_FETCH_BLOCK", str(64 * 1024))  # parts of 512 KiB: a 1.5 MB shard has 3
    folder = tmp_path / "ds"
    blobs = [os.urandom(50_000 + i) for i in range(60)]
    with MDSWriter(str(folder), {"id": "int", "blob": "bytes"}, size_limit=1_500_000) as w:
        for i, b in enumerate(blobs):
            w.write({"id": i, "blob": b})
    server = _serve(str(folder), _NoRangeHandler)
    opts = {"storage_options": {"allow_http": True}}
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        ds = torchforge.open_dataset(url, mode="shards", cache_dir=tmp_path / "cache", **opts)
        assert [bytes(ds[i]["blob"]) for i in range(len(ds))] == blobs
        whole = sorted(p for p, ranged in server.gets if not ranged and p != "/index.json")
        assert whole == sorted(f"/{m.raw_basename}" for m in ds.metas)  # one whole GET per shard
        ranged = torchforge.open_dataset(url, mode="ranges", cache_dir=tmp_path / "cache2", **opts)
        with pytest.raises(RemoteError, match="does not serve byte ranges: an MDS dataset reads with mode='shards'") as e:
            ranged[0]
        assert e.value.url == f"{url}/{ds.metas[0].raw_basename}"
    finally:
        server.shutdown()


def test_verify_of_a_jinx_url_on_a_server_without_byte_ranges_says_the_server_not_damaged(tmp_path, capsys):
    """The server, not the data, cannot serve a JINX dataset (its footers are read by ranges): verify said
    "DAMAGED" of an intact shard; it is now the command's error, as inspect's is."""
    from torchforge.cli import main

    local, _ = _interop("jinx-b64-multishard")
    server = _serve(local, _NoRangeHandler)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert main(["verify", url, "--cache-dir", str(tmp_path / "cache")]) == 1
        out, err = capsys.readouterr()
        assert "DAMAGED" not in out and "does not serve byte ranges" in err
    finally:
        server.shutdown()
        server.server_close()  # (a listening socket nobody serves would keep the other footer reads waiting)


def _jinx_footer_rewritten(path, fn, foot_line=None):
    """Rewrite a JINX shard's footer JSON with ``fn(dict) -> dict`` (its lines kept), and optionally its last
    line (the footer's offset)."""
    with open(path, "rb") as f:
        data = f.read()
    nl = data.rfind(b"\n", 0, len(data) - 1)
    foot = int(data[nl + 1:-1])
    footer = fn(json.loads(data[foot:nl]))
    last = str(foot).encode() if foot_line is None else foot_line
    with open(path, "wb") as f:
        f.write(data[:foot] + json.dumps(footer).encode() + b"\n" + last + b"\n")


@pytest.mark.parametrize("mode", ["shards", "ranges"])
@pytest.mark.parametrize("count", [0, 10**15])
def test_a_jinx_footer_lying_about_its_sample_count_is_refused_at_open_in_either_mode(tmp_path, mode, count):
    """Every shard's index is checked against its footer's num_samples when the dataset opens, in either
    mode (before, mode='shards' took the count on the footer's word: 0 for a shard of 12 samples dropped
    them silently, 10**15 became len(ds) and a sampler's allocation)."""
    import torchforge
    from torchforge.formats.jinx import JinxWriter

    local = tmp_path / "jx"
    with JinxWriter(str(local), shard_size=1500, compression=None) as w:
        for i in range(30):
            w.write({"id": i, "text": f"sample {i}", "blob": bytes([i]) * (20 + i)})
    last = max(os.listdir(local))
    _jinx_footer_rewritten(local / last, lambda f: {**f, "num_samples": count})
    server = _serve(str(local))
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(CorruptShardError, match=f"footer num_samples={count} needs") as e:
            torchforge.open_dataset(url, mode=mode, cache_dir=tmp_path / "c", storage_options={"allow_http": True})
        assert e.value.path == f"{url}/{last}"
    finally:
        server.shutdown()


def test_lying_jinx_footer_offsets_and_index_lengths_fail_before_a_large_read(tmp_path, monkeypatch):
    """A footer offset of 0 on a 2 MB shard, and a sidecar index claiming 1 MB for 2 samples, are typed
    errors naming the URL, found before the bytes are fetched (before, both were read whole first: a 20 GB
    shard would have been read into memory at open). A footer offset that does not start a line is refused
    too, as the local reader refuses it."""
    import torchforge
    from torchforge.formats.jinx import JinxWriter

    def fresh(name, **kw):
        with JinxWriter(str(tmp_path / name), shard_size=1 << 30, compression=None, **kw) as w:
            for i in range(2000 if name != "side" else 2):
                w.write({"id": i, "blob": os.urandom(1000)})
        return tmp_path / name / "shard-00000.jinx"

    monkeypatch.setattr("torchforge.datasets.remote.jinx.MAX_FOOTER", 1 << 20)  # (64 MiB: a large shard to write)
    _jinx_footer_rewritten(fresh("zero"), lambda f: f, foot_line=b"0")
    shifted = fresh("shifted")
    data = shifted.read_bytes()
    nl = data.rfind(b"\n", 0, len(data) - 1)
    _jinx_footer_rewritten(shifted, lambda f: f, foot_line=str(int(data[nl + 1:-1]) - 5).encode())
    side = fresh("side", binary_threshold=16)
    with open(tmp_path / "side" / "shard-00000.binx", "ab") as f:
        f.write(b"\0" * (1 << 20))

    def in_sidecar(footer):
        key = next(k for k in footer if k.startswith("index."))
        value = footer.pop(key)
        if not key.endswith(".bin"):  # an inline index, moved into the sidecar's tail
            key += ".bin"
            value = {"offset": 0, "length": 1 << 20}
        return {**footer, key: {**value, "length": 1 << 20}}

    _jinx_footer_rewritten(side, in_sidecar)
    server = _serve(str(tmp_path))
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        for name, match in [("zero", "more than"), ("shifted", "does not start a line"),
                            ("side", "the index in the sidecar is 1048576 bytes, more than")]:
            server.gets.clear()
            with pytest.raises(CorruptShardError, match=match) as e:
                torchforge.open_dataset(f"{url}/{name}", cache_dir=tmp_path / "c", storage_options={"allow_http": True})
            assert e.value.path == f"{url}/{name}/shard-00000.jinx"
            assert not [p for p, ranged in server.gets if not ranged]  # no whole object fetched
    finally:
        server.shutdown()


@pytest.mark.parametrize("limit", [None, "1GB"])
def test_errors_of_a_shard_checked_once_fetched_name_its_url_not_the_cache_file(tmp_path, limit):
    """A safetensors shard's ragged offsets are checked when the shard is mapped from the node's cache
    (mode='shards'): the error names the shard's URL (before, the cache file). A JINX shard whose index
    lives in a missing sidecar is refused at open, naming the URLs (before, at read, with an invented
    '.jinx.no-sidecar' cache file name)."""
    import torch

    import torchforge
    from torchforge.datasets.safetensors import SafetensorsShardWriter
    from torchforge.formats.jinx import JinxWriter

    st = tmp_path / "st"
    with SafetensorsShardWriter(str(st), samples_per_shard=7) as w:
        for i in range(14):
            w.write({"ids": torch.arange(i % 5 + 1), "y": torch.tensor(float(i))})
    raw = bytearray((st / "shard-00001.safetensors").read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    at = 8 + n + json.loads(raw[8:8 + n])["ids.offsets"]["data_offsets"][0] + 8 * 3
    raw[at:at + 8] = struct.pack("<q", 0)  # a ragged offset that falls
    (st / "shard-00001.safetensors").write_bytes(bytes(raw))
    jx = tmp_path / "jx"
    with JinxWriter(str(jx), shard_size=1500, compression=None, binary_threshold=16) as w:
        for i in range(30):
            w.write({"id": i, "blob": bytes([i]) * (20 + i)})
    (jx / "shard-00001.binx").unlink()
    server = _serve(str(tmp_path))
    opts = {"mode": "shards", "cache_limit": limit, "storage_options": {"allow_http": True}}
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        ds = torchforge.open_dataset(f"{url}/st", cache_dir=tmp_path / "c", **opts)
        with pytest.raises(CorruptShardError, match="offsets of ragged column 'ids'") as e:
            ds[7]
        assert e.value.path == f"{url}/st/shard-00001.safetensors" and str(tmp_path / "c") not in str(e.value)
        with pytest.raises(CorruptShardError, match="sidecar shard-00001.binx, which is missing") as e:
            torchforge.open_dataset(f"{url}/jx", cache_dir=tmp_path / "c", **opts)
        assert e.value.path == f"{url}/jx/shard-00001.jinx"
    finally:
        server.shutdown()


@pytest.mark.parametrize("mode", ["shards", "ranges"])
def test_opening_a_jinx_dataset_over_http_reads_the_shards_heads_concurrently(tmp_path, mode):
    """Probing for shards (HEAD), footers and sidecar indexes are a round trip each: opening issues them
    several at a time (before: one after the other, 1.45 s for 14 shards behind a 20 ms server; now
    0.36-0.50 s). Counted here as the most requests the server had in flight at once."""
    import torchforge
    from torchforge.formats.jinx import JinxWriter

    class Slow(_RangeHandler):
        def _slowly(self, serve):
            with self.server.lock:
                self.server.inflight += 1
                self.server.most = max(self.server.most, self.server.inflight)
            try:
                time.sleep(0.05)
                serve()
            finally:
                with self.server.lock:
                    self.server.inflight -= 1

        def do_GET(self):
            self._slowly(super().do_GET)

        def do_HEAD(self):
            self._slowly(super().do_HEAD)

    local = tmp_path / "jx"
    with JinxWriter(str(local), shard_size=1000, compression=None, binary_threshold=16) as w:
        for i in range(200):
            w.write({"id": i, "blob": bytes([i]) * 300})
    shards = len([n for n in os.listdir(local) if n.endswith(".jinx")])
    server = _serve(str(local), Slow)
    server.lock, server.inflight, server.most = threading.Lock(), 0, 0
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        ds = torchforge.open_dataset(url, mode=mode, cache_dir=tmp_path / "c", storage_options={"allow_http": True})
        assert shards >= 8 and len(ds) == 200 and bytes(ds[199]["blob"]) == bytes([199]) * 300
        assert server.most >= 4, server.most
    finally:
        server.shutdown()


def test_a_server_that_gives_no_version_at_all_is_warned_about_and_its_index_is_read_afresh(tmp_path):
    """A server that sends neither ETag nor Last-Modified: nothing can tell a same-size rewrite from the
    cached shard, and opening says so (naming the URL). index.json is read afresh at every open and keys
    the dataset's version by its bytes (before, it was cached by its size: a rewritten index of the same
    size was never seen again)."""
    import shutil

    import torchforge
    from torchforge.formats.mds import MDSWriter

    class Bare(_RangeHandler):
        ETAG = LAST_MODIFIED = IF_MATCH = False

    def write(folder, n):
        with MDSWriter(str(folder), {"id": "int", "blob": "bytes"}, size_limit=1 << 11) as w:
            for i in range(n):
                w.write({"id": i, "blob": bytes([7]) * 60})  # (same-size samples: n alone sizes index.json)

    write(tmp_path / "v1", 30)
    write(tmp_path / "v2", 31)
    served = tmp_path / "served"
    shutil.copytree(tmp_path / "v1", served)
    server = _serve(str(served), Bare)
    opts = {"cache_dir": tmp_path / "cache", "storage_options": {"allow_http": True}}
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.warns(UserWarning, match=r"/shard\.00000\.mds .*neither an ETag nor a Last-Modified"):
            ds = torchforge.open_dataset(url, **opts)
        assert len(ds) == 30 and ds.version.startswith("sha256:")
        assert (tmp_path / "v1" / "index.json").stat().st_size == (tmp_path / "v2" / "index.json").stat().st_size
        shutil.rmtree(served)
        shutil.copytree(tmp_path / "v2", served)
        with pytest.warns(UserWarning):
            again = torchforge.open_dataset(url, **opts)
        assert len(again) == 31 and again.version != ds.version
    finally:
        server.shutdown()


def _put_columns(put, local, prefix: str, per_shard: int, samples) -> tuple[Any, int]:
    """``samples`` written as safetensors column shards in ``local`` and uploaded below ``prefix``; returns
    the local dataset (the expected samples) and the bytes uploaded."""
    import torchforge
    from torchforge.datasets.safetensors import SafetensorsShardWriter

    with SafetensorsShardWriter(local, samples_per_shard=per_shard) as w:
        for sample in samples:
            w.write(sample)
    return torchforge.SafetensorsDataset(str(local)), _upload_folder(put, str(local), prefix)


def test_safetensors_shards_at_an_s3_url_read_like_local_ones_and_a_bad_header_names_the_url(env, tmp_path):
    import torch

    import torchforge
    from torchforge.datasets.remote import RemoteSafetensorsDataset
    from torchforge.errors import SafetensorsError

    _client, proxy, put = env
    local = tmp_path / "st"
    g = torch.Generator().manual_seed(5)
    expected, total = _put_columns(put, local, "st/a", 7, ({"ids": torch.randint(0, 9, (300 + i % 5,), generator=g),
                                                            "y": torch.tensor(float(i))} for i in range(40)))
    url = f"s3://{BUCKET}/st/a"
    proxy.reset()
    ds = torchforge.open_dataset(url, cache_dir=tmp_path / "cache", storage_options=_via(proxy))
    assert isinstance(ds, RemoteSafetensorsDataset) and len(ds) == 40 and ds.columns == ["ids", "y"]
    assert proxy.bytes_sent < total / 4  # the listing and the headers, not the shards
    loader = torch.utils.data.DataLoader(ds, batch_size=None, shuffle=True, num_workers=2)
    seen = 0
    for s in loader:
        i = int(s["y"])
        assert torch.equal(s["ids"], expected[i]["ids"])
        seen += 1
    assert seen == 40
    names = sorted(os.listdir(local))
    assert all(proxy.gets_of(f"st/a/{n}") >= 1 for n in names)
    direct = torchforge.SafetensorsDataset(url, cache_dir=tmp_path / "cache", storage_options=_via(proxy))
    assert isinstance(direct, RemoteSafetensorsDataset) and torch.equal(direct[39]["ids"], expected[39]["ids"])
    # options only one format takes find that format (the JINX class, tried first, has no columns=)
    some = torchforge.open_dataset(url, columns=["y"], cache_dir=tmp_path / "cache", storage_options=_via(proxy))
    assert isinstance(some, RemoteSafetensorsDataset) and some.columns == ["y"] and float(some[3]["y"]) == 3.0
    with open(local / names[2], "rb") as f:
        data = bytearray(f.read())
    data[12] ^= 0x40  # a bit flipped inside the JSON header
    put(f"st/a/{names[2]}", bytes(data))
    with pytest.raises(SafetensorsError, match=names[2]) as e:
        torchforge.open_dataset(url, cache_dir=tmp_path / "cache", storage_options=_via(proxy))
    assert "s3://" in str(e.value)


def test_safetensors_shards_at_a_url_in_ranges_mode_read_rows_by_coalesced_ranges(env, tmp_path):
    import torch

    import torchforge
    from torchforge.sampler import GlobalSampler

    _client, proxy, put = env
    g = torch.Generator().manual_seed(6)
    expected, _ = _put_columns(put, tmp_path / "str", "st/r", 10, (
        {"ids": torch.randint(0, 9, (200 + 7 * i,), generator=g),  # ragged
         "emb": torch.randn(4, 3, generator=g).to(torch.bfloat16), "y": torch.tensor(float(i))} for i in range(50)))
    ds = torchforge.open_dataset(f"s3://{BUCKET}/st/r", mode="ranges", cache_dir=tmp_path / "cache",
                                 storage_options=_via(proxy))

    def same(a, b):
        return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)

    proxy.reset()
    got = [s for k in range(0, 50, 10) for s in ds.__getitems__(list(range(k, k + 10)))]
    assert all(same(got[i], expected[i]) for i in range(50))
    wanted = sum(t.numel() * t.element_size() for i in range(50) for t in expected[i].values())
    offsets = 5 * 11 * 8  # each shard's ragged offsets, read once
    assert proxy.bytes_sent <= 1.1 * wanted + offsets  # the rows' bytes, not the shards
    assert len(proxy.gets) < 50 / 2  # a batch's rows of one shard: one coalesced read, and one for the offsets
    assert not os.listdir(tmp_path / "cache" / "remote" / "objects")  # no shard downloaded
    assert same(ds[-1], expected[49]) and same(ds.__getitems__([47, 3, -50])[2], expected[0])
    sampler = GlobalSampler(len(ds), seed=1)
    loader = torchforge.DataLoader(ds, batch_size=8, sampler=sampler, num_workers=2, collate_fn=list)
    seen = [s for b in loader for s in b]
    assert [int(s["y"]) for s in seen] == sampler.indices(0, 50).tolist()
    assert all(same(s, expected[int(s["y"])]) for s in seen)


@pytest.mark.parametrize("fixture", ["jinx-b64-multishard", "jinx-b64-zst-binx", "jinx-a85-zst-inline"])
def test_a_jinx_dataset_at_a_url_in_ranges_mode_reads_lines_then_sidecar_values_by_coalesced_ranges(env, tmp_path,
                                                                                                    capsys, fixture):
    import random

    from expected import rich, same

    import torchforge
    from torchforge.cli import main
    from torchforge.sampler import GlobalSampler

    _client, proxy, put = env
    local, m = _interop(fixture)  # MLDataForge's shards: index inline (plain or zst), or in the sidecar
    prefix = f"jx/ranges-{fixture}"
    _upload_folder(put, local, prefix)
    url = f"s3://{BUCKET}/{prefix}"
    ds = torchforge.open_dataset(url, mode="ranges", cache_dir=tmp_path / "cache", storage_options=_via(proxy))
    expected = list(rich(m["n"], m["seed"], m["tensors"]))
    assert len(ds) == m["n"]
    order = list(range(m["n"]))
    random.Random(5).shuffle(order)  # an exact global shuffle
    proxy.reset()
    got = {}
    half = len(order) // 2  # batches as dense in the dataset as the MDS ranges test's
    for b in range(0, len(order), half):
        batch = order[b:b + half]
        got.update(zip(batch, ds.__getitems__(batch)))
    assert [same(expected[i], got[i]) for i in range(m["n"])] == [""] * m["n"]  # lazy samples, decoded later
    # every line and every sidecar value read once over the epoch: within 1.1x of those bytes
    lines = sum(torchforge.JinxDataset(os.path.join(local, n)).shards[0]._footer_offset
                for n in os.listdir(local) if n.endswith(".jinx"))
    sidecars = sum(os.path.getsize(os.path.join(local, n)) for n in os.listdir(local) if n.endswith(".binx"))
    assert lines <= proxy.bytes_sent <= 1.1 * (lines + sidecars), (proxy.bytes_sent, lines, sidecars)
    assert proxy.gets and all(rng for _, rng in proxy.gets)  # ranges only, never a whole object
    assert len(proxy.gets) < m["n"]  # coalesced: fewer GETs than samples (a line and its values: two objects)
    assert not os.path.exists(tmp_path / "cache" / "remote" / "objects") or not os.listdir(
        tmp_path / "cache" / "remote" / "objects")  # nothing downloaded whole
    assert same(expected[-1], ds[-1]) == "" and same(expected[3], ds.__getitems__([-1, 3])[1]) == ""
    with pytest.raises(IndexError, match="out of range"):
        ds[m["n"]]
    assert [s.num_samples for s in ds.shards] == ds._counts  # footers and indexes, no lines
    with pytest.raises(ValueError, match="holds its index, not its lines"):
        ds.shards[0].sample(0)
    so = ["--storage-option", f"endpoint={proxy.url}", "--mode", "ranges", "--cache-dir", str(tmp_path / "cache")]
    assert main(["inspect", url, "--json", *so]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["samples"] == m["n"] and info["mode"] == "ranges" and info["shard count"] == len(ds.shards)
    assert main(["bench", url, "--limit", "40", *so]) == 0 and "shuffle" in capsys.readouterr().out
    # eager samples, iteration, pickling (spawned workers), and the loader's forked workers in the sampler's order
    eager = torchforge.JinxDataset(url, False, mode="ranges", cache_dir=tmp_path / "cache",
                                   storage_options=_via(proxy))
    assert type(eager[7]) is dict and same(expected[7], eager[7]) == ""
    assert [same(e, s) for e, s in zip(expected, pickle.loads(pickle.dumps(eager)))] == [""] * m["n"]
    sampler = GlobalSampler(len(ds), seed=3)
    loader = torchforge.DataLoader(ds, batch_size=16, sampler=sampler, num_workers=2, collate_fn=list)
    seen = [s for batch in loader for s in batch]
    want = sampler.indices(0, len(sampler)).tolist()
    assert [same(expected[i], s) for i, s in zip(want, seen)] == [""] * len(want)


def test_a_jinx_dataset_in_ranges_mode_names_a_bad_line_or_a_truncated_sidecar_at_its_url(env, tmp_path):
    import torchforge
    from torchforge.errors import CorruptShardError

    _client, proxy, put = env
    local, m = _interop("jinx-b64-multishard")
    _upload_folder(put, local, "jx/ranges-bad")
    with open(os.path.join(local, "shard-00001.jinx"), "rb") as f:
        data = f.read()
    shard = torchforge.JinxDataset(os.path.join(local, "shard-00001.jinx")).shards[0]
    line = int(shard.offsets[4])  # sample 4 of shard 1: its first byte flipped, no longer JSON
    put("jx/ranges-bad/shard-00001.jinx", data[:line] + b"!" + data[line + 1:])
    with open(os.path.join(local, "shard-00002.binx"), "rb") as f:
        side = f.read()
    put("jx/ranges-bad/shard-00002.binx", side[: len(side) // 2])  # a truncated sidecar
    url = f"s3://{BUCKET}/jx/ranges-bad"
    ds = torchforge.open_dataset(url, mode="ranges", lazy=False, cache_dir=tmp_path / "cache",
                                 storage_options=_via(proxy))
    first1, first2, first3 = (next(i for i in range(len(ds)) if ds.locate(i) == (k, 0)) for k in (1, 2, 3))
    with pytest.raises(CorruptShardError, match="shard-00001.jinx.*not a JSON line") as e:
        ds.__getitems__([0, first1 + 4])
    assert e.value.offset == line
    with pytest.raises(CorruptShardError, match="shard-00002.binx.*past its end"):
        ds.__getitems__(list(range(first2, first3)))
    assert ds[first1 + 3] is not None and ds[0] is not None  # the rest still reads
    skipping = torchforge.open_dataset(url, mode="ranges", lazy=False, on_error="skip", cache_dir=tmp_path / "cache",
                                       storage_options=_via(proxy))
    kept = list(skipping)
    assert skipping.skipped >= 2 and len(kept) == m["n"] - skipping.skipped  # the bad line and the values past the end
    assert all(type(s) is dict for s in kept)
    with pytest.raises(CorruptShardError, match="shard-00001.jinx"):  # keys are one per index: a bad line raises
        skipping.keys(lambda s: s.get("id", 0))


def test_a_jinx_dataset_in_ranges_mode_reads_sidecar_values_nested_in_lists_and_keys_in_batches(env, tmp_path):
    import torchforge
    from torchforge.formats.jinx import JinxWriter
    from torchforge.lazy import materialize

    _client, proxy, put = env
    local = tmp_path / "jx-nested"
    rows = [{"id": i, "clips": [[{"img": bytes([i]) * (40 + i)}], [{"img": bytes([i + 1]) * 50}]],
             "top": bytes([i + 2]) * 30, "turns": [{"text": f"t{i}", "wav": bytes([i + 3]) * 25}]} for i in range(80)]
    with JinxWriter(local, shard_size=4000, compression=None, binary_threshold=16) as w:  # every blob in the sidecar
        for r in rows:
            w.write(r)
    _upload_folder(put, str(local), "jx/nested")
    url = f"s3://{BUCKET}/jx/nested"
    want = [materialize(s) for s in torchforge.JinxDataset(str(local))]
    ds = torchforge.open_dataset(url, mode="ranges", cache_dir=tmp_path / "cache", storage_options=_via(proxy))
    assert len(ds.shards) > 2
    got = ds.__getitems__(list(range(79, -1, -1)))
    assert [materialize(s) for s in reversed(got)] == want and want[3]["clips"][0][0]["img"] == bytes([3]) * 43
    eager = torchforge.open_dataset(url, mode="ranges", lazy=False, cache_dir=tmp_path / "cache", storage_options=_via(proxy))
    assert eager.__getitems__(list(range(80))) == want  # lists in lists: their values read too
    proxy.reset()
    fresh = torchforge.open_dataset(url, mode="ranges", cache_dir=tmp_path / "fresh", storage_options=_via(proxy))
    proxy.reset()
    assert fresh.keys("id", cache=False).tolist() == list(range(80))
    assert len(proxy.gets) <= 2 * len(fresh.shards)  # batches of ranges, not a request round per sample


def test_key_caches_of_two_datasets_at_urls_read_by_ranges_never_mix(env, tmp_path):
    import torch

    import torchforge

    _client, proxy, put = env
    urls = []
    for name, base in (("ka", 0), ("kb", 100)):
        _put_columns(put, tmp_path / name, f"st/{name}", 10, ({"y": torch.tensor(float(base + i))} for i in range(30)))
        urls.append(f"s3://{BUCKET}/st/{name}")
    for mode in ("ranges", "shards"):
        keys = [torchforge.open_dataset(u, mode=mode, cache_dir=tmp_path / "cache", storage_options=_via(proxy))
                .keys("y") for u in urls]  # the key cache is keyed by URL and version, not by fetched files
        assert keys[0].tolist() == list(range(30)) and keys[1].tolist() == list(range(100, 130)), mode
        if mode == "ranges":  # read by ranges, nothing downloaded whole
            assert not os.path.exists(tmp_path / "cache" / "remote" / "objects") or not os.listdir(
                tmp_path / "cache" / "remote" / "objects")
    _put_columns(put, tmp_path / "kc", "st/ka", 10, ({"y": torch.tensor(-float(i))} for i in range(30)))
    again = torchforge.open_dataset(urls[0], mode="ranges", cache_dir=tmp_path / "cache", storage_options=_via(proxy))
    assert again.keys("y").tolist() == [-float(i) for i in range(30)]  # overwritten: a new version, new keys


def test_cli_inspect_and_verify_a_jinx_url_and_name_a_damaged_shard(env, tmp_path, capsys):
    from torchforge.cli import main

    _client, proxy, put = env
    local, m = _interop("jinx-b64-zst-binx")
    _upload_folder(put, local, "jx/cli")
    url = f"s3://{BUCKET}/jx/cli"
    so = ["--storage-option", f"endpoint={proxy.url}"]
    assert main(["inspect", url, "--json", "--cache-dir", str(tmp_path / "c1"), *so]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "jinx" and info["samples"] == m["n"] and info["files"] == 2
    assert {s["file"] for s in info["shards"]} == {"shard-00000.jinx", "shard-00000.binx"}
    assert main(["verify", url, "--cache-dir", str(tmp_path / "c2"), *so]) == 0
    assert f"{m['n']} samples decoded, 0 problems" in capsys.readouterr().out
    with open(os.path.join(local, "shard-00000.jinx"), "rb") as f:
        shard = bytearray(f.read())
    shard[1:4] = b"\x00\xff\x00"  # the first sample's line is no longer JSON (JINX keeps no checksums)
    put("jx/cli/shard-00000.jinx", bytes(shard))
    assert main(["verify", url, "--cache-dir", str(tmp_path / "c3"), *so]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED sample 0: {url}/shard-00000.jinx: byte 0:" in out  # the URL and the byte offset


def test_a_batch_under_a_cache_limit_maps_each_shard_once_or_reads_ranges_when_it_outgrows_the_cache(env, tmp_path):
    import torchforge

    _client, proxy, put = env
    rows = _upload_mds(tmp_path, put, "ds/batch", n=60, hashes=())
    url = f"s3://{BUCKET}/ds/batch"
    ds = torchforge.open_dataset(url, cache_dir=tmp_path / "cache", cache_limit=2 * 8192 + 4096,
                                 storage_options=_via(proxy))
    shards = len(ds.metas)
    assert shards >= 4
    batch = [int(i) for i in np.random.default_rng(0).permutation(len(rows))[:24]]
    touched = {ds._locate(i)[0] for i in batch}
    need = sum(ds._stored_bytes(k) for k in touched)
    assert need > ds.cache_limit
    got = ds.__getitems__(batch)  # more shards than the whole cache holds: byte ranges at once, no download
    assert [int(s["id"]) for s in got] == batch and all(bytes(s["blob"]) == rows[s["id"]]["blob"] for s in got)
    assert ds._maps_made == 0 and ds._bypass
    roomy = torchforge.open_dataset(url, cache_dir=tmp_path / "cache2", cache_limit=need + 4096,
                                    storage_options=_via(proxy))
    got = roomy.__getitems__(batch)
    assert [int(s["id"]) for s in got] == batch and all(bytes(s["blob"]) == rows[s["id"]]["blob"] for s in got)
    assert roomy._maps_made == len(touched) and not roomy._bypass  # once per shard, though the batch hops
    order = [int(i) for i in np.random.default_rng(1).integers(0, len(rows), 12 * shards)]
    with pytest.warns(RuntimeWarning, match="mode='ranges'"):  # one sample at a time, at random: maps again and again
        ids = [int(ds[i]["id"]) for i in order]
    assert ids == order


def test_shards_with_hashes_are_served_only_verified_under_a_cache_limit_and_ranges_mode_says_it_cannot(env, tmp_path):
    """index.json records sha1 hashes of whole shards, and a shard on the store is damaged: mode="shards"
    under a cache_limit switched to byte ranges, which cannot check them, and served damaged samples
    silently (as mode="ranges" does: it now warns at open that it serves them unverified)."""
    import torchforge
    from torchforge.remote import RemoteCorruptError

    client, proxy, put = env
    rows = _upload_mds(tmp_path, put, "ds/hashed", n=60)
    url = f"s3://{BUCKET}/ds/hashed"
    shard_url = f"{url}/shard.00001.mds"
    shard = bytearray(client.get_ranges(shard_url, [(0, client.head(shard_url).size)])[0])
    shard[len(shard) - 5] ^= 1  # a byte of the shard's last sample
    put("ds/hashed/shard.00001.mds", bytes(shard))
    ds = torchforge.open_dataset(url, cache_dir=tmp_path / "cache", cache_limit=2 * 8192 + 4096,
                                 storage_options=_via(proxy))
    assert not ds._ranges_ok()
    last_of_1 = max(i for i in range(len(rows)) if ds._locate(i)[0] == 1)
    batch = [last_of_1] + [int(i) for i in np.random.default_rng(0).permutation(len(rows))[:24] if i != last_of_1]
    assert sum(ds._stored_bytes(k) for k in {ds._locate(i)[0] for i in batch}) > ds.cache_limit
    with pytest.raises(RemoteCorruptError, match="shard.00001.mds: sha1"):
        ds.__getitems__(batch)
    assert not ds._bypass
    with pytest.warns(UserWarning, match="sha1 hashes of whole shards.*unverified"):
        torchforge.open_dataset(url, cache_dir=tmp_path / "cache2", mode="ranges", storage_options=_via(proxy))


def _epochs_bytes(ds, proxy, epochs: int = 2, bucket: int | None = None) -> tuple[int, dict]:
    import torch

    from torchforge.sampler import GlobalSampler

    proxy.reset()
    got = {}
    for epoch in range(epochs):
        order = (GlobalSampler(ds, seed=epoch, bucket_size=bucket) if bucket else None)
        loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=order is None, sampler=order, num_workers=2,
                                             collate_fn=list, generator=torch.Generator().manual_seed(epoch))
        for batch in loader:
            for s in batch:
                blob = s["blob"]
                got[int(s["id"])] = blob.numpy().tobytes() if isinstance(blob, torch.Tensor) else bytes(blob)
    return proxy.bytes_sent, got


def _put_scattered(put, tmp_path, fmt: str, rows: list[dict]) -> tuple[str, int]:
    """``rows`` ({"id": int, "blob": bytes}) uploaded as ``fmt`` shards of about 16 samples each (JINX: the
    blobs in the sidecars); returns the URL and the bytes uploaded."""
    import torch

    from torchforge.datasets.safetensors import SafetensorsShardWriter
    from torchforge.formats.jinx import JinxWriter

    local = tmp_path / f"{fmt}-scatter"
    if fmt == "mds":
        data = sum(_put_mds(put, local, f"{fmt}/scatter", rows, 1 << 14))
    else:
        if fmt == "jinx":
            with JinxWriter(local, shard_size=1200, compression=None, binary_threshold=16) as w:
                for r in rows:
                    w.write(r)
        else:
            with SafetensorsShardWriter(local, samples_per_shard=16) as w:
                for r in rows:
                    w.write({"id": torch.tensor(r["id"]), "blob": torch.frombuffer(bytearray(r["blob"]),
                                                                                   dtype=torch.uint8)})
        data = _upload_folder(put, str(local), f"{fmt}/scatter")
    return f"s3://{BUCKET}/{fmt}/scatter", data


def test_the_switch_to_ranges_judges_shuffled_batches_only_and_stays_with_its_dataset_object(env, tmp_path):
    """Under a cache_limit: a sequential pass (a key pass, iteration) downloads every shard with nothing
    served by a batch and must not switch the process to ranges; a switch made by one dataset object is
    not another's (another split, a later run); a sidecar array comes back writable whether its shard was
    mapped or read by ranges. Fails before: the sequential pass switched, and the switch was keyed by the
    parent pid, so it leaked to every dataset of the folder."""
    import numpy as np

    import torchforge
    from torchforge.formats.jinx import JinxWriter

    _client, proxy, put = env
    rows = [{"id": i, "a": np.full(300, i, np.float32)} for i in range(256)]
    local = tmp_path / "jx-switch"
    with JinxWriter(local, shard_size=1200, compression=None, binary_threshold=16) as w:
        for r in rows:
            w.write(r)
    data = _upload_folder(put, str(local), "jx/switch")
    url = f"s3://{BUCKET}/jx/switch"

    def open_it():
        return torchforge.open_dataset(url, cache_dir=tmp_path / "cache", cache_limit=data // 4,
                                       storage_options=_via(proxy))

    ds = open_it()
    shards = len(ds._first) - 1
    assert shards >= 12
    assert [int(s["id"]) for s in ds] == list(range(256))  # every shard downloaded, in order
    assert ds._downloads == 0 and not ds._bypass  # not judged: no batch asked
    order = np.random.default_rng(0).permutation(256).tolist()
    for b in range(0, 256, 8):  # shuffled batches of a cache a quarter of the data: whole shards do not pay
        got = ds.__getitems__(order[b:b + 8])
        assert [int(s["id"]) for s in got] == order[b:b + 8]
    assert ds._bypass and os.path.exists(ds._bypass_marker())
    other = open_it()  # another dataset object of the same folder (another split, another run)
    other._held_here()
    assert not other._bypass
    again = pickle.loads(pickle.dumps(ds))  # the next epoch's workers of the same object
    again._held_here()
    assert again._bypass
    ranged = ds._read([5])[0]["a"]  # (shard 0 is not mapped any more or never was: read by ranges)
    mapped = other._get(5)["a"]
    for a in (ranged, mapped):
        assert a.flags.writeable and np.array_equal(a, rows[5]["a"])


@pytest.mark.parametrize("fmt", ["mds", "jinx", "safetensors"])
def test_an_order_without_locality_under_a_small_cache_reads_ranges_instead_of_refetching_shards(env, tmp_path,
                                                                                                 monkeypatch, fmt):
    import torchforge
    from torchforge.datasets.remote import shards as remote

    _client, proxy, put = env
    rows = [{"id": i, "blob": bytes([i % 251]) * 900} for i in range(256)]
    url, data = _put_scattered(put, tmp_path, fmt, rows)
    want = {r["id"]: r["blob"] for r in rows}

    def run(cache: str, bucket: int | None = None) -> int:
        ds = torchforge.open_dataset(url, cache_dir=tmp_path / cache, cache_limit=data // 4,
                                     storage_options=_via(proxy))
        assert 12 <= len(ds._first) - 1 <= 20  # shards
        sent, got = _epochs_bytes(ds, proxy, bucket=bucket)
        assert got == want
        return sent

    with_ranges = run("c1")  # the workers switch to byte ranges, the second epoch's workers start so
    bucketed = None
    if fmt == "mds":  # (the sampler's part, the same for every format)
        proxy.reset()
        bucketed = run("c3", bucket=16)  # a shard's worth of neighbours at a time: whole shards pay
        gets = len(proxy.gets)
        # Whole shards, not a range per sample. A bucket of 16 neighbours straddles two shards of ~17 samples,
        # so a shard is fetched about twice an epoch (3.8x the data in 2 epochs here, 4.06x once under load,
        # 65 GETs once); a range per sample would be 512 GETs, and the exact order below refetches ~23x.
        assert gets < len(rows) / 3 and bucketed < 6 * data, (gets, bucketed, data)
    assert with_ranges < 4 * data, (with_ranges, data)
    if fmt == "mds":  # the cache's part, the same for every format: whole shards refetch far more here
        monkeypatch.setattr(remote, "BYPASS_SHARE", 0.0)  # forked workers see it: never switch
        whole_shards = run("c2")
        assert with_ranges < whole_shards / 3, (with_ranges, whole_shards)
        assert bucketed < whole_shards / 3, (bucketed, whole_shards)


@pytest.mark.parametrize("mode", ["ranges", "shards"])
def test_an_http_mds_dataset_missing_a_shard_or_lying_about_its_size_names_that_shard(tmp_path, mode):
    """Found by review: a 404 for one shard said "no index.json" (naming index.json, which exists), and a
    shard size index.json inflated to 10**14 reached the cache's reservation as a bare OSError (now a typed
    error for that shard, the others still read)."""
    import shutil

    import torchforge
    from torchforge.errors import CorruptShardError
    from torchforge.formats.mds import MDSWriter

    with MDSWriter(str(tmp_path / "v1"), {"id": "int", "blob": "bytes"}, size_limit=1 << 11) as w:
        for i in range(30):
            w.write({"id": i, "blob": bytes([1]) * (50 + i)})
    served = tmp_path / "served"
    server = _serve(str(served), _RangeHandler)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    opts = {"mode": mode, "cache_dir": tmp_path / "cache", "storage_options": {"allow_http": True}}
    try:
        shutil.copytree(tmp_path / "v1", served)
        last = max(n for n in os.listdir(served) if n != "index.json")
        os.unlink(served / last)
        with pytest.raises(RemoteNotFoundError) as e:
            torchforge.open_dataset(url, **opts)
        assert e.value.url == f"{url}/{last}"
        shutil.rmtree(served)
        shutil.copytree(tmp_path / "v1", served)
        index = json.loads((served / "index.json").read_text())
        index["shards"][1]["raw_data"]["bytes"] = 10**14
        (served / "index.json").write_text(json.dumps(index))
        lying = f"{url}/{index['shards'][1]['raw_data']['basename']}"
        ds = torchforge.open_dataset(url, **opts)
        first = index["shards"][0]["samples"]
        assert bytes(ds[0]["blob"]) == bytes([1]) * 50  # the other shards read
        with pytest.raises((RemoteCorruptError, CorruptShardError)) as e:  # a typed error naming the shard
            ds[first]
        assert lying in str(e.value) and ("10000000000000" in str(e.value) or e.value.offset is not None)
    finally:
        server.shutdown()


def test_an_s3_mds_index_lying_about_a_shard_size_is_a_typed_error_for_that_shard(env, tmp_path):
    import torchforge

    _, _, put = env
    local = tmp_path / "lying"
    _put_mds(put, local, "lying-size", [{"id": i, "blob": bytes([i]) * 300} for i in range(40)], 1 << 12)
    index = json.loads((local / "index.json").read_text())
    index["shards"][0]["raw_data"]["bytes"] = 10**14
    put("lying-size/index.json", json.dumps(index).encode())
    ds = torchforge.open_dataset(f"s3://{BUCKET}/lying-size", mode="shards", cache_dir=tmp_path / "c2")
    with pytest.raises(RemoteCorruptError, match="the index records 100000000000000") as e:
        ds[0]  # before: a bare OSError (File too large) from reserving 10**14 bytes in the cache
    assert e.value.url.endswith("/lying-size/" + index["shards"][0]["raw_data"]["basename"])
    assert bytes(ds[len(ds) - 1]["blob"]) == bytes([len(ds) - 1]) * 300  # the other shards read


def test_range_reads_that_keep_failing_say_why_and_where(env):
    client, proxy, put = env
    data = os.urandom(300_000)
    url = put("why/shard.mds", data)
    etag = client.head(url).etag
    proxy.reset()
    proxy.faults = ["truncate"] * 3
    with pytest.raises(RemoteError, match=r"bytes \[1000, 2000\): .*error") as e:
        client.get_ranges(url, [(1000, 2000)], etag=etag, storage_options={**_via(proxy), "max_retries": 1})
    assert e.value.url == url and e.value.offset == 1000


@pytest.mark.parametrize("workers", [0, 2])
def test_beladys_rule_refetches_less_than_lru_on_the_same_order(env, tmp_path, workers):
    """A shard shuffle (shards in a random order, each read whole before the next) over 24 shards with room
    for 6, three epochs: an epoch's end leaves shards in the cache that the next epoch needs somewhere in its
    order. LRU evicts them first (they are the oldest); Belady's rule keeps them while a shard already
    passed can go (fetches name the whole rest of the order, and the shards just passed, which the other
    workers may still read, last). Counted by the proxy: whole-shard GETs."""
    import torchforge
    from torchforge.sampler import GlobalSampler

    _client, proxy, put = env
    shards, slots = 24, 6
    rows = [{"id": i, "blob": bytes([i % 251]) * 1500} for i in range(shards * 4)]
    shard_bytes = _put_mds(put, tmp_path / "mds-belady", "ds/belady", rows, 5 * 1500 + 200)
    assert len(shard_bytes) == shards
    limit = slots * max(shard_bytes) + 4096
    fetched = {}
    for policy in ("belady", "lru"):
        ds = torchforge.open_dataset(f"s3://{BUCKET}/ds/belady", cache_dir=tmp_path / f"cache-{policy}",
                                     cache_limit=limit, cache_policy=policy, storage_options=_via(proxy))
        sampler = GlobalSampler(ds, seed=3, bucket_size="shards")
        loader = torchforge.DataLoader(ds, batch_size=4, sampler=sampler, num_workers=workers,
                                       collate_fn=_collate_ids)
        proxy.reset()
        for epoch in range(3):
            sampler.set_epoch(epoch)
            assert sorted(i for b in loader for i, _ in b) == list(range(len(rows)))
        fetched[policy] = sum(proxy.gets_of(f"ds/belady/shard.{k:05d}.mds") for k in range(shards))
    # here: Belady 64-66, LRU 70-72, also under load (with the horizon of 8 shards and no shards behind
    # named: Belady 67-68)
    assert fetched["belady"] < fetched["lru"], fetched


@pytest.fixture
def black_hole():
    """An endpoint that takes connections and never answers (a wedged proxy, a firewall that accepts)."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        ls.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(ls.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{ls.getsockname()[1]}", held
    stop.set()
    t.join()
    for c in held:
        c.close()
    ls.close()


def test_an_endpoint_that_never_answers_is_an_error_after_a_few_timeouts_not_the_whole_budget(
        black_hole, tmp_path, aws_env):
    """Each attempt runs into the request timeout: after 3 attempts it is an error saying so (it took 7
    attempts of 120 s); with retry_timeout the job waits out the outage as long as it asked."""
    import torchforge

    url, held = black_hole
    fast = {"endpoint": url, "client_options": {"timeout": "1s"}}
    t = time.monotonic()
    with pytest.raises(RemoteError, match="no reply within the request timeout") as e:
        torchforge.open_dataset(f"s3://{BUCKET}/hole", cache_dir=tmp_path / "c", storage_options=fast)
    assert time.monotonic() - t < 15 and len(held) == 3 and f"s3://{BUCKET}/hole" in str(e.value)
    t = time.monotonic()
    with pytest.raises(RemoteError):
        torchforge.open_dataset(f"s3://{BUCKET}/hole", cache_dir=tmp_path / "c",
                                storage_options={**fast, "retry_timeout": 6})
    assert time.monotonic() - t >= 5 and len(held) > 3 + 3  # it went on for the time it was given


def test_options_that_cannot_work_are_named_at_once(env, tmp_path):
    import torchforge

    _client, proxy, put = env
    _upload_mds(tmp_path, put, "opts", n=8)
    url = f"s3://{BUCKET}/opts"
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        torchforge.open_dataset(url, cache_dir=afile, storage_options=_via(proxy))
    with pytest.raises(ValueError, match="must be a URL starting with http"):
        torchforge.open_dataset(url, cache_dir=tmp_path / "c", storage_options={"endpoint": "127.0.0.1:9"})
    ds = torchforge.open_dataset(url + "/index.json", cache_dir=tmp_path / "c", storage_options=_via(proxy))
    assert len(ds) == 8  # a URL naming the index opens its dataset, as a local path does
    with pytest.raises(RemoteNotFoundError, match="no such bucket") as e:  # not "no dataset here"
        torchforge.open_dataset("s3://no-such-bucket-here/ds", cache_dir=tmp_path / "c", storage_options=_via(proxy))
    assert "s3://no-such-bucket-here/ds" in str(e.value)
