"""JinxDataset: a map-style torch Dataset over JINX shards (MLDataForge's format), lazy by default.

>>> ds = JinxDataset("data/train")  # doctest: +SKIP
>>> ds[0]["text"], bytes(ds[0]["image"])[:4]  # doctest: +SKIP
"""
from __future__ import annotations

import glob
import logging
import os
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import Any

from torchforge._limits import ensure_open_files
from torchforge.datasets.base import ShardDataset, register_format
from torchforge.errors import CorruptShardError, FormatError, NotFoundError, TorchforgeError
from torchforge.formats.jinx_reader import LINE_ERRORS, JinxShard, sidecar_path
from torchforge.lazy import lazy_sample
from torchforge.remote.url import is_remote, local_path

__all__ = ["JinxDataset", "check_chain", "detect"]

log = logging.getLogger(__name__)
_ON_ERROR = ("raise", "skip")


def _shard_paths(path_or_paths: str | os.PathLike | Sequence[str | os.PathLike]) -> tuple[list[str], list[list[str]]]:
    """The shard files named (folders expanded), and the shard files of each folder named."""
    items = [path_or_paths] if isinstance(path_or_paths, (str, os.PathLike)) else list(path_or_paths)
    paths: list[str] = []
    folders: list[list[str]] = []
    for item in items:
        p = local_path(os.fspath(item))
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(glob.escape(p), "shard-*.jinx")))
            if not found:
                raise FormatError("folder holds no shard-*.jinx files", path=p)
            paths.extend(found)
            folders.append(found)
        elif os.path.exists(p):
            paths.append(p)
        else:
            raise NotFoundError("no such JINX file or folder", path=p)
    if not paths:
        raise FormatError("no JINX files or folders given")
    return paths, folders


def check_chain(where: str, names: list[str], nexts: dict[str, str]) -> None:
    """A dataset whose shards are chained (footers naming their next shard) has the shard that ends its
    chain: a writer closes that one last and an upload puts it last, so a folder without it is a dataset
    still being written or uploaded, one whose writer died, or a partial copy, and is refused rather
    than read short. Shards renamed after writing still read; a folder holding only some of a dataset's
    shards is refused unless it holds the last.

    Args:
        where: the folder (or URL) the shards were found in.
        names: the file names of its shards.
        nexts: file name -> the file name its footer names as the next shard (shards naming none left out).

    Raises:
        CorruptShardError: naming the last shard found and the next one its footer names.
    """
    if nexts and len(nexts) == len(names):  # every shard names a next one: none ends the chain
        name = max(nexts)
        target = nexts[name]
        missing = "" if target in names else ", which is not there"
        raise CorruptShardError(f"the dataset is incomplete: no shard ends its chain of shards ({name}'s footer "
                                f"names {target} as the next{missing}); a writer or an upload still in progress, "
                                "one that died, or a folder holding only some of a dataset's shards",
                                path=f"{where.rstrip('/')}/{name}")


def next_name(footer: dict) -> str | None:
    """The file name a footer names as the next shard (``shard_next`` may be a path of the writing
    machine), or None."""
    nxt = footer.get("shard_next")
    return nxt.replace("\\", "/").rsplit("/", 1)[-1] if isinstance(nxt, str) and nxt else None


