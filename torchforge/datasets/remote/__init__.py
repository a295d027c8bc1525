"""Datasets in object storage: ``open_dataset("s3://bucket/train")`` (MDS, JINX or safetensors shards).

MDS (:class:`RemoteMDSDataset`): ``index.json`` is read when the dataset is opened and pins the version
the run reads: its ETag keys the node-local cache, so a dataset overwritten at the same URL is a new cache
entry, never mixed into the files of the old one; the folder's listing (one LIST request per 1,000
objects) pins every shard's ETag too, so a shard overwritten later raises
:class:`~torchforge.remote.RemoteChangedError` whether or not index.json records its hashes. Where
a server sends no ETag (a plain web server), each object's Last-Modified time (whole seconds) is the pin
instead, checked on every reply; where it sends neither, index.json is read afresh at each open (its bytes
are the version) and opening warns that a shard rewritten at the same size cannot be detected. Each shard is fetched whole into the node-local cache on its first use, through
the node's fetcher process (:mod:`torchforge.remote`: one download per shard per node whatever the
number of ranks and DataLoader workers, in parts fetched concurrently; size and the hashes index.json
records checked before the file enters the cache), then memory-mapped as a local shard. Until a shard
is complete, a batch (with no ``cache_limit``) reads its samples from the download itself: the parts
that hold them are fetched before any other, so a first batch that touches every shard waits for a few
parts, not for the whole dataset (a shard whose index records a hash is served only once verified).
DataLoader workers, forked or spawned, reach the fetcher themselves; no process here ever imports the
object-store client.

``mode="ranges"`` fetches no whole shard: each shard's offset table is read once (one small range), and
a sample's bytes are one range of its shard. A batch (``__getitems__``, which torch's and torchforge's
loaders call with a batch's indices) is read with one request per shard touched, its samples'
ranges merged where the bytes between them cost at most ``RANGE_WASTE`` of what the batch reads (so the
bytes fetched stay within 1.1x of the samples' bytes while neighbours share a GET). This is an exact
global shuffle over a dataset of any size with no cache at all. It needs shards that are not compressed
as a whole (``sample::`` compression is fine).

Prefetching (``mode="shards"``): :meth:`RemoteMDSDataset.prefetch` takes the indices a process will
read, in order, and fetches their shards in the order of first use on a background thread of that
process, each request carrying the shards needed next (what Belady's eviction rule needs: the rest of
the order up to twice what the cache holds, 64 shards at least, and the few shards just passed, which
the loader's other workers may still be reading: named last by a reader, first by the prefetcher, which
runs ahead of the readers).
``torchforge.DataLoader`` calls it at the start of every pass whose sampler can tell its future order
(a :class:`~torchforge.sampler.GlobalSampler`, whose ``indices()`` is pure); with torch's loader, call it
yourself. With a ``cache_limit`` it runs at most half the limit ahead.

A mapped shard is held in use until its map is gone (see ``_RemoteShards._mapped``): no eviction
removes a file a reader maps, so the disk the cache uses is the files it can count. With a
``cache_limit`` each process keeps at most its share of half the limit mapped, and samples are copies,
so a batch does not hold the shards it was drawn from; when the whole shards a process downloads serve
few samples each before the limit evicts them, it reads the samples of uncached shards by byte ranges
instead (``_RemoteShards._limited_batch``; every format).

JINX (:class:`RemoteJinxDataset`) and safetensors column shards (:class:`RemoteSafetensorsDataset`) have
no index of the whole dataset: the folder is listed (probed over ``http(s)://``; a URL naming one ``.jinx``
or ``.safetensors`` object is that shard alone, found with its sidecar by HEAD requests), each shard's
footer or header is read with small range reads, and every object's ETag is pinned; shards (and JINX sidecars) are
then fetched whole on first use like MDS shards. Both read in ``mode="ranges"`` too. A safetensors sample
is one row of each column (a ragged column's rows between two of its offsets, read once per shard), a batch
one coalesced read per shard as for MDS. A JINX shard's index is decoded when the dataset opens (from the
footer, or one range of the sidecar), and a batch is two rounds of coalesced reads per shard: the lines,
then the sidecar values they point at.
"""
from __future__ import annotations

import inspect
import os
from typing import Any

from torchforge.datasets.remote.jinx import RemoteJinxDataset
from torchforge.datasets.remote.mds import RemoteMDSDataset
from torchforge.datasets.remote.safetensors import RemoteSafetensorsDataset
from torchforge.errors import CorruptShardError, FormatError, SafetensorsError
from torchforge.formats.mds import INDEX_BASENAME
from torchforge.remote import RemoteNotFoundError, connect, is_remote

__all__ = ["RemoteJinxDataset", "RemoteMDSDataset", "RemoteSafetensorsDataset", "is_remote"]


def open_remote(url: str, **kwargs: Any) -> Any:
    """The dataset at ``url``: MDS when the folder (or its ``split`` sub-folder) holds index.json, else
    JINX (``shard-*.jinx`` objects, ``split`` selecting by footer as for local JINX), else safetensors
    column shards (``*.safetensors``). A URL naming one ``.jinx`` or ``.safetensors`` object opens that
    shard alone, as a local file does."""
    split = kwargs.get("split")
    if url.rstrip("/").endswith(f"/{INDEX_BASENAME}"):  # the index itself names its dataset, as locally
        url = url.rstrip("/")[: -len(INDEX_BASENAME) - 1]
    if not url.split("://", 1)[1].strip("/"):
        raise ValueError(f"{url!r} names no bucket or host: {url.split('://', 1)[0]}://bucket/path/to/dataset")
    folder = url.rstrip("/") + (f"/{split.strip('/')}" if split else "")
    client = connect(None if kwargs.get("cache_dir") is None else os.path.abspath(os.fspath(kwargs["cache_dir"])))
    try:
        client.head(f"{folder}/{INDEX_BASENAME}", storage_options=kwargs.get("storage_options"))
    except RemoteNotFoundError:
        pass
    else:  # an MDS dataset: what is missing inside it (a shard) is its own error, naming that shard
        return RemoteMDSDataset(url, **kwargs)
    found = False  # any object below the folder
    refused: list[str] = []  # options a class does not take (columns=, for safetensors)
    # a URL naming a .safetensors object tries that format first: the JINX reader would list the folder
    order = (RemoteSafetensorsDataset, RemoteJinxDataset) if folder.endswith(".safetensors") \
        else (RemoteJinxDataset, RemoteSafetensorsDataset)
    for cls in order:
        try:
            inspect.signature(cls).bind(url, **kwargs)
        except TypeError as e:
            refused.append(f"{cls.__name__}: {e}")
            continue
        try:
            return cls(url, **kwargs)
        except RemoteNotFoundError as e:  # nothing listed (or, over http, no shard-00000 of that format)
            if "no such bucket" in str(e):
                raise
            continue
        except (CorruptShardError, SafetensorsError):
            raise
        except FormatError as e:  # objects, none of this format (an error naming one shard is that shard's)
            if e.path not in (url, url.rstrip("/"), folder):
                raise
            found = True
    if refused:  # the format these options were for is not here (or no format takes them): say which did not fit
        raise TypeError(refused[0] if len(refused) < len(order) else
                        f"no dataset class at {url} takes these options ({'; '.join(refused)})")
    if not found:
        raise RemoteNotFoundError("no dataset here: no index.json (MDS) and no shards below the folder",
                                  url=f"{folder}/{INDEX_BASENAME}")
    raise FormatError("not a dataset at this URL: no index.json (MDS), no shard-*.jinx (JINX) and no "
                      "*.safetensors objects", path=url)
