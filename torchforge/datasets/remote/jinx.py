"""A JINX dataset at a URL: :class:`RemoteJinxDataset` (see :mod:`torchforge.datasets.remote`)."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import orjson

from torchforge.datasets.jinx import JinxDataset, check_chain, next_name
from torchforge.datasets.remote.shards import _RemoteShards, _Spans, as_urls, content_version, read_twice
from torchforge.errors import CorruptShardError, FormatError, TorchforgeError
from torchforge.formats.jinx_reader import LINE_PARSER, JinxShard
from torchforge.lazy import lazy_sample


class RemoteJinxDataset(_RemoteShards, JinxDataset):
    """A JINX dataset at a URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``file://``): the folder's
    ``shard-NNNNN.jinx`` objects and their ``.binx`` sidecars, ``mode="shards"``.

    Opening lists the folder (``http(s)://``, which cannot list, is probed for ``shard-00000.jinx``,
    ``shard-00001.jinx``, ... instead) and reads each shard's footer with one or two small range reads
    (its sample count and split), so nothing is downloaded whole until a sample needs it. Every object's
    ETag is pinned then: a shard overwritten at the same URL afterwards raises
    :class:`~torchforge.remote.RemoteChangedError` naming it, never mixed into an epoch. In
    ``mode="shards"`` a shard and its sidecar are fetched whole into the node's cache on first use (one
    download per node), held in use while mapped, and read as local shards; prefetching, ``cache_limit``
    and ``cache_policy`` work as for :class:`RemoteMDSDataset`. With no ``cache_limit`` a batch does not
    wait for them whole: its samples' lines and sidecar values are read from the downloads as their parts
    arrive (the parts it needs first), as MDS samples are. With a ``cache_limit`` samples are eager and
    their values copies by default, so a batch drawn from many shards does not keep them all mapped (as
    MDS samples' ``zero_copy=False``).

    In ``mode="ranges"`` nothing is fetched whole: opening also decodes each shard's index (from the footer
    already read, or one range of the sidecar when the index lives there), and a batch is two rounds of
    coalesced range reads, one request per shard touched in each: the samples' lines, then the sidecar
    values those lines point at (every ``.bin`` reference in them; a lazy sample decodes from these bytes,
    whichever fields it is asked for).

    Args:
        url: the folder's URL, or one ``.jinx`` object's: that shard alone (its ``.binx`` beside it), as a
            local ``.jinx`` file opens, whether or not its footer names a next shard.
        lazy: as :class:`~torchforge.datasets.jinx.JinxDataset`; None (the default): lazy with no
            ``cache_limit``, eager with one.
        split, on_error: as :class:`~torchforge.datasets.jinx.JinxDataset`.
        cache_dir, cache_limit, cache_policy, storage_options: as :class:`RemoteMDSDataset`.
        mode: ``"shards"`` or ``"ranges"``.

    Raises:
        RemoteNotFoundError: nothing at the URL.
        FormatError: no ``shard-*.jinx`` objects there.
        CorruptShardError: a shard's footer is not a JINX footer (names the URL and byte offset).
    """

    def __init__(self, url: str, lazy: bool | None = None, split: str | None = None, on_error: str = "raise", *,
                 cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None,
                 mode: str = "shards", cache_policy: str = "belady",
                 storage_options: Mapping[str, Any] | None = None) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error={on_error!r} is not one of ['raise', 'skip']")
        self._remote_setup(url, None, cache_dir, cache_limit, mode, cache_policy, storage_options)
        self._shards = None
        self.lazy = self.cache_limit is None if lazy is None else lazy
        self.split = split
        self.on_error = on_error
        self.skipped = 0
        self._room = False
        client = self._client()
        one = self._one_object(client, (".jinx", ".binx"))  # a URL naming one .jinx object: that shard alone
        listed = self._listing(client, (".jinx", ".binx")) if one is None else one
        names = sorted(n for n in listed if n.startswith("shard-") and n.endswith(".jinx")) if one is None \
            else list(one)[:1]
        if not names:
            raise FormatError("folder holds no shard-*.jinx objects", path=self.url)
        kept = []
        self._ranged: list[_RangeShard | None] = []  # each kept shard's footer and index, checked; no map
        self._footers: list[tuple[dict, int]] = []  # each kept shard's footer and where it starts
        nexts: dict[str, str] = {}  # shard -> the base name of the next shard its footer names

        def opened(client: Any, name: str) -> tuple[dict, int, list[Any], str | None, _RangeShard | None]:
            """A shard's footer and, if the split wants it, its index (checked against num_samples now, in
            either mode: a footer lying about the count would size the dataset). Shards open ``READERS`` at
            a time: a footer and an index are a round trip each."""
            u, size, etag = listed[name]
            footer, foot = read_twice(lambda: _jinx_footer(client, u, size, etag, self.storage_options))
            shard_split = footer.get("split") if isinstance(footer.get("split"), str) else None
            objs: list[tuple[str, int, str | None, dict[str, str] | None]] = [(u, size, etag, None)]
            side = listed.get(name[:-len(".jinx")] + ".binx")
            if side is not None:
                objs.append((side[0], side[1], side[2], None))
            if split is not None and shard_split != split:
                return footer, foot, objs, shard_split, None
            return footer, foot, objs, shard_split, self._ranges_of(objs, footer, foot, client)  # (takes the index)

        for name, (footer, foot, objs, shard_split, ranged) in zip(names, self._spread(opened, names, wide=True)):
            if (nxt := next_name(footer)) is not None:
                nexts[name] = nxt
            if ranged is None:  # another split's shard
                continue
            kept.append((objs, footer["num_samples"], shard_split))
            self._footers.append((footer, foot))
            self._ranged.append(ranged)
        if one is None:  # (a shard opened on its own may name a next one, as a local .jinx file may)
            check_chain(self.url, names, nexts)
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
        #: the version without the URLs (a loader state's check: a byte-identical copy elsewhere is the same)
        self.content_version = content_version(listed)
        self._folder = self._node_folder()
        self._warn_unversioned()

    # --- _RemoteShards ------------------------------------------------------------------------------
    def _objects(self, k: int) -> list[tuple[str, int, str | None, dict[str, str] | None]]:
        return self._remote_objs[k]

    def _map(self, k: int, paths: list[str]) -> tuple[Any, list[Any]]:
        objs = self._remote_objs[k]
        side = objs[1][0] if len(objs) > 1 else os.path.splitext(objs[0][0])[0] + ".binx"
        missing = paths[0] + ".no-sidecar"
        with as_urls({paths[0]: objs[0][0], (paths[1] if len(paths) > 1 else missing): side}):
            shard = JinxShard(paths[0], bin_path=paths[1] if len(paths) > 1 else missing)
            if len(paths) > 1:
                shard._open_sidecar(0)  # mapped now, so that its map is held with the shard's
        if shard.num_samples != self._counts[k] or not self._wanted(shard):
            raise FormatError(f"the shard holds {shard.num_samples} samples, its footer said {self._counts[k]} "
                              "when the dataset was opened", path=objs[0][0])
        shard.zero_copy = self.cache_limit is None  # with a limit, a sample does not keep its shard mapped
        shard.path = objs[0][0]  # errors from now on name the URL
        shard.bin_path = side
        self._jshards[k] = shard
        return shard, [shard._mm, shard._bin_mm]

    def _drop(self, k: int | None) -> None:
        if k is None:
            self._jshards = [None] * len(self._remote_objs)
            self._set_shards(None)
            self._room = False
        else:
            self._jshards[k] = None

    # --- mode="ranges" ------------------------------------------------------------------------------
    def _range_shard(self, k: int) -> _RangeShard:
        """Shard ``k``'s index for reads by byte ranges (made from its footer on first need in
        ``mode="shards"``: one more range of the sidecar when the index lives there)."""
        r = self._ranged[k]
        if r is None:
            footer, foot = self._footers[k]
            r = self._ranged[k] = self._ranges_of(self._remote_objs[k], footer, foot, self._client())
        return r

    def _ranges_of(self, objs: list[Any], footer: dict, foot: int, client: Any) -> _RangeShard:
        r = _RangeShard(objs, footer, foot, client, self.storage_options)
        r.zero_copy = self.cache_limit is None  # as a mapped shard's: sidecar arrays are copies under a limit
        return r

    def _read(self, indices: list[int], skip: bool = False, early: bool = False) -> list[Any]:
        """The samples at ``indices`` (valid, in order) by byte ranges: the lines, one coalesced read per
        shard, then the sidecar values they point at, one more per shard; with ``early`` both from the
        shards' downloads into the node's cache (:meth:`_early_batch`). With ``skip`` (iteration under
        ``on_error="skip"``) a bad sample is counted, logged and left out instead of raised."""
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for pos, i in enumerate(indices):
            k = self._shard_index(i)
            by_shard.setdefault(k, []).append((pos, i - self._starts[k]))

        for k in by_shard:
            self._range_shard(k)

        def line_spans(_client: Any, k: int) -> list[tuple[int, int]]:
            offs = self._ranged[k]._offs
            return [(offs[j], offs[j + 1]) for _, j in by_shard[k]]

        lines = self._read_spans(list(by_shard), line_spans, early)
        parsed: dict[int, list[tuple[int, Any, int]]] = {}  # shard -> (position, line or its error, offset)
        refs: dict[int, list[tuple[int, int]]] = {}  # shard -> the sidecar spans its lines point at
        for k, rows in by_shard.items():
            view = self._ranged[k].view(lines[k], None)
            tail = view.ext_sep + "bin"
            got = parsed[k] = []
            for pos, j in rows:
                try:
                    obj, start = view.line(j)
                    try:
                        _sidecar_refs(obj, view.ext_sep, tail, view._bin_total, refs.setdefault(k, []))
                    except RecursionError:
                        raise view._fail(f"sample {j} nests too deeply to read its sidecar values", start) from None
                except TorchforgeError as e:
                    if not skip:
                        raise
                    got.append((pos, e, 0))
                    continue
                got.append((pos, obj, start))
        wanted = [k for k, spans in refs.items() if spans]
        sides = self._read_spans(wanted, lambda _client, k: refs[k], early, obj=1) if wanted else {}
        out: list[Any] = [None] * len(indices)
        bad: set[int] = set()
        for k, got in parsed.items():
            view = self._ranged[k].view(lines[k], sides.get(k))
            for pos, obj, start in got:
                try:
                    if isinstance(obj, TorchforgeError):
                        raise obj
                    out[pos] = lazy_sample(obj, view, start) if self._lazy else view.eager(obj, start)
                except TorchforgeError as e:
                    if not skip:
                        raise
                    self._skip(e)
                    bad.add(pos)
        return [s for pos, s in enumerate(out) if pos not in bad] if bad else out

    def __getitem__(self, i: int) -> Any:
        if self.mode == "ranges":
            return self._read(self._checked([i]))[0]
        return super().__getitem__(i)

    def _get(self, i: int) -> Any:
        if self.mode == "ranges":
            return self._read([i])[0]
        return super()._get(i)

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """A batch of samples (torch's DataLoader calls this with a batch's indices): in ``mode="ranges"``
        two rounds of coalesced range reads, one request per shard touched in each."""
        idx = self._checked(indices)
        if self.mode == "ranges":
            return self._read(idx)
        if self.cache_limit is None:
            return self._early_batch(idx)
        return self._limited_batch(idx)

    def _at_hand(self, k: int) -> bool:
        return self._jshards[k] is not None or super()._at_hand(k)

    def __iter__(self) -> Iterator[Any]:
        if self.mode != "ranges":
            yield from super().__iter__()
            return
        step = 256
        for first in range(0, len(self), step):
            yield from self._read(list(range(first, min(first + step, len(self)))), skip=self.on_error == "skip")

    # --- JinxDataset --------------------------------------------------------------------------------
    @property
    def shards(self) -> Any:
        """The shards: in ``mode="ranges"`` each one's footer and index only (reading a sample from one
        raises ValueError: read samples from the dataset)."""
        return self._ranged if self.mode == "ranges" else super().shards

    def _shard(self, k: int) -> JinxShard:
        return self._held_shard(k, lambda: self._jshards[k], 4)  # a map per shard and sidecar, a hold for each

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
                 storage_options: Mapping[str, Any]) -> tuple[dict, int]:
    """A remote JINX shard's footer (its ``num_samples`` checked) and the byte offset where it starts: one
    range read of the file's tail (a second one when the footer is longer than the tail)."""
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
    if base + nl - foot > MAX_FOOTER:  # a lying offset must not fetch (and hold) the whole shard
        raise CorruptShardError(f"footer offset {foot} makes a footer of {base + nl - foot} bytes, more than "
                                f"{MAX_FOOTER}: the offset is wrong", path=url, offset=base + max(nl + 1, 0))
    start = foot - 1 if foot else 0  # with the byte before the footer, which must end a line
    if start >= base:
        raw = data[start - base:nl]
    else:
        (raw,) = client.get_ranges(url, [(start, base + nl)], etag=etag, storage_options=storage_options)
    if foot:  # the footer begins a line, as the local reader checks
        if raw[:1] != b"\n":
            raise CorruptShardError(f"footer offset {foot} does not start a line", path=url, offset=foot)
        raw = raw[1:]
    try:
        footer = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise CorruptShardError(f"footer is not valid JSON ({e})", path=url, offset=foot) from None
    n = footer.get("num_samples") if isinstance(footer, dict) else None
    if type(n) is not int or n < 0:
        raise CorruptShardError(f"footer num_samples={n!r} is not a non-negative integer", path=url, offset=foot)
    return footer, foot


