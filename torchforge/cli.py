"""The ``torchforge`` command: convert, inspect, verify and bench datasets.

Every dataset path may be a URL (``s3://``, ``gs://``, ``az://``, ``http(s)://`` read-only, ``file://``);
``convert`` also writes to one (uploaded with the index last). The options for URLs are the same on
every subcommand: ``--cache-dir``, ``--cache-limit``, ``--mode``, ``--storage-option KEY=VALUE``.

Exit codes: 0 success, 1 damaged data (``verify``) or a failed command, 2 bad usage.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from torchforge._inspect import format_checks, format_details
from torchforge._proc import drop_dead_stages, host_name, pid_alive
from torchforge.convert import _materialize, overlap
from torchforge.errors import NotFoundError, TorchforgeError
from torchforge.remote.url import is_remote, local_path

__all__ = ["main"]


def _num(text: str) -> Any:
    """Parse a writer option value: int, float, null/none, true/false, else the string."""
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _describe(value: Any) -> str:
    import numpy as np
    import torch

    if isinstance(value, np.ndarray):
        return f"ndarray {value.dtype} {list(value.shape)}"
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes"
    if isinstance(value, np.generic):
        return value.dtype.name
    return type(value).__name__


def _takes_text(to: str, option: str) -> bool:
    """Whether the ``to`` writer's ``option`` takes text only (``split``: ``-o split=2024`` stays the
    string "2024"); other options' values are read by :func:`_num`."""
    import inspect

    from torchforge.convert import writer_class

    try:
        param = inspect.signature(writer_class(to).__init__).parameters.get(option)
    except (TypeError, ValueError):
        return False
    ann = str(param.annotation) if param is not None else ""
    return "str" in ann and not any(t in ann for t in ("int", "float", "bool"))


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (an integer >= 0)")
    return n


def _remote_options(args: argparse.Namespace) -> dict[str, Any]:
    """``open_dataset``'s options for a URL, from ``--cache-dir``, ``--cache-limit``, ``--mode`` and
    ``--storage-option``."""
    out: dict[str, Any] = {}
    if args.cache_dir is not None:
        out["cache_dir"] = args.cache_dir
    if args.cache_limit is not None:
        out["cache_limit"] = args.cache_limit
    if args.mode is not None:
        out["mode"] = args.mode
    if args.storage_option:
        out["storage_options"] = {k.replace("-", "_"): v for k, v in args.storage_option}
    return out


def _open(path: str, args: argparse.Namespace) -> Any:
    """The dataset at ``path``; a URL opens with the URL options of the command line."""
    from torchforge.datasets.base import open_dataset

    return open_dataset(path, **_remote_options(args)) if is_remote(path) else open_dataset(path)


