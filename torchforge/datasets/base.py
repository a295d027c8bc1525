"""The common base of the format datasets: bounds checks, iteration, key passes and their cache.

A format dataset subclasses :class:`ShardDataset` and supplies ``__len__``, ``_get(i)`` (one sample,
lazy where the format allows it) and ``shard_files()`` (the files whose change invalidates caches).
"""
from __future__ import annotations

import hashlib
import inspect
import itertools
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch.utils.data

from torchforge.cache import user_cache_dir
from torchforge.errors import FormatError, NotFoundError, TorchforgeError
from torchforge.formats.values import BYTES_LIKE

__all__ = ["KEY_CACHE_PREFIX", "ShardDataset"]

log = logging.getLogger(__name__)
KEY_CACHE_PREFIX = "keys-"


class ShardDataset(torch.utils.data.Dataset):
    """Map-style dataset over a folder of shards.

    Subclasses implement ``__len__``, ``_get(i)`` and ``shard_files()``; they may override ``__iter__``
    with a faster sequential path. Negative indices count from the end; out-of-range indices raise
    IndexError (the Python sequence contract, so ``for x in ds`` style code works).
    """

    format_name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__ and cls.__new__ is not object.__new__:
            # help() and inspect.signature() show __init__'s arguments, not the dispatching
            # __new__(*args, **kwargs) a class that opens URLs too has
            sig = inspect.signature(cls.__init__)
            cls.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:],
                                            return_annotation=inspect.Signature.empty)

    # --- to implement ------------------------------------------------------------------------------
    def __len__(self) -> int:
        raise NotImplementedError

    def _get(self, i: int) -> Any:
        raise NotImplementedError

    def shard_files(self) -> list[str]:
        """Paths of every file the samples are read from (shards, sidecars, index files)."""
        raise NotImplementedError

    @property
    def root(self) -> str:
        """The dataset's folder (the folder of the first shard by default)."""
        files = self.shard_files()
        return os.path.dirname(os.path.abspath(files[0])) if files else os.getcwd()

    # --- provided ----------------------------------------------------------------------------------
    def __getitem__(self, i: int) -> Any:
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for {type(self).__name__} of {n} samples")
        return self._get(i)

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self._get(i)

    def keys(self, field_or_fn: str | Callable[[Any], Any], *, cache: bool = True) -> np.ndarray:
        """One key per sample, reading only what the key needs.

        Args:
            field_or_fn: a field name (dots descend into nested mappings: ``"meta.source"``) or a
                callable taking the (lazy) sample and returning its key.
            cache: for a field name, keep the array in the per-user cache folder
                (:func:`torchforge.cache.user_cache_dir`, never the data folder), keyed by the dataset's
                identity: its format, the field, and every shard file's absolute path, size and
                modification time (a changed shard gets a new entry).

        Returns:
            A numpy array of ``len(self)`` keys: numeric, ``U`` for strings, ``S`` for bytes.
        """
        if callable(field_or_fn):
            return _to_key_array(self.key_values(field_or_fn))
        if not isinstance(field_or_fn, str):
            raise TypeError(f"keys() takes a field name or a callable, got {type(field_or_fn).__name__}")
        cache_path = self._key_cache_path(field_or_fn) if cache else None
        if cache_path and os.path.exists(cache_path):
            try:
                arr = np.load(cache_path, allow_pickle=False)
                if arr.ndim == 1 and len(arr) == len(self):
                    return arr
                log.warning("ignoring key cache %s of shape %s for %d samples", cache_path, arr.shape, len(self))
            except (OSError, ValueError) as e:
                log.warning("ignoring unreadable key cache %s: %s", cache_path, e)
        parts, at = field_or_fn.split("."), itertools.count()

        def key(sample: Any) -> Any:  # (key_values goes through the samples in order: ``at`` is the index)
            i = next(at)
            try:
                return _dig(sample, parts, field_or_fn)
            except KeyError:
                fields = sorted(map(str, sample)) if isinstance(sample, Mapping) else type(sample).__name__
                raise KeyError(f"sample {i} has no field {field_or_fn!r} (its fields: {fields})") from None

        arr = _to_key_array(self.key_values(key))  # the format's cheapest pass
        if cache_path:
            _save_atomic(cache_path, arr)
        return arr

    def key_values(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(sample)`` for every sample, in order, as a Python list (no array, no cache).

        Formats override this to hand ``fn`` their cheapest lazy view of a sample.
        """
        get = self._get
        return [fn(get(i)) for i in range(len(self))]

    def _key_cache_path(self, field: str) -> str | None:
        h = hashlib.sha256(f"{self.format_name}\0{field}".encode())
        for f in self.shard_files():
            try:
                st = os.stat(f)
            except OSError:
                return None
            h.update(f"\0{os.path.abspath(f)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
        return self._key_cache_file(h)

    def _key_cache_file(self, h: Any) -> str | None:
        """The key cache file of the identity hashed in ``h`` (None when there is no cache folder)."""
        try:
            folder = user_cache_dir("keys")
        except OSError as e:  # the cache is an optimisation only
            log.debug("no key cache: %s", e)
            return None
        return os.path.join(folder, f"{KEY_CACHE_PREFIX}{h.hexdigest()[:32]}.npy")


def _dig(sample: Any, parts: Sequence[str], field: str) -> Any:
    v = sample
    for p in parts:
        if not isinstance(v, Mapping) or p not in v:
            raise KeyError(f"sample has no field {field!r}")
        v = v[p]
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
        v = v.item()
    return v


def _to_key_array(keys: list[Any]) -> np.ndarray:
    if not keys:
        return np.zeros(0, dtype=np.int64)
    if all(isinstance(k, str) for k in keys):
        return np.array(keys, dtype=str)
    if all(isinstance(k, BYTES_LIKE) for k in keys):
        return np.array([bytes(k) for k in keys], dtype=bytes)
    arr = np.asarray(keys)
    if arr.dtype == object:
        raise TorchforgeError(f"keys must be all numbers, all strings or all bytes; got {type(keys[0]).__name__}"
                              " and others")
    return arr


def _save_atomic(path: str, arr: np.ndarray) -> None:
    folder = os.path.dirname(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-keys-")
    except OSError as e:  # the cache is an optimisation only
        log.debug("key cache not written to %s: %s", folder, e)
        return
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, arr, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# --- the format registry ----------------------------------------------------------------------------
_FORMATS: dict[str, tuple[type, Callable[[str], bool]]] = {}
_BUILTIN_MODULES = ("torchforge.datasets.jinx", "torchforge.datasets.mds", "torchforge.datasets.safetensors")


def register_format(name: str, dataset_cls: type, detect: Callable[[str], bool]) -> None:
    """Register a dataset class for an on-disk format.

    Args:
        name: the format's name (``"jinx"``, ``"mds"``, ``"safetensors"``).
        dataset_cls: called as ``dataset_cls(path, **kwargs)`` by :func:`open_dataset`, with its keyword
            arguments.
        detect: ``detect(folder) -> bool``, cheap (looks at file names, at most a few bytes).
    """
    _FORMATS[name] = (dataset_cls, detect)


def formats() -> dict[str, type]:
    """The registered formats, built-in ones included."""
    _load_builtins()
    return {k: v[0] for k, v in _FORMATS.items()}


def _load_builtins() -> None:
    import importlib

    for mod in _BUILTIN_MODULES:
        try:
            importlib.import_module(mod)
        except ImportError as e:
            if e.name != mod:  # a real import failure inside an existing module
                raise


_REMOTE_ONLY = ("cache_dir", "cache_limit", "cache_policy", "mode", "storage_options")


def open_dataset(path: str | os.PathLike, **kwargs: Any) -> ShardDataset:
    """Open a JINX, MDS or safetensors-shard folder (or file) with the matching dataset class; a URL
    (``s3://``, ``gs://``, ``az://``, ``http(s)://``) opens a JINX, MDS or safetensors dataset in object
    storage, and a ``file://`` URL the local files in place, with the local classes (the URL options are
    checked, then left out where the local class has no such option)
    (:class:`~torchforge.datasets.remote.RemoteMDSDataset`,
    :class:`~torchforge.datasets.remote.RemoteJinxDataset`,
    :class:`~torchforge.datasets.remote.RemoteSafetensorsDataset`, whose options ``cache_dir``,
    ``cache_limit``, ``mode``, ``cache_policy`` and ``storage_options`` it takes). Other keyword arguments
    go to the dataset class (``split=`` for JINX, say).

    >>> ds = open_dataset("data/train")  # doctest: +SKIP
    """
    path = os.fspath(path)
    file_url = False
    if "://" in path:
        from torchforge.remote.url import is_remote, local_path

        if is_remote(path):  # an MDS or JINX dataset in object storage (see torchforge.datasets.remote)
            from torchforge.datasets.remote import open_remote

            return open_remote(path, **kwargs)
        path = local_path(path)  # a file:// URL: the local files, read in place (no object store)
        file_url = True
        if kwargs.get("mode", "shards") not in ("shards", "ranges"):
            raise ValueError(f"mode={kwargs['mode']!r} must be 'shards' or 'ranges'")
    if not os.path.exists(path):
        raise NotFoundError("no such file or folder", path=path)
    _load_builtins()
    for cls, detect in _FORMATS.values():
        if detect(path):
            if file_url:  # the object-store options a URL takes, where the local class has no such option
                takes = inspect.signature(cls.__init__).parameters
                kwargs = {k: v for k, v in kwargs.items() if k not in _REMOTE_ONLY or k in takes}
            return cls(path, **kwargs)
    raise FormatError(f"not a dataset of any known format ({sorted(_FORMATS)}): expected shard-NNNNN.jinx "
                      "files, an MDS index.json, or .safetensors shards", path=path)