#: The longest footer a remote shard's last line may point at (an inline index of about 6M samples): a lying
#: offset fails here instead of fetching the whole shard into memory.
MAX_FOOTER = 64 << 20


class _RangeShard(JinxShard):
    """A JINX shard at a URL read by byte ranges (``mode="ranges"``): its footer and index, checked as a
    local shard's are, and no map. :meth:`view` gives the shard a batch reads from: its lines and sidecar
    values are the bytes fetched for that batch (a lazy sample keeps its view, and so those bytes)."""

    def __init__(self, objs: list[tuple[str, int, str | None, dict[str, str] | None]], footer: dict, foot: int,
                 client: Any, storage_options: Mapping[str, Any]) -> None:
        url, size, _, _ = objs[0]
        side = objs[1] if len(objs) > 1 else None
        self.path = url
        self.bin_path = side[0] if side else os.path.splitext(url)[0] + ".binx"
        self._bin_total = side[1] if side else -1  # the sidecar's size; -1: there is none
        self.plans, self._decoders = {}, {}
        self._mm = self._bin_mm = self._mv = self._bin_mv = self._bin_bv = None
        self._bin_size = -1  # a raw sidecar value takes the checked path, sidecar() below
        self.parse, self.lines = LINE_PARSER[0], None  # the local shards' parser (msgspec's when installed)
        self._side: _Spans | None = None
        sep = footer.get("ext_sep", ".")
        key = next((k for k in footer if isinstance(sep, str) and sep and k.startswith("index" + sep)), "")
        loc = footer.get(key)
        if key.endswith(f"{sep}bin") and isinstance(loc, dict) and side is not None:  # the index is in the sidecar
            o, n = loc.get("offset"), loc.get("length")
            count = footer.get("num_samples")
            most = 16 * (count + 1) + 4096 if type(count) is int and count >= 0 else 0  # (8 bytes an offset)
            if type(n) is int and n > most:  # a lying length must not fetch a large range: say so now
                raise CorruptShardError(f"the index in the sidecar is {n} bytes, more than the offsets of "
                                        f"{count} samples take ({most} at most)", path=url, offset=foot)
            if type(o) is int and type(n) is int and 0 <= o and 0 < n and o + n <= side[1]:
                (data,) = client.get_ranges(side[0], [(o, o + n)], etag=side[2], storage_options=storage_options)
                self._side = _Spans([(o, o + n)], [data])
        self._load_footer(footer, foot, size)  # the checks and the index, as a local shard's
        self._side = None

    def line(self, j: int) -> tuple[dict, int]:
        if self.lines is None:
            raise ValueError(f"{self.path}: a shard read in mode='ranges' holds its index, not its lines: read "
                             "samples from the dataset")
        return super().line(j)

    def iter_samples(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        raise ValueError(f"{self.path}: a shard read in mode='ranges' holds no whole lines: read samples from the "
                         "dataset")

    key_values = iter_samples  # type: ignore[assignment]

    def view(self, lines: _Spans, side: _Spans | None) -> _RangeShard:
        """This shard reading ``lines`` (a batch's lines) and ``side`` (the sidecar values they point at)."""
        v = object.__new__(_RangeShard)
        v.__dict__.update(self.__dict__)
        v.lines, v._side = lines, side
        return v

    def sidecar(self, loc: Any, offset: int) -> memoryview:
        if self._bin_total < 0:
            raise self._fail(f"sample needs the sidecar {os.path.basename(self.bin_path)}, which is missing", offset)
        o, n = self._reference(loc, offset, self._bin_total)
        if n == 0:
            return memoryview(b"")
        if self._side is None or not self._side.covers(o, o + n):
            raise self._fail(f"sidecar bytes {o}..{o + n} were not read with the batch's lines (a reference the "
                             "reader did not find)", offset, self.bin_path)
        return memoryview(self._side[o:o + n])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # no decoders (closures) and no memoryview: remade in the new process
        state.update(plans={}, _decoders={}, _offs=None, lines=None, _side=None, parse=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.parse = LINE_PARSER[0]
        self._offs = memoryview(np.ascontiguousarray(self.offsets, dtype=np.uint64)).cast("B").cast("Q")


def _sidecar_refs(obj: dict, sep: str, tail: str, size: int, out: list[tuple[int, int]]) -> None:
    """The sidecar byte spans a parsed line points at: the ``{"offset", "length"}`` values of its keys
    ending in ``<sep>bin``, in nested mappings and lists at any depth (as the decoders walk them). References
    that are not valid or not inside the sidecar's ``size`` bytes are not read: the decoder names the
    problem."""
    for k, v in obj.items():
        if k.endswith(tail):
            if type(v) is dict:
                o, n = v.get("offset"), v.get("length")
                if type(o) is int and type(n) is int and o >= 0 and n > 0 and o + n <= size:
                    out.append((o, o + n))
        elif sep not in k:
            _nested_refs(v, sep, tail, size, out)


def _nested_refs(v: Any, sep: str, tail: str, size: int, out: list[tuple[int, int]]) -> None:
    t = type(v)
    if t is dict:
        _sidecar_refs(v, sep, tail, size, out)
    elif t is list:
        for x in v:
            _nested_refs(x, sep, tail, size, out)
