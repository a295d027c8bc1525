"""Helpers shared by the test files, as fixtures.

The fixture generators and checkers that scripts under another Python also use
(``tests/fixtures/interop/expected.py``, ``tests/interop/canon.py``) and the benchmark harness are plain
modules: ``[tool.pytest.ini_options] pythonpath`` in pyproject.toml puts their folders on the path, so a
test file imports them by name (``from expected import rich, same``).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import pytest
from expected import MDS_COLUMNS

from torchforge.formats.jinx import JinxWriter
from torchforge.formats.mds import MDSWriter


def _write_jinx(path: str | os.PathLike, samples: Iterable[Any], **opts: Any) -> JinxWriter:
    with JinxWriter(path, **opts) as w:
        for s in samples:
            w.write(s)
    return w


def _write_mds(folder: str, rows: Iterable[Mapping[str, Any]], columns: Mapping[str, str] = MDS_COLUMNS,
               **opts: Any) -> str:
    with MDSWriter(folder, columns, **opts) as w:
        for r in rows:
            w.write(r)
    return folder


@pytest.fixture(scope="session")
def write_jinx() -> Callable[..., JinxWriter]:
    """``write_jinx(path, samples, **JinxWriter options)``: a JINX dataset; returns the closed writer."""
    return _write_jinx


@pytest.fixture(scope="session")
def write_mds() -> Callable[..., str]:
    """``write_mds(folder, rows, columns=expected.MDS_COLUMNS, **MDSWriter options)``: an MDS dataset;
    returns ``folder``."""
    return _write_mds


@pytest.fixture(scope="session")
def our_shm() -> Callable[[], set[str]]:
    """``our_shm()``: the names of torchforge's shared-memory files in /dev/shm (other programs on the
    machine use /dev/shm concurrently; ours are named torchforge-*)."""
    return lambda: {n for n in os.listdir("/dev/shm") if n.startswith("torchforge")}


@pytest.fixture(autouse=True, scope="session")
def _private_user_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The per-user cache folder (key caches, ...) of the whole run: a fresh one, not ~/.cache."""
    os.environ.setdefault("TORCHFORGE_CACHE_DIR", str(tmp_path_factory.mktemp("user-cache")))


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A real S3-compatible server (moto's server mode) on 127.0.0.1 for the whole run: its endpoint URL.
    Each test module makes its own bucket."""
    moto_server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def aws_env(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The standard AWS variables pointing at the moto server, as a user's shell would set them, and a
    fetcher that exits 3 s after its last client; returns the endpoint."""
    for k, v in {"AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "testing",
                 "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true",
                 "TORCHFORGE_FETCHER_IDLE_EXIT": "3"}.items():
        monkeypatch.setenv(k, v)
    return moto_endpoint