class JinxDataset(ShardDataset):
    """Samples of one or more JINX folders or files, in shard order.

    Args:
        path_or_paths: a folder of ``shard-NNNNN.jinx`` files, a single ``.jinx`` file, or a list of them.
        lazy: return :class:`~torchforge.lazy.LazySample` mappings that decode a value on first access
            (uncompressed sidecar values are zero-copy views); False returns plain dicts.
        split: keep only shards whose footer names this split (as MLDataForge does); None keeps all.
        on_error: ``"raise"`` or ``"skip"``. With ``"skip"``, iteration skips malformed lines (with
            ``lazy=False``: samples whose values fail to decode too), counts them in ``skipped`` and logs
            them. Random access (``ds[i]``) and broken footers or indexes always raise.

    Shards are memory-mapped when the dataset is built and again, lazily, in each process it is pickled
    into (torch DataLoader workers under spawn); under fork the maps are shared.
    """

    format_name = "jinx"

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """A URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``) makes a
        :class:`~torchforge.datasets.remote.RemoteJinxDataset` (which takes ``cache_dir``, ``cache_limit``,
        ``cache_policy`` and ``storage_options`` too)."""
        path = args[0] if args else kwargs.get("path_or_paths")
        if cls is JinxDataset and isinstance(path, str) and is_remote(path):
            from torchforge.datasets.remote import RemoteJinxDataset

            return super().__new__(RemoteJinxDataset)
        return super().__new__(cls)

    def __init__(self, path_or_paths: str | os.PathLike | Sequence[str | os.PathLike], lazy: bool = True,
                 split: str | None = None, on_error: str = "raise") -> None:
        if on_error not in _ON_ERROR:
            raise ValueError(f"on_error={on_error!r} is not one of {list(_ON_ERROR)}")
        self._shards: list[JinxShard] | None = None
        self.lazy = bool(lazy)
        self.split = split
        self.on_error = on_error
        self.skipped = 0
        self._all_paths, folders = _shard_paths(path_or_paths)  # never empty: _shard_paths raises first
        #: the folders named (each a whole chain of shards; files named alone are not)
        self.chain_folders = [os.path.dirname(found[0]) for found in folders]
        ensure_open_files(2 * len(self._all_paths), "JinxDataset")  # a map per shard and per sidecar
        shards = [JinxShard(p) for p in self._all_paths]
        opened = dict(zip(self._all_paths, shards))
        for found in folders:  # each folder named is a whole chain of shards
            names = [os.path.basename(p) for p in found]
            nexts = {n: nxt for n, p in zip(names, found) if (nxt := next_name(opened[p].footer)) is not None}
            check_chain(os.path.dirname(found[0]), names, nexts)
        self._set_shards([s for s in shards if self._wanted(s)])
        self._paths = [s.path for s in self._shards]
        self._counts = [s.num_samples for s in self._shards]
        self._starts: list[int] = []
        self._ends: list[int] = []
        total = 0
        for c in self._counts:
            self._starts.append(total)
            total += c
            self._ends.append(total)
        self._n = total

    @property
    def lazy(self) -> bool:
        """Whether samples are :class:`~torchforge.lazy.LazySample` mappings (else plain dicts)."""
        return self._lazy

    @lazy.setter
    def lazy(self, value: bool) -> None:
        self._lazy = bool(value)
        self._set_shards(self._shards)

    def _set_shards(self, shards: list[JinxShard] | None) -> None:
        self._shards = shards
        # the shard random access reads directly: set when there is one and samples are lazy
        self._one = shards[0] if shards is not None and len(shards) == 1 and self._lazy else None

    def _wanted(self, shard: JinxShard) -> bool:
        return self.split is None or shard.split == self.split

    # --- pickling: no maps, re-opened on first use ------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_shards"] = state["_one"] = None
        return state

    def _open(self) -> list[JinxShard]:
        ensure_open_files(2 * len(self._paths), "JinxDataset")  # in this process (a worker, say)
        shards = []
        for path, count in zip(self._paths, self._counts):
            shard = JinxShard(path)
            if shard.num_samples != count or not self._wanted(shard):
                raise FormatError(f"shard changed since the dataset was opened: it held {count} samples, "
                                  f"now {shard.num_samples}", path=path)
            shards.append(shard)
        self._set_shards(shards)
        return shards

    # --- ShardDataset ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._n

    def shard_files(self) -> list[str]:
        return [f for p in self._paths for f in (p, sidecar_path(p)) if f == p or os.path.exists(f)]

    @property
    def root(self) -> str:
        """The folder of the first shard (key caches go there, also when a split selects none)."""
        return os.path.dirname(os.path.abspath(self._all_paths[0]))

    @property
    def shards(self) -> list[JinxShard]:
        """The open shards (those of the selected split)."""
        return self._shards if self._shards is not None else self._open()

    def locate(self, i: int) -> tuple[int, int]:
        """(shard number, index within the shard) of sample ``i`` (0 <= i < len)."""
        s = bisect_right(self._ends, i)
        return s, i - self._starts[s]

    def _get(self, i: int) -> Any:
        shards = self._shards if self._shards is not None else self._open()
        s = bisect_right(self._ends, i)
        return shards[s].sample(i - self._starts[s], self._lazy)

    def __getitem__(self, i: int) -> Any:  # the base class's contract, inlined: this is the hot path
        shard = self._one
        if shard is not None and type(i) is int and 0 <= i < self._n:  # one shard, lazy samples
            offs = shard._offs
            start = offs[i]
            try:
                obj = shard.parse(shard.lines[start:offs[i + 1]])
            except LINE_ERRORS:
                obj = None
            if type(obj) is dict:
                return lazy_sample(obj, shard, start)
            return shard.sample(i)  # raises, naming the problem
        i = i if type(i) is int else int(i)
        n = self._n
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for JinxDataset of {n} samples")
        shards = self._shards if self._shards is not None else self._open()
        if len(shards) == 1:
            return shards[0].sample(i, self._lazy)
        s = bisect_right(self._ends, i)
        return shards[s].sample(i - self._starts[s], self._lazy)

    def __iter__(self) -> Iterator[Any]:
        shards = self._shards if self._shards is not None else self._open()
        on_error = self._skip if self.on_error == "skip" else None
        if len(shards) == 1:
            return shards[0].iter_samples(self.lazy, on_error=on_error)
        return chain.from_iterable(shard.iter_samples(self.lazy, on_error=on_error) for shard in shards)

    def key_values(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(sample)`` for every sample, read sequentially (the fast path) unless bad lines are skipped."""
        if self.on_error == "skip":  # keep one key per index: skipped lines would shift the rest
            return super().key_values(fn)
        if not self.lazy:
            return [fn(s) for s in self]
        shards = self._shards if self._shards is not None else self._open()
        out: list[Any] = []
        for shard in shards:
            out += shard.key_values(fn)
        return out

    def _skip(self, err: TorchforgeError) -> None:
        self.skipped += 1
        log.warning("skipping malformed JINX sample: %s", err)


def detect(path: str) -> bool:
    """A ``.jinx`` file, or a folder holding ``shard-*.jinx`` files."""
    if os.path.isdir(path):
        return bool(glob.glob(os.path.join(glob.escape(path), "shard-*.jinx")))
    return path.endswith(".jinx")


register_format("jinx", JinxDataset, detect)
