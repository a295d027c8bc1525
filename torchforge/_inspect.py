"""Format-specific details for ``torchforge inspect`` and checksum checks for ``torchforge verify``."""
from __future__ import annotations

import contextlib
import os
import re
from typing import Any

from torchforge.errors import CorruptShardError, FormatError, TorchforgeError

__all__ = ["format_checks", "format_details"]

_SHARD_FILE = re.compile(r"shard\.\d+\.mds(\.\w+)?")  # Streaming's shard names, compressed or not


def _jinx_details(ds: Any) -> dict[str, Any]:
    shards = ds.shards
    out: dict[str, Any] = {"shard count": len(shards)}
    if shards:
        foot = shards[0].footer
        for k in ("version", "encoding", "compression", "index_compression", "compress_threshold",
                  "compress_ratio", "binary_threshold", "ext_sep", "split"):
            if k in foot:
                out[k] = foot[k]
        # a dataset at a URL knows its shards' splits from their footers (without fetching every shard)
        splits = getattr(ds, "shard_splits", None)
        out["splits"] = sorted({str(s) for s in splits} if splits is not None else {str(s.split) for s in shards})
    if len(ds):
        raw = getattr(ds[0], "raw_keys", None)
        if callable(raw):  # stored keys name each value's encoding: image.raw.zst.bin
            out["stored keys (sample 0)"] = raw()
    return out


def _mds_details(ds: Any) -> dict[str, Any]:
    metas = ds.metas  # index.json as the dataset read and checked it
    out: dict[str, Any] = {"shard count": len(metas)}
    if metas:
        out["columns"] = dict(zip(metas[0].column_names, metas[0].column_encodings))
        out["compression"] = sorted({str(m.raw.get("compression")) for m in metas})
        out["hashes"] = sorted({h for m in metas for h in m.raw.get("hashes", [])})
    return out


def format_details(ds: Any) -> dict[str, Any]:
    """What ``inspect`` shows beyond the generic fields, by format."""
    fn = {"jinx": _jinx_details, "mds": _mds_details}.get(ds.format_name)
    return fn(ds) if fn else {}


def _mds_checks(ds: Any) -> list[TorchforgeError]:
    """Every shard file's hashes against index.json (Streaming writes them for both file forms); shards
    index.json says hold no samples against their own header (decoding every sample never opens them);
    shard files index.json does not list (their samples are not part of the dataset)."""
    from torchforge.formats.mds import get_hash, hash_names

    problems: list[TorchforgeError] = []
    known = set(hash_names())
    listed, folders = set(), {os.path.normpath(ds.root)}
    for k, m in enumerate(ds.metas):
        for name in (m.raw_basename, m.zip_basename):
            if name:
                path = os.path.normpath(os.path.join(ds.root, name))
                listed.add(path)
                folders.add(os.path.dirname(path))
        if m.samples == 0:
            try:
                ds._shard(k)
            except TorchforgeError as e:
                problems.append(e)
    for folder in sorted(folders):
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(folder)):
                path = os.path.join(folder, name)
                if _SHARD_FILE.fullmatch(name) and path not in listed and os.path.isfile(path):
                    problems.append(FormatError("a shard file index.json does not list: its samples are not "
                                                "part of the dataset (a lost index entry?)", path=path))
    for m in ds.metas:
        for form in ("zip_data", "raw_data"):
            info = m.raw.get(form) or {}
            path = os.path.join(ds.root, info.get("basename", ""))
            if not info or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                data = f.read()
            for algo, want in (info.get("hashes") or {}).items():
                if algo in known and get_hash(algo, data) != want:
                    problems.append(CorruptShardError(f"{algo} hash differs from index.json", path=path, offset=0))
            break  # the zip form is the stored one when present
    return problems


def _jinx_checks(ds: Any) -> list[TorchforgeError]:
    """Every folder's chain of shards is whole: the footers number the shards (``shard_id``, kept when
    shards are renamed) from 0 to the one that ends the chain, and none of those numbers is missing.
    Opening reads what is there (a folder holding the chain's end is read whole); a shard deleted from
    the middle or the front would be samples lost without a word."""
    named = getattr(ds, "chain_folders", None)  # (shard files named alone are no chain to count)
    if ds.format_name != "jinx" or not named or getattr(ds, "split", None) is not None:  # (a split: some shards)
        return []
    folders: dict[str, list[Any]] = {f: [] for f in named}
    for shard in ds.shards:
        if os.path.dirname(shard.path) in folders:
            folders[os.path.dirname(shard.path)].append(shard)
    problems: list[TorchforgeError] = []
    for folder, shards in sorted(folders.items()):
        ids = [s.footer.get("shard_id") for s in shards]
        ends = [i for s, i in zip(shards, ids) if not s.footer.get("shard_next")]
        if not all(type(i) is int for i in ids) or len(ends) != 1:
            continue  # shards a writer did not number, or no single end: nothing to count against
        missing = sorted(set(range(ends[0] + 1)) - set(ids))
        if missing:
            problems.append(CorruptShardError(
                f"the chain of shards is missing {len(missing)} of its {ends[0] + 1} shards: the footers number "
                f"them 0..{ends[0]} (shard_id) and none here has number {missing[:10]} (deleted or lost files: "
                "their samples are not read)", path=folder))
    return problems


def format_checks(ds: Any) -> list[TorchforgeError]:
    """Checks beyond decoding every sample (checksums recorded by the writer, a chain of shards that is
    whole)."""
    if ds.format_name == "mds":
        return _mds_checks(ds)
    return _jinx_checks(ds)


def unhashed_shards(ds: Any) -> tuple[int, int]:
    """(shards whose bytes no recorded checksum covers, shards): verify can find a changed byte in those
    only where it no longer decodes (a hash of an algorithm torchforge cannot compute here covers nothing). MDS records hashes in index.json when its writer was asked to (local
    or remote); JINX and safetensors record none."""
    if ds.format_name != "mds":
        n = len(ds._starts) if ds.format_name == "jinx" else len(ds._ends)  # (shards, not their sidecars)
        return n, n
    from torchforge.formats.mds import hash_names

    known = set(hash_names())  # a hash of an algorithm this machine cannot compute checks nothing
    bare = sum(1 for m in ds.metas
               if not known & set((m.raw.get("zip_data") or m.raw.get("raw_data") or {}).get("hashes") or ()))
    return bare, len(ds.metas)