def cmd_convert(args: argparse.Namespace) -> int:
    from torchforge.convert import convert
    from torchforge.remote.errors import RemoteExistsError

    options = {k.replace("-", "_"): v for k, v in dict(args.option).items()}
    options = {k: v if _takes_text(args.to, k) and v.lower() not in ("none", "null") else _num(v)
               for k, v in options.items()}
    if args.columns:
        try:
            options["columns"] = json.loads(args.columns)
        except ValueError as e:
            print(f"torchforge convert: --columns is not JSON: {e}", file=sys.stderr)
            return 2
    clash = overlap(args.src, args.dst)
    if clash:
        print(f"torchforge convert: {clash}; write to a destination outside the source", file=sys.stderr)
        return 2
    remote = _remote_options(args)
    if is_remote(args.dst):
        t0 = time.perf_counter()
        try:
            options["overwrite"] = args.overwrite or bool(options.get("overwrite"))
            stats = convert(args.src, args.dst, args.to, progress=not args.quiet, **remote, **options)
        except RemoteExistsError as e:
            print(f"torchforge convert: {e}", file=sys.stderr)
            return 2
        except (ValueError, TypeError, OverflowError) as e:  # values the target format cannot hold, options
            print(f"torchforge convert: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        return _converted(stats, args, time.perf_counter() - t0)
    args.dst = dst = local_path(args.dst)
    _put_back_moved_aside(dst)
    exists = os.path.lexists(dst) and not (os.path.isdir(dst) and not os.path.islink(dst) and not os.listdir(dst))
    if exists and not args.overwrite:
        print(f"torchforge convert: {dst} exists and is not empty; pass --overwrite", file=sys.stderr)
        return 2
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            print(f"torchforge convert: cannot make the folder of {dst}: {e.strerror}", file=sys.stderr)
            return 2
    # written beside DST and moved into place once whole: a conversion that fails leaves DST as it was
    base = os.path.basename(os.path.abspath(dst))
    # what converts into DST on this host left when killed (their finally never ran): a dataset's worth
    drop_dead_stages(parent, _stage_pattern(base) + r"(\.old)?")
    stage = os.path.join(parent, f".{base}.converting-h{host_name()}-p{os.getpid()}")
    t0 = time.perf_counter()
    try:
        stats = convert(args.src, stage, args.to, progress=not args.quiet, **remote, **options)
        stats.out = dst
        _replace(stage, dst)
    except (TorchforgeError, OSError, ValueError, TypeError, OverflowError) as e:
        print(f"torchforge convert: {type(e).__name__}: {e}" + ("" if not exists else f" ({dst} is unchanged)"),
              file=sys.stderr)
        return 1
    finally:
        _remove(stage)
    return _converted(stats, args, time.perf_counter() - t0)


def _stage_pattern(base: str) -> str:
    """The names of the folders converts into ``base`` on this host write beside it (group 1: the pid)."""
    return rf"\.{re.escape(base)}\.converting-h{re.escape(host_name())}-p(\d+)"


def _put_back_moved_aside(dst: str) -> None:
    """A convert killed between its two renames (DST moved aside, the new one not yet in place) left the
    old DST under ``.<name>.converting-h<host>-p<pid>.old``, its new dataset beside it and no DST: put
    the old one back, before anything else looks at DST (the clean-up of dead converts' folders deleted
    it, and DST was lost). A ``.old`` with no stage beside it is what a convert killed while deleting
    it left, after the new DST took its place: not put back (its files are half gone)."""
    parent = os.path.dirname(os.path.abspath(dst))
    if os.path.lexists(dst) or not os.path.isdir(parent):
        return
    base = os.path.basename(os.path.abspath(dst))
    aside = re.compile(_stage_pattern(base) + r"\.old")
    for name in sorted(os.listdir(parent)):
        m = aside.fullmatch(name)
        if m and not pid_alive(int(m.group(1))) and os.path.isdir(os.path.join(parent, name[:-len(".old")])):
            os.rename(os.path.join(parent, name), dst)
            return


def _replace(stage: str, dst: str) -> None:
    """Put the converted folder ``stage`` at ``dst``: the old DST (a folder, a file or a link) is moved
    aside first and removed only once the new one is in place."""
    old = None
    if os.path.lexists(dst):
        old = f"{stage}.old"
        os.rename(dst, old)
    try:
        os.rename(stage, dst)
    except OSError:
        if old is not None:
            os.rename(old, dst)
        raise
    if old is not None:
        _remove(old)


def _remove(path: str) -> None:
    import shutil

    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    elif os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)


def _converted(stats: Any, args: argparse.Namespace, dt: float) -> int:
    print(f"wrote {stats.written} samples to {args.dst} ({args.to}) in {dt:.2f}s "
          f"({stats.written / max(dt, 1e-9):,.0f} samples/s); skipped {stats.skipped} malformed records")
    for where in stats.skipped_where:
        print(f"  skipped {where}")
    return 0


