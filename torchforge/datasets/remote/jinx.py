"""A JINX dataset at a URL: :class:`RemoteJinxDataset` (see :mod:`torchforge.datasets.remote`)."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from torchforge._limits import ensure_open_files
from torchforge.datasets.jinx import JinxDataset
from torchforge.datasets.remote.shards import _RemoteShards
from torchforge.errors import CorruptShardError, FormatError
from torchforge.formats.jinx_reader import JinxShard


class RemoteJinxDataset(_RemoteShards, JinxDataset):
    """A JINX dataset at a URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``file://``): the folder's
    ``shard-NNNNN.jinx`` objects and their ``.binx`` sidecars, ``mode="shards"``.

    Opening lists the folder (``http(s)://``, which cannot list, is probed for ``shard-00000.jinx``,
    ``shard-00001.jinx``, ... instead) and reads each shard's footer with one or two small range reads
    (its sample count and split), so nothing is downloaded whole until a sample needs it. Every object's
    ETag is pinned then: a shard overwritten at the same URL afterwards raises
    :class:`~torchforge.remote.RemoteChangedError` naming it, never mixed into an epoch. A shard and its
    sidecar are fetched whole into the node's cache on first use (one download per node), held in use
    while mapped, and read as local shards; prefetching, ``cache_limit`` and ``cache_policy`` work as for
    :class:`RemoteMDSDataset`.

    Args:
        url: the folder's URL.
        lazy, split, on_error: as :class:`~torchforge.datasets.jinx.JinxDataset`.
        cache_dir, cache_limit, cache_policy, storage_options: as :class:`RemoteMDSDataset`.
        mode: ``"shards"`` only for JINX (``"ranges"`` raises ValueError: a JINX sample's line and its
            sidecar values are two dependent reads; use MDS for ranges).

    Raises:
        RemoteNotFoundError: nothing at the URL.
        FormatError: no ``shard-*.jinx`` objects there.
        CorruptShardError: a shard's footer is not a JINX footer (names the URL and byte offset).
    """

    def __init__(self, url: str, lazy: bool = True, split: str | None = None, on_error: str = "raise", *,
                 cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None,
                 mode: str = "shards", cache_policy: str = "belady",
                 storage_options: Mapping[str, Any] | None = None) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error={on_error!r} is not one of ['raise', 'skip']")
        self._remote_setup(url, None, cache_dir, cache_limit, mode, cache_policy, storage_options)
        self._shards = None
        self.lazy = lazy
        self.split = split
        self.on_error = on_error
        self.skipped = 0
        self._room = False
        client = self._client()
        listed = self._listing(client, (".jinx", ".binx"))
        names = sorted(n for n in listed if n.startswith("shard-") and n.endswith(".jinx"))
        if not names:
            raise FormatError("folder holds no shard-*.jinx objects", path=self.url)
        if mode == "ranges":
            raise ValueError(f"{self.url}: mode='ranges' reads MDS and safetensors datasets; a JINX dataset at a "
                             "URL is read with mode='shards'")
        kept = []
        for name in names:
            u, size, etag = listed[name]
            count, shard_split = _jinx_footer(client, u, size, etag, self.storage_options)
            if split is not None and shard_split != split:
                continue
            objs: list[tuple[str, int, str | None, dict[str, str] | None]] = [(u, size, etag, None)]
            side = listed.get(name[:-len(".jinx")] + ".binx")
            if side is not None:
                objs.append((side[0], side[1], side[2], None))
            kept.append((objs, count, shard_split))
        self.shard_splits = [shard_split for _, _, shard_split in kept]  # from the footers
        self._remote_objs = [objs for objs, _, _ in kept]
        self._counts = [count for _, count, _ in kept]
        self._all_paths = [listed[n][0] for n in names]
        self._paths = [objs[0][0] for objs in self._remote_objs]
        self._starts, self._ends, total = [], [], 0
        for c in self._counts:
            self._starts.append(total)
            total += c
            self._ends.append(total)
        self._n = total
        self._first = [*self._starts, total]
        self._jshards: list[JinxShard | None] = [None] * len(self._remote_objs)
        pinned = json.dumps(sorted((u, n, e) for u, n, e in listed.values()))
        self.version = hashlib.sha256(pinned.encode()).hexdigest()[:32]  # every object's ETag and size
        self._folder = os.path.join(client.cache_dir, "datasets", self.version)
        os.makedirs(self._folder, exist_ok=True)

    # --- _RemoteShards ------------------------------------------------------------------------------
    def _objects(self, k: int) -> list[tuple[str, int, str | None, dict[str, str] | None]]:
        return self._remote_objs[k]

    def _map(self, k: int, paths: list[str]) -> tuple[Any, list[Any]]:
        objs = self._remote_objs[k]
        shard = JinxShard(paths[0], bin_path=paths[1] if len(paths) > 1 else paths[0] + ".no-sidecar")
        if len(paths) > 1:
            shard._open_sidecar(0)  # mapped now, so that its map is held with the shard's
        if shard.num_samples != self._counts[k] or not self._wanted(shard):
            raise FormatError(f"the shard holds {shard.num_samples} samples, its footer said {self._counts[k]} "
                              "when the dataset was opened", path=objs[0][0])
        shard.path = objs[0][0]  # errors from now on name the URL
        shard.bin_path = objs[1][0] if len(objs) > 1 else os.path.splitext(objs[0][0])[0] + ".binx"
        self._jshards[k] = shard
        return shard, [shard._mm, shard._bin_mm]

    def _drop(self, k: int | None) -> None:
        if k is None:
            self._jshards = [None] * len(self._remote_objs)
            self._set_shards(None)
            self._room = False
        else:
            self._jshards[k] = None

    # --- JinxDataset --------------------------------------------------------------------------------
    def _shard(self, k: int) -> JinxShard:
        held = self._held_here()
        shard = self._jshards[k]
        if shard is not None:
            held.move_to_end(k)
            return shard
        if not self._room:  # a map per shard and sidecar, and a hold for each
            ensure_open_files(4 * len(self._remote_objs), "RemoteJinxDataset")
            self._room = True
        return self._mapped(k)

    def _open(self) -> Any:
        shards = _LazyShards(self)
        self._set_shards(shards)
        return shards

    def shard_files(self) -> list[str]:
        return [p for k in sorted(self._fetched) for p in self._fetched[k]]

    @property
    def root(self) -> str:
        """The dataset's folder in the node's cache (key caches go there)."""
        return self._folder

    def __getstate__(self) -> dict[str, Any]:
        state = self._remote_state(super().__getstate__())
        state["_jshards"] = [None] * len(self._remote_objs)
        return state


class _LazyShards(Sequence):
    """A remote JINX dataset's shards, each fetched and mapped on first access."""

    def __init__(self, ds: RemoteJinxDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds._remote_objs)

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        return self.ds._jshards[k] or self.ds._shard(k)


