"""Publishing a finished dataset at a URL: every data file first, the file a reader trusts last.

A reader never sees a half-written dataset: the objects are uploaded in phases (each phase's files at
once, a phase starting only when the one before it is complete), and the last phase holds the file that
makes the dataset whole:

- MDS: the shards, then ``index.json`` (a reader opens the index first and reads only the shards it lists).
- JINX: the ``.binx`` sidecars (and any other file), then the ``shard-*.jinx`` files, then the last shard,
  whose footer ends the chain of shards (``shard_next`` is absent); a shard is never visible before its
  sidecar.
- anything else (safetensors shards): every file but the last (in name order), then the last (torchforge
  marks the last shard with the number of shards, and readers refuse a folder without it).

Each object is written atomically by the store (obstore's ``put``); a failure stops the upload, waits
for the PUTs in flight, removes every object this upload sent (best effort; the last phase's first, as a
PUT whose reply was lost may have stored it, and nothing else if that fails) and raises, so the
destination holds no index, or the whole dataset. An overwrite uploads the new dataset under a hidden
staging prefix first, so that a failed upload leaves the old dataset as it was; then it deletes only the
old dataset's files, in the order of :func:`_deletion_order`, and copies the new ones into place on the
server, phase by phase. All object I/O goes through the node's fetcher (:mod:`torchforge.remote.client`).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import re
import secrets
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torchforge._proc import host_name
from torchforge.remote.client import FetcherClient, _writable, connect
from torchforge.remote.errors import RemoteError, RemoteExistsError, RemoteNotFoundError, RemoteReadOnlyError
from torchforge.remote.url import local_path

__all__ = ["UPLOADS", "check_destination", "publish_phases", "upload"]

log = logging.getLogger(__name__)

UPLOADS = 4  # files uploaded at once (each one multipart above obstore's part size)
COPY_LIMIT = 5 << 30  # the largest object one server-side copy takes (S3's CopyObject); above it, PUT again
_INDEX = "index.json"
#: The files an overwrite replaces (any other object at the destination is kept): MDS indexes and shards
#: (``shard.00000.mds``, ``.mds.zstd``), JINX shards and sidecars, safetensors shards.
_DATA_FILE = re.compile(r"/(index\.json|[^/]*\.mds(\.[a-z0-9]+)?|[^/]*\.jinx|[^/]*\.binx|[^/]*\.safetensors)$")


def publish_phases(folder: str | os.PathLike) -> list[list[str]]:
    """The files of the dataset folder ``folder`` (paths relative to it, ``/``-separated; hidden files
    left out) in the phases they are uploaded in; the last phase is the file that makes the dataset whole.

    >>> publish_phases("out/mds")  # doctest: +SKIP
    [['shard.00000.mds', 'shard.00001.mds'], ['index.json']]
    """
    root = os.fspath(folder)
    files: list[str] = []
    for here, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel = os.path.relpath(here, root)
        for name in names:
            if not name.startswith("."):
                files.append(name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}")
    files.sort()
    if not files:
        return []
    if _INDEX in files:
        return [p for p in ([f for f in files if f != _INDEX], [_INDEX]) if p]
    shards = [f for f in files if f.endswith(".jinx")]
    if shards:
        rest = [f for f in files if not f.endswith(".jinx")]
        return [p for p in (rest, shards[:-1], shards[-1:]) if p]
    return [p for p in (files[:-1], files[-1:]) if p]


def check_destination(url: str, *, overwrite: bool = False, single: bool = False,
                      client: FetcherClient | None = None,
                      storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """The objects already at the destination ``url`` (a folder, or one object with ``single``).

    Raises:
        RemoteReadOnlyError: ``url`` is ``http(s)://``.
        RemoteExistsError: objects are there and ``overwrite`` is False.
    """
    try:
        _writable(url.rstrip("/") + "/_", storage_options)
    except RemoteReadOnlyError as e:  # named by the destination given, not the probe's made-up key
        raise RemoteReadOnlyError(e.reason, url=url) from None
    client = client or connect()
    if single:
        try:
            client.head(url, storage_options=storage_options)
            found = [url]
        except RemoteNotFoundError:
            found = []
    else:
        found = [u for u, _ in client.list_objects(url, storage_options=storage_options)]
    if found and not overwrite:
        what = "an object" if single else f"{len(found)} object(s) ({found[0]}, ...)"
        raise RemoteExistsError(f"the destination already holds {what}; pass overwrite=True (--overwrite) "
                                "to replace it", url=url)
    return found


def _deletion_order(old: list[str], url: str) -> list[list[str]]:
    """The old dataset's objects among ``old`` (objects at ``url``), in the groups an overwrite deletes
    them in, each group only once the one before it is gone: first every file a reader trusts on its own
    (each ``index.json``, and the shard that ends each folder's JINX chain), then the other JINX shards,
    last first, so a reader meets a dataset that is absent or refused as incomplete, never a shorter
    one; then the rest of its files. Objects that are no dataset file (a README, notes, a sub-folder of
    other files) are kept. A single object (``old == [url]``) is one group."""
    if old == [url]:
        return [old]
    mine = [u for u in old if _DATA_FILE.search(u[len(url):])]
    jinx = sorted((u for u in mine if u.endswith(".jinx")), reverse=True)
    ends: dict[str, str] = {}
    for u in jinx:  # each folder's last shard (its chain's end): the first one met, last first
        ends.setdefault(u.rsplit("/", 1)[0], u)
    last = set(ends.values())
    first = [u for u in mine if u.endswith(f"/{_INDEX}")] + sorted(last)
    taken = last | set(first) | set(jinx)  # (sets: a dataset may have 100,000 shards)
    groups = [first, [u for u in jinx if u not in last], [u for u in mine if u not in taken]]
    return [g for g in groups if g]


def upload(local: str | os.PathLike, url: str, *, overwrite: bool = False,
           cache_dir: str | os.PathLike | None = None, storage_options: Mapping[str, Any] | None = None,
           on_file: Callable[[str, int], None] | None = None) -> list[str]:
    """Upload the dataset folder (or single file) ``local`` to ``url`` in :func:`publish_phases` order.

    With ``overwrite``, the new dataset is uploaded beside the old one first, under a hidden staging
    prefix in the destination (``.torchforge-upload-h<host>-p<pid>-<token>/``), where no reader looks:
    a failed or interrupted upload leaves the old dataset as it was. Only once every file is there are
    the old dataset's files deleted (the files a reader trusts before the rest, see
    :func:`_deletion_order`), the new files copied into place on the server in the same phases (no
    bytes through this machine again), and the staging prefix removed; no reader ever mixes old and new
    objects or reads the old dataset short. Other objects at the destination (a README, notes) are
    kept. (A destination at a bucket's root has no room for a staging prefix: its old files are deleted
    before the upload, as the copies would go.)

    Args:
        local: a finished dataset folder, or one file (uploaded to ``url`` itself, replacing it atomically).
        url: the destination folder URL (``s3://bucket/prefix``), or the object URL for a file.
        overwrite: replace the objects already at ``url``; without it such a destination is refused.
        cache_dir: the cache folder naming the node's fetcher (default: the per-user cache folder).
        storage_options: see :mod:`torchforge.remote.url`.
        on_file: called with each uploaded object's (final) URL and size, as it completes.

    Returns:
        the URLs written, in the order they completed.

    Raises:
        RemoteExistsError: the destination holds objects and ``overwrite`` is False.
        RemoteReadOnlyError: ``url`` is ``http(s)://``.
        RemoteError: an upload failed after retries (names the object's URL); the objects this upload
            wrote are removed again, so the destination holds no index (and, overwriting, the old
            dataset is intact, unless the failure came after its files were deleted: then neither is
            there).
    """
    local = os.fspath(local)
    url = url.rstrip("/")
    single = os.path.isfile(local)
    client = connect(cache_dir)
    old = check_destination(url, overwrite=overwrite, single=single, client=client,
                            storage_options=storage_options)
    if single:  # a PUT replaces the object whole: nothing to delete first
        client.put(url, local, storage_options=storage_options)
        if on_file is not None:
            on_file(url, os.path.getsize(local))
        return [url]
    doomed = _deletion_order(old, url)
    phases = publish_phases(local)
    stage = _staging(url) if doomed else None
    clients = [FetcherClient(client.cache_dir) for _ in range(UPLOADS)]

    def put(c: FetcherClient, rel: str) -> None:
        info = c.put(f"{stage or url}/{rel}", os.path.join(local, *rel.split("/")), storage_options=storage_options)
        if on_file is not None:
            on_file(f"{url}/{rel}", info.size)

    def copy(c: FetcherClient, rel: str) -> None:
        path = os.path.join(local, *rel.split("/"))
        if os.path.getsize(path) <= COPY_LIMIT:
            try:
                c.copy(f"{stage}/{rel}", f"{url}/{rel}", storage_options=storage_options)
                return
            except RemoteError as e:  # a copy the store refuses: the local file is still here to send
                log.debug("server-side copy of %s/%s failed (%s): uploading it again", stage, rel, e)
        c.put(f"{url}/{rel}", path, storage_options=storage_options)  # (S3 copies one request up to 5 GiB)

    try:
        if stage is None:
            _delete_groups(client, doomed, storage_options)
            return _publish(clients, client, url, phases, put, storage_options)
        _publish(clients, client, stage, phases, put, storage_options)  # a failure here: the old one is intact
        try:
            _delete_groups(client, doomed, storage_options)
            return _publish(clients, client, url, phases, copy, storage_options)
        finally:
            _remove(client, [f"{stage}/{rel}" for phase in phases for rel in phase], storage_options,
                    f"the staging prefix {stage}")
            if stage.lower().startswith("file://"):  # a local store keeps the emptied folders
                for here, _, _ in os.walk(local_path(stage), topdown=False):
                    with contextlib.suppress(OSError):
                        os.rmdir(here)
    finally:
        for c in clients:
            c.close()


def _staging(url: str) -> str | None:
    """A fresh hidden prefix inside the destination folder ``url`` for an upload beside the old dataset
    (None at a bucket's root, whose objects have no common folder)."""
    if not url.split("://", 1)[1].partition("/")[2].strip("/"):
        return None
    return f"{url}/.torchforge-upload-h{host_name()}-p{os.getpid()}-{secrets.token_hex(4)}"


def _delete_groups(client: FetcherClient, groups: list[list[str]],
                   storage_options: Mapping[str, Any] | None) -> None:
    for group in groups:  # a failure stops here: what is left still reads whole, or not at all
        client.delete(group, storage_options=storage_options)


def _remove(client: FetcherClient, urls: list[str], storage_options: Mapping[str, Any] | None, what: str) -> bool:
    """Delete ``urls``, best effort (a warning names ``what`` when it fails); whether it worked."""
    try:
        if urls:
            client.delete(urls, storage_options=storage_options)
        return True
    except Exception as e:  # noqa: BLE001 - the caller's own outcome (an error, or success) is the one to report
        log.warning("could not remove %d objects of %s (%s)", len(urls), what, e)
        return False


def _publish(clients: list[FetcherClient], client: FetcherClient, url: str, phases: list[list[str]],
             send: Callable[[FetcherClient, str], None], storage_options: Mapping[str, Any] | None) -> list[str]:
    """Write every phase's files under ``url`` with ``send(client, rel)``, a phase only once the one before
    it is complete. A failure removes every object this wrote and raises: the file that makes the dataset
    whole first (a request whose reply was lost may have stored it), then the others; if that removal
    fails, the rest stays (without its data files, that file would open as a dataset that is short or
    cannot be read). Returns the URLs written, in the order they completed."""
    done: list[str] = []
    started: list[str] = []  # every object a request was sent for: a failed one may still have been stored
    last = {f"{url}/{rel}" for rel in phases[-1]} if phases else set()
    try:
        for phase in phases:
            _upload_phase(clients, url, phase, done, started, send)
    except BaseException:
        for group in ([u for u in started if u in last], [u for u in started if u not in last]):
            if not _remove(client, group, storage_options, f"the failed upload to {url}; the others are left in place too"):
                break
        raise
    return done


def _upload_phase(clients: list[FetcherClient], url: str, phase: list[str], done: list[str], started: list[str],
                  send: Callable[[FetcherClient, str], None]) -> None:
    """Upload ``phase``'s files at once (one connection each, ``len(clients)`` at a time); the first
    failure stops the files not yet started and is raised once the others have ended. Whatever ends it
    (a KeyboardInterrupt too), it returns or raises only after every PUT it sent has been answered: the
    fetcher process finishes a PUT it was handed, and a cleanup that ran before would miss that object.
    That wait counts the PUTs in flight itself: a Ctrl-C that lands while the pool starts a thread leaves
    that thread unknown to the pool's shutdown, yet it may already be sending a file."""
    todo = iter(phase)
    cond = threading.Condition()
    failed = threading.Event()
    flying = 0  # PUTs sent and not answered yet (a file is taken and counted under ``cond``)

    def work(client: FetcherClient) -> None:
        nonlocal flying
        while True:
            with cond:
                rel = None if failed.is_set() else next(todo, None)
                if rel is None:
                    return
                dst = f"{url}/{rel}"
                started.append(dst)
                flying += 1
            try:
                send(client, rel)
            except BaseException:
                failed.set()
                raise
            finally:
                with cond:
                    flying -= 1
                    cond.notify_all()
            with cond:
                done.append(dst)

    n = min(len(clients), len(phase))
    pool = ThreadPoolExecutor(n, thread_name_prefix="torchforge-upload")
    try:
        futures = [pool.submit(work, c) for c in clients[:n]]
        concurrent.futures.wait(futures)
    finally:
        with cond:
            failed.set()  # (after an interrupt: start nothing more)
            cond.wait_for(lambda: flying == 0)  # every PUT sent is answered before anyone cleans up
        pool.shutdown(wait=True)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]
