"""MDS datasets in object storage, ``mode="shards"``: ``open_dataset("s3://bucket/train")``.

``index.json`` is read when the dataset is opened and pins the version the run reads: its ETag keys the
node-local cache, so a dataset overwritten at the same URL is a new cache entry, never mixed into the
files of the old one. Each shard is fetched whole into the node-local cache on its first use, through
the node's fetcher process (:mod:`torchforge.remote`: one download per shard per node whatever the
number of ranks and DataLoader workers, size and the hashes index.json records checked before the file
is used, nothing partial ever read), then memory-mapped as a local shard. DataLoader workers, forked
or spawned, reach the fetcher themselves; no process here ever imports the object-store client.

Not yet here (issue 13): ``mode="ranges"``, JINX and safetensors datasets at a URL, prefetching in the
sampler's order, and eviction protection for shards that are mapped (an evicted shard stays readable to
the processes that have it mapped, Linux keeps the unlinked file until they unmap it).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from torchforge.datasets.mds import MDSDataset
from torchforge.formats.mds import INDEX_BASENAME
from torchforge.formats.mds_reader import ShardMeta
from torchforge.remote import connect, is_remote
from torchforge.sizes import parse_size

__all__ = ["RemoteMDSDataset", "is_remote"]

MODES = ("shards",)


class RemoteMDSDataset(MDSDataset):
    """An MDS dataset at a URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``file://``).

    Args:
        url: the dataset's folder URL (the one holding index.json).
        split: a sub-folder.
        cache_dir: the node-local cache (default: the per-user cache folder, never the data folder).
        cache_limit: the most bytes the cache may hold (bytes or ``"50GB"``); None for no limit.
        mode: ``"shards"`` (whole shards fetched on first use).
        storage_options: endpoint, region, credentials, anonymous, allow_http; the standard environment
            variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ... ``AWS_ALLOW_HTTP``) apply too.
        **kwargs: :class:`~torchforge.datasets.mds.MDSDataset`'s options (columns, lazy, zero_copy, ...).

    Raises:
        RemoteNotFoundError: no index.json at the URL (names it).
        RemoteError: the store refused or failed (names the URL).
    """

    def __init__(self, url: str, split: str | None = None, *, cache_dir: str | os.PathLike | None = None,
                 cache_limit: int | str | None = None, mode: str = "shards",
                 storage_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {list(MODES)} for an MDS dataset at a URL yet")
        self.url = url.rstrip("/") + (f"/{split.strip('/')}" if split else "")
        self.mode = mode
        self.storage_options = dict(storage_options or {})
        self.cache_limit = None if cache_limit is None else parse_size(cache_limit, option="cache_limit")
        self._remote_cache = None if cache_dir is None else os.path.abspath(os.fspath(cache_dir))
        self._client_of: tuple[int, Any] | None = None
        client = self._client()
        index_url = f"{self.url}/{INDEX_BASENAME}"
        info = client.head(index_url, storage_options=self.storage_options)
        self.version = info.etag  # the pinned version of the dataset
        index = client.fetch(index_url, info.size, etag=info.etag, storage_options=self.storage_options)
        key = hashlib.sha256(f"{index_url}\0{info.etag}\0{info.size}".encode()).hexdigest()[:32]
        folder = os.path.join(client.cache_dir, "datasets", key)
        _place(index, os.path.join(folder, INDEX_BASENAME))
        super().__init__(folder, **kwargs)

    def _client(self) -> Any:
        """This process's connection to the node's fetcher (a forked worker opens its own)."""
        if self._client_of is None or self._client_of[0] != os.getpid():
            self._client_of = (os.getpid(), connect(self._remote_cache))
        return self._client_of[1]

    def _check_file(self, m: ShardMeta) -> str:
        return ""  # fetched on first use (see _shard)

    def _shard(self, k: int) -> Any:
        if not self._files[k]:
            m = self.metas[k]
            zipped = m.zip_basename is not None
            name = m.zip_basename if zipped else m.raw_basename
            size = (m.zip_bytes or 0) if zipped else m.raw_bytes
            entry = m.raw.get("zip_data" if zipped else "raw_data") or {}
            hashes = entry.get("hashes") if isinstance(entry, dict) else None
            self._files[k] = self._client().fetch(
                f"{self.url}/{name}", size, hashes=hashes if isinstance(hashes, dict) else None,
                cache_limit=self.cache_limit, storage_options=self.storage_options,
                next_use=[f"{self.url}/{n.zip_basename or n.raw_basename}" for n in self.metas[k + 1:k + 9]])
        return super()._shard(k)

    def shard_files(self) -> list[str]:
        return [os.path.join(self.folder, INDEX_BASENAME)] + [f for f in self._files if f]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_client_of"] = None  # a connection does not travel: the other process opens its own
        return state


def _place(src: str, dst: str) -> None:
    """Copy the fetched index.json to ``dst`` atomically (once: the folder is keyed by its version)."""
    if os.path.exists(dst):
        return
    folder = os.path.dirname(dst)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".index-")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
