"""FeatureStore: per-sample features (embeddings, losses, labels) keyed by int64 sample id, written
during training by every rank at once and read back by batch of ids, in DataLoader workers too.

>>> store = FeatureStore("/tmp/feats", {"emb": ((4,), torch.float16), "loss": ((), torch.float32)},
...                      create=True)  # doctest: +SKIP
>>> with store.writer() as w:  # doctest: +SKIP
...     w.write(torch.tensor([7, 3]), emb=torch.ones(2, 4), loss=torch.tensor([0.5, 0.25]))
>>> store.get([3, 7])["loss"]  # doctest: +SKIP
tensor([0.2500, 0.5000])

Files, versions and the commit protocol: :mod:`torchforge.features.layout` and
:mod:`torchforge.features.writer`; the index: :mod:`torchforge.features.index`; reads:
:mod:`torchforge.features.reader`.

A store handle reads one version, fixed when it is opened (the newest then) so that every batch of
an epoch sees the same rows; :meth:`refresh` moves it to the newest version, which a commit made
through one of its writers does by itself. :meth:`at` opens an older version: a handle opened at a
version stays there (its own writers' commits do not move it) until :meth:`refresh`. A handle pickles as its
path and version: a DataLoader worker maps the same files itself.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from torchforge.errors import FormatError, NotFoundError, TorchforgeError
from torchforge.features.layout import (
    INDEX,
    SCHEMA_FILE,
    SHARDS,
    VERSIONS,
    Schema,
    list_versions,
    pick_columns,
    prune_versions,
    read_manifest,
    read_schema,
    schema_from_user,
    schema_to_json,
    version_path,
    write_schema,
)
from torchforge.features.reader import Snapshot
from torchforge.features.writer import FeatureWriter, as_ids

__all__ = ["FeatureStore"]


class FeatureStore:
    """Named fixed-shape columns keyed by int64 sample id, in safetensors shards with one JSON manifest
    per version.

    Args:
        path: the store's folder.
        schema: ``{"name": (shape, dtype)}``, e.g. ``{"emb": ((768,), torch.float16), "loss": ((),
            torch.float32)}``. Required with ``create=True``; otherwise read from the store (and, if
            given, checked against it).
        create: make the folder and its schema if they do not exist (an existing store must have the
            same schema).
        version: read this version rather than the newest (see :meth:`at`).

    Raises:
        ValueError: ``create=True`` without a ``schema``, or a schema that is not one.
        NotFoundError: no store at ``path`` (and ``create`` is False), or no such version.
        FormatError: the schema or a manifest is malformed, or differs from ``schema``.
        TorchforgeError: ``create=True`` and the folders cannot be made (a file in the way, no permission).
    """

    def __init__(self, path: str | os.PathLike, schema: dict[str, Any] | None = None, *, create: bool = False,
                 version: int | None = None):
        self.path = os.path.abspath(os.fspath(path))
        if create:
            if schema is None:
                raise ValueError("create=True needs a schema: {'name': (shape, dtype), ...}")
            wanted = schema_from_user(schema)
            try:
                for sub in (SHARDS, INDEX, VERSIONS):
                    os.makedirs(os.path.join(self.path, sub), exist_ok=True)
            except OSError as e:  # a file in the way (NotADirectoryError, FileExistsError), no permission, ...
                raise TorchforgeError(f"cannot make the feature store's folders: {e.strerror}",
                                      path=e.filename or self.path) from e
            write_schema(self.path, wanted)
        elif not os.path.isdir(self.path):
            raise NotFoundError("no feature store here; pass create=True (and a schema) to make one",
                                path=self.path)
        self.schema: Schema = read_schema(self.path)
        if schema is not None and schema_from_user(schema) != self.schema:
            raise FormatError(f"schema {schema_to_json(schema_from_user(schema))} differs from the store's "
                              f"{schema_to_json(self.schema)}", path=os.path.join(self.path, SCHEMA_FILE))
        self._snap: Snapshot | None = None
        self._pinned = version is not None  # opened at a version: commits do not move it (see at())
        self._open(version)

    def _open(self, version: int | None) -> None:
        if version is None:  # the newest: if a prune removes it while it opens, a newer one exists; open that
            while True:
                versions = list_versions(self.path)
                newest = versions[-1] if versions else 0
                try:
                    return self._open(newest)
                except TorchforgeError:
                    if list_versions(self.path)[-1:] == versions[-1:]:
                        raise
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
            raise ValueError(f"version={version!r} must be an int >= 0")
        manifest = read_manifest(self.path, int(version)) if version else None
        if manifest is not None and manifest.schema != self.schema:  # one schema per store: a lie or damage
            raise FormatError(f"version {version} has schema {schema_to_json(manifest.schema)}, the store's "
                              f"{SCHEMA_FILE} {schema_to_json(self.schema)}", path=version_path(self.path, int(version)))
        self._snap = Snapshot(self.path, self.schema, manifest)

    # --- versions ----------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The version this handle reads (0: nothing committed yet)."""
        return self._snap.version

    @property
    def latest_version(self) -> int:
        """The newest version on disk now."""
        versions = list_versions(self.path)
        return versions[-1] if versions else 0

    def refresh(self) -> int:
        """Read the newest version from now on; returns its number."""
        self._open(None)
        self._pinned = False
        return self.version

    def _committed(self) -> None:
        """One of this handle's writers committed: follow it, unless the handle was opened at a version."""
        if not self._pinned:
            self._open(None)

    def prune(self, keep: int = 1) -> list[int]:
        """Delete every version but the ``keep`` newest, and the files only they name: each version keeps an
        id index of every row of the store, so a store committed to often grows by one index per commit
        until old versions are pruned. Returns the version numbers deleted.

        Not for versions still being read: a handle (in another process too) at a deleted version reads on
        from the files it has open, and a shard it had not opened yet is a CorruptShardError ("missing");
        ``at()`` of a deleted version is a NotFoundError. This handle moves to the newest version if its own
        was deleted. Concurrent commits are safe (a commit whose parent version is deleted under it redoes
        its index on the newest). Shards whose rows later commits overwrote stay while a kept version lists
        them (the store is not compacted).

        Raises:
            ValueError: ``keep`` < 1.
            FormatError: a manifest cannot be read (nothing is deleted).
        """
        gone = prune_versions(self.path, keep)
        if self.version in gone:
            self._open(None)
            self._pinned = False
        return gone

    def at(self, version: int) -> FeatureStore:
        """A handle reading ``version`` (1 is the first commit); it stays there, its own writers'
        commits included, until :meth:`refresh`."""
        return FeatureStore(self.path, version=version)

    def __len__(self) -> int:
        """Rows (distinct ids) in the version read."""
        return self._snap.rows

    def ids(self) -> np.ndarray:
        """Every id of the version read, sorted (a read-only view of the mapped index)."""
        return self._snap.ids()

    # --- reading -----------------------------------------------------------------------------------
    def get(self, ids: Any, columns: str | Iterable[str] | None = None, *, missing: Any = None
            ) -> dict[str, torch.Tensor]:
        """The rows of a batch of ids, gathered per column.

        Args:
            ids: int64 ids (a tensor on any device, an array, a sequence or one int); order and repeats
                are kept.
            columns: the columns to read: one name, several, or None (default) for all.
            missing: None (default) raises MissingIdsError for ids not in the version; otherwise the
                value their rows get, one for every column or a dict of column -> value.

        Returns:
            ``{column: tensor of shape (len(ids), *shape)}`` on the CPU; in a torchforge DataLoader
            worker the tensors lie in the batch's shared memory.

        Raises:
            MissingIdsError: some ids are not in the version (``.ids`` lists them).
            CorruptShardError: a file contradicts the manifest or index.
        """
        cols = pick_columns(self.schema, columns)
        if isinstance(missing, dict):
            absent = [c for c in cols if c not in missing]
            if absent:
                raise ValueError(f"missing= has no default for columns {absent}")
        return self._snap.gather(as_ids(ids), cols, missing)

    def __contains__(self, i: object) -> bool:
        q = as_ids(i)
        if len(q) != 1:
            raise TypeError(f"`in` takes one id, got {len(q)} (a batch: get(ids, missing=...))")
        if self._snap.index is None:
            return False
        _, found = self._snap.index.lookup(q)
        return bool(found[0])

    # --- writing and joining -----------------------------------------------------------------------
    def writer(self, rank: int | None = None, *, shard_size: int | str = "256MiB") -> FeatureWriter:
        """A writer whose rows become one new version at each ``commit()`` (see FeatureWriter)."""
        return FeatureWriter(self, rank, shard_size)

    def join(self, dataset: Any, key: str = "id", columns: str | Iterable[str] | None = None, *,
             missing: Any = None) -> Any:
        """``dataset`` with each sample gaining this store's columns for the sample's ``key`` field
        (read lazily, in the loader's workers, one store lookup per batch); see JoinedDataset.

        The join reads the version this handle reads now, in every worker and every epoch: a later commit
        (this handle's own writers' included) is read by a join made after it."""
        from torchforge.features.join import JoinedDataset

        return JoinedDataset(dataset, self, key=key, columns=columns, missing=missing)

    # --- plumbing ----------------------------------------------------------------------------------
    def __reduce__(self) -> tuple[Any, ...]:
        return (_reopen, (self.path, self.version))

    def __repr__(self) -> str:
        cols = ", ".join(f"{k}: {list(c.shape)} {str(c.dtype).removeprefix('torch.')}"
                         for k, c in self.schema.items())
        return f"FeatureStore({self.path!r}, version {self.version}, {len(self)} rows, {{{cols}}})"


def _reopen(path: str, version: int) -> FeatureStore:
    return FeatureStore(path, version=version)