def _jinx_footer(client: Any, url: str, size: int, etag: str | None,
                 storage_options: Mapping[str, Any]) -> tuple[int, str | None]:
    """A remote JINX shard's sample count and split, from its footer: one range read of the file's tail
    (a second one when the footer is longer than the tail)."""
    tail = min(size, 8 << 10)
    (data,) = client.get_ranges(url, [(size - tail, size)], etag=etag, storage_options=storage_options)
    base = size - tail
    if len(data) < 2 or data[-1:] != b"\n":
        raise CorruptShardError("the file does not end with the footer-offset line (truncated or not a JINX "
                                "shard)", path=url, offset=size)
    nl = data.rfind(b"\n", 0, len(data) - 1)
    digits = data[nl + 1:-1]
    if nl < 0 or not digits.isdigit():
        raise CorruptShardError(f"last line {digits[-24:]!r} is not the footer's byte offset (truncated or not "
                                "a JINX shard)", path=url, offset=base + max(nl + 1, 0))
    foot = int(digits)
    if foot >= base + nl:
        raise CorruptShardError(f"footer offset {foot} is not before the last line", path=url, offset=base + nl + 1)
    if foot >= base:
        raw = data[foot - base:nl]
    else:
        (raw,) = client.get_ranges(url, [(foot, base + nl)], etag=etag, storage_options=storage_options)
    try:
        footer = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise CorruptShardError(f"footer is not valid JSON ({e})", path=url, offset=foot) from None
    n = footer.get("num_samples") if isinstance(footer, dict) else None
    if type(n) is not int or n < 0:
        raise CorruptShardError(f"footer num_samples={n!r} is not a non-negative integer", path=url, offset=foot)
    split = footer.get("split")
    return n, split if isinstance(split, str) else None