def _remote_info(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """What ``inspect`` shows of a dataset at a URL: its index (MDS's index.json, JINX footers, safetensors
    headers, read when it opened) and its first sample (one shard or one range read); the shard sizes are
    the store's."""
    ds = _open(url, args)
    stored = [(u.rsplit("/", 1)[-1], size) for k in range(len(ds._first) - 1) for u, size, _, _ in ds._objects(k)]
    info: dict[str, Any] = {
        "path": url,
        "format": ds.format_name,
        "samples": len(ds),
        "files": len(stored) + (ds.format_name == "mds"),  # and index.json
        "bytes": sum(size for _, size in stored),
        "version": ds.version,
        "mode": ds.mode,
    }
    info.update(format_details(ds))
    if len(ds):
        first = _materialize(ds[0])
        if isinstance(first, dict):
            info["fields"] = {k: _describe(v) for k, v in first.items()}
    info["shards"] = [{"file": name, "bytes": size} for name, size in stored]
    return info


def _dataset_info(path: str) -> dict[str, Any]:
    from torchforge.datasets.base import open_dataset

    ds = open_dataset(path)
    files = ds.shard_files()
    info: dict[str, Any] = {
        "path": path,
        "format": ds.format_name,
        "samples": len(ds),
        "files": len(files),
        "bytes": sum(os.path.getsize(f) for f in files),
    }
    info.update(format_details(ds))
    if len(ds):
        first = _materialize(ds[0])
        if isinstance(first, dict):
            info["fields"] = {k: _describe(v) for k, v in first.items()}
    info["shards"] = [{"file": os.path.relpath(f, path if os.path.isdir(path) else os.path.dirname(path)),
                       "bytes": os.path.getsize(f)} for f in files]
    return info


def cmd_inspect(args: argparse.Namespace) -> int:
    from torchforge.checkpoint.inspect import checkpoint_info, is_checkpoint
    from torchforge.features.inspect import is_store, store_info  # a feature store is a folder of its own

    if is_remote(args.path):
        info = _remote_info(args.path, args)
    elif is_checkpoint(args.path):
        info = checkpoint_info(args.path)
    else:
        info = store_info(args.path) if is_store(args.path) else _dataset_info(args.path)
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    shards = info.pop("shards")
    for k, v in info.items():
        if isinstance(v, dict):
            print(f"{k}:")
            for kk, vv in v.items():
                print(f"  {kk}: {vv}")
        else:
            print(f"{k}: {v}")
    print("shard files:")
    for s in shards[: args.max_shards]:
        print(f"  {s['file']}  {s['bytes']:,} bytes")
    if len(shards) > args.max_shards:
        print(f"  ... {len(shards) - args.max_shards} more")
    return 0


def verify_dataset(path: str, *, notes: list[str] | None = None, **remote: Any) -> tuple[int, list[str]]:
    """Open ``path`` and decode every sample; run the format's own checks (checksums) where it has them.

    A URL is read whole shard by shard (``mode="shards"``): each shard's size and the hashes index.json
    records are checked as it is fetched (a bad shard is one problem naming its URL, its samples are
    not decoded), then every sample of the good shards is decoded.

    Args:
        path: a dataset folder or file, a feature store, or a dataset URL.
        notes: where given, what the checks could not cover is appended to it (shards no checksum covers,
            in which a changed byte is found only if it no longer decodes).
        **remote: for a URL, ``cache_dir``, ``cache_limit``, ``storage_options`` (``mode`` must be
            ``"shards"``).

    Returns:
        (samples checked, problems), each problem naming the file (or URL) and byte offset.
    """
    from torchforge.datasets.base import open_dataset
    from torchforge.features.inspect import is_store, verify_store

    if is_remote(path):
        return _verify_remote(path, remote, notes)
    if is_store(path):  # a feature store: every version's manifest, digests and index
        return verify_store(path)
    problems: list[str] = []
    try:
        ds = open_dataset(path)
        problems += [str(p) for p in format_checks(ds)]
    except TorchforgeError as e:
        return 0, [str(e)]
    _note_unhashed(ds, notes)
    checked = 0
    for i in range(len(ds)):
        try:
            _materialize(ds[i])
            checked += 1
        except TorchforgeError as e:
            problems.append(f"sample {i}: {e}")
    return checked, problems


def _note_unhashed(ds: Any, notes: list[str] | None) -> None:
    from torchforge._inspect import unhashed_shards

    bare, n = unhashed_shards(ds)
    if notes is not None and bare:
        notes.append(f"{bare} of {n} shards carry no checksum this machine can compute ({ds.format_name}"
                     f"{': no hashes, or of unknown algorithms' if ds.format_name == 'mds' else ' records none'}): "
                     "a changed byte in them is found only where it no longer decodes")


def _verify_remote(url: str, remote: dict[str, Any], notes: list[str] | None = None) -> tuple[int, list[str]]:
    from torchforge.datasets.base import open_dataset
    from torchforge.remote.errors import RemoteCorruptError, RemoteError, RemoteNotFoundError

    if remote.get("mode", "shards") != "shards":
        raise ValueError("verify reads whole shards to check their hashes: mode must be 'shards'")
    def damage(e: TorchforgeError, missing: bool) -> bool:
        """Whether ``e`` says the data is damaged (or, with ``missing``, a shard is missing from it), not
        that the cache, the credentials or the server failed (the command's error, raised)."""
        return not isinstance(e, RemoteError) or isinstance(e, RemoteCorruptError) or (
            missing and isinstance(e, RemoteNotFoundError))

    try:
        ds = open_dataset(url, **{**remote, "mode": "shards"})
    except TorchforgeError as e:
        if not damage(e, missing=False):  # (no dataset at the URL is not damage either)
            raise
        return 0, [str(e)]
    _note_unhashed(ds, notes)
    problems: list[str] = []
    checked = first = 0
    for k in range(len(ds._first) - 1):
        end = ds._first[k + 1]
        try:
            ds._shard(k)  # fetched whole: size (and the hashes index.json records) checked
        except TorchforgeError as e:
            if not damage(e, missing=True):
                raise
            problems.append(str(e))
            first = end
            continue
        for i in range(first, end):
            try:
                _materialize(ds[i])
                checked += 1
            except TorchforgeError as e:
                problems.append(f"sample {i}: {e}")
        first = end
    return checked, problems


def cmd_verify(args: argparse.Namespace) -> int:
    if is_remote(args.path) and args.mode not in (None, "shards"):
        print("torchforge verify: a URL is verified whole shard by shard (its hashes): use --mode shards",
              file=sys.stderr)
        return 2
    from torchforge.checkpoint.inspect import is_checkpoint, verify_checkpoint
    from torchforge.features.inspect import is_store

    notes: list[str] = []
    local = not is_remote(args.path)
    if local and is_checkpoint(args.path):  # every block digest of every step
        checked, problems = verify_checkpoint(args.path)
        what = "checkpoint steps checked"
    else:
        if local and not os.path.exists(local_path(args.path)):  # a typo, not damage: the command's error
            raise NotFoundError("no such file or folder", path=local_path(args.path))
        checked, problems = verify_dataset(args.path, notes=notes, **_remote_options(args))
        what = "rows checked over every version" if local and is_store(args.path) else "samples decoded"
    for p in problems:
        print(f"DAMAGED {p}")
    for note in notes:
        print(f"NOTE {note}")
    print(f"{args.path}: {checked} {what}, {len(problems)} problems")
    return 1 if problems else 0


def cmd_bench(args: argparse.Namespace) -> int:
    import numpy as np

    ds = _open(args.path, args)
    n = min(len(ds), args.limit) if args.limit else len(ds)
    field = args.field
    rows = []

    if field is not None and n and field not in ds[0]:
        raise TorchforgeError(f"--field {field!r}: sample 0 has no such field (it has {sorted(ds[0])})",
                              path=args.path)

    def run(name: str, order: Sequence[int] | np.ndarray, setup_s: float = 0.0) -> None:
        t0 = time.perf_counter()
        for i in order:
            s = ds[int(i)]
            if field is not None:
                s[field]
        dt = time.perf_counter() - t0 + setup_s
        rows.append((name, len(order), len(order) / max(dt, 1e-9)))

    run("iterate", range(n))
    rng = np.random.default_rng(args.seed)
    run("shuffle", rng.permutation(len(ds))[:n])
    if args.sort_key:
        t0 = time.perf_counter()
        try:
            keys = ds.keys(args.sort_key, cache=False)
        except KeyError as e:  # a sample without the field: the dataset's own words, on one line
            raise TorchforgeError(f"--sort-key {args.sort_key!r}: {e.args[0] if e.args else e}",
                                  path=args.path) from None
        order = np.argsort(keys, kind="stable")[:n]
        run("sort", order, setup_s=time.perf_counter() - t0)  # the key pass counts
    print(f"{args.path} ({ds.format_name}, {len(ds)} samples)")
    for name, cnt, rate in rows:
        print(f"  {name:8s} {cnt:>9d} samples  {rate:>12,.0f} samples/s")
    return 0


def _url_options() -> argparse.ArgumentParser:
    """The options every subcommand takes for a dataset at a URL."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("datasets at a URL (s3://, gs://, az://, http(s):// read-only, file://)")
    g.add_argument("--cache-dir", help="the node-local cache folder (default: the per-user cache folder)")
    g.add_argument("--cache-limit", help="the most bytes the cache may hold, e.g. 50GB (default: no limit)")
    g.add_argument("--mode", choices=["shards", "ranges"],
                   help="shards: fetch whole shards on first use (default); ranges: read samples as byte "
                        "ranges")
    g.add_argument("--storage-option", action="append", default=[], type=_key_value, metavar="KEY=VALUE",
                   help="a store option, repeatable: endpoint=..., region=..., anonymous=true, "
                        "allow_http=true, access_key_id=...; AWS_* variables apply too")
    return p


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchforge", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    url = [_url_options()]

    c = sub.add_parser("convert", parents=url, help="convert JSONL/Parquet/JINX/MDS/safetensors into another "
                                                     "format (DST may be a URL)")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--to", required=True, choices=["jinx", "mds", "safetensors"])
    c.add_argument("-o", "--option", action="append", default=[], type=_key_value, metavar="KEY=VALUE",
                   help="a writer option, e.g. -o compression=zst -o shard_size=67108864 (jinx; "
                        "mds: size_limit, hashes=sha1,xxh64; safetensors: max_shard_size)")
    c.add_argument("--columns", help="MDS columns as JSON, e.g. '{\"id\": \"int\"}' (default: inferred)")
    c.add_argument("--overwrite", action="store_true", help="replace DST if it exists (a URL: its objects)")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser("inspect", parents=url,
                       help="format, shards, sample count, fields and their encodings (a dataset, a feature "
                            "store, a checkpoint folder)")
    i.add_argument("path")
    i.add_argument("--json", action="store_true")
    i.add_argument("--max-shards", type=_count, default=10, help="shards listed (default: 10)")
    i.set_defaults(func=cmd_inspect)

    v = sub.add_parser("verify", parents=url,
                       help="check every footer, index, offset, sidecar range and checksum (a dataset, a "
                            "feature store, every step of a checkpoint folder)")
    v.add_argument("path")
    v.set_defaults(func=cmd_verify)

    b = sub.add_parser("bench", parents=url, help="iterate, shuffle and sort samples/s on your own data")
    b.add_argument("path")
    b.add_argument("--field", help="field to touch in each sample (default: none)")
    b.add_argument("--sort-key", help="field to sort by (default: no sort pass)")
    b.add_argument("--limit", type=_count, default=0, help="samples per pass (default: 0, all)")
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    if isinstance(getattr(args, "path", None), str):
        args.path = local_path(args.path)
    try:
        return args.func(args)
    except (TorchforgeError, ValueError, OSError) as e:  # bad data, options or paths: one line, no traceback
        print(f"torchforge {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: what was being written is cleaned up already (a convert's stage)
        print(f"torchforge {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
