"""Remote URLs and the object-store configuration they open with.

Schemes: ``s3://bucket/key``, ``gs://bucket/key``, ``az://container/key`` (the account comes from
``storage_options`` or ``AZURE_STORAGE_ACCOUNT_NAME``), ``http://`` and ``https://`` (read-only) and
``file://``. :func:`store_spec` turns a URL and ``storage_options`` into a :class:`StoreSpec`: a plain,
picklable description that the fetcher process (:mod:`torchforge.remote.fetcher`) opens with obstore.
Nothing here imports obstore: the caller's process must never start obstore's runtime (see fetcher.py).

``storage_options`` keys, the same for every scheme where they apply: ``endpoint``, ``region``,
``access_key_id``, ``secret_access_key``, ``session_token``, ``anonymous`` (send unsigned requests),
``allow_http``; ``client_options`` (obstore's: ``timeout``, ``connect_timeout``, proxies); the retry
budget of transient failures (5xx, 429, timeouts, resets, truncated bodies), ``max_retries`` (default 6,
full-jitter backoff: at most 3.2 s in all, 1.6 s on average) and ``retry_timeout`` (seconds: go on retrying until that long has passed
since the first attempt, as many times as it takes unless ``max_retries`` is also given), for a job that
should wait out an outage of the store rather than stop. A request times out after 15 s when it moves no
data (HEAD, LIST, DELETE) and after 120 s when it does (``client_options["timeout"]`` sets both), and
attempts that time out are retried twice at most unless ``retry_timeout`` is given: an endpoint that takes
connections and never answers is an error within a minute; any other key is passed to obstore's store config
as it is (``role_arn``, ``account_name``, ``service_account_path``, ...).

For S3 the standard environment variables are read in the caller's process, when the URL is resolved,
as the AWS SDK reads them: ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``), ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION`` (or ``AWS_DEFAULT_REGION``),
``AWS_ALLOW_HTTP=true`` and ``AWS_SKIP_SIGNATURE=true``; ``storage_options`` win over them. A dataset on
any S3-compatible server (MinIO, Ceph, a local test server) thus opens with no code change. GCS and Azure
read their own variables (``GOOGLE_APPLICATION_CREDENTIALS``, ``AZURE_STORAGE_*``) in the fetcher process,
which inherits the environment of the process that starts it.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = ["DEFAULT_RETRIES", "REMOTE_SCHEMES", "SCHEMES", "StoreSpec", "is_remote", "local_path", "split_url",
           "store_spec"]

DEFAULT_RETRIES = 6  # retries of a transient failure when storage_options set no budget

REMOTE_SCHEMES = ("s3", "gs", "az", "http", "https")
SCHEMES = (*REMOTE_SCHEMES, "file")
_ALIASES = {"s3a": "s3", "gcs": "gs", "azure": "az", "abfs": "az", "abfss": "az"}
_TRUE = {"1", "true", "yes", "on"}


def _scheme(path: Any) -> str | None:
    if not isinstance(path, str) or "://" not in path:
        return None
    scheme = path.split("://", 1)[0].lower()
    return _ALIASES.get(scheme, scheme)


def is_remote(path: Any) -> bool:
    """Whether ``path`` is a URL read through the object-store client (every scheme but ``file://``).

    >>> is_remote("s3://bucket/data"), is_remote("/data"), is_remote("file:///data")
    (True, False, False)
    """
    return _scheme(path) in REMOTE_SCHEMES


def local_path(path: Any) -> Any:
    """The local path a ``file://`` URL names (``file:///abs``, ``file://localhost/abs``, any case of the
    scheme, percent-escapes decoded); anything else is returned as it is."""
    if _scheme(path) != "file":
        return path
    return "/" + split_url(path)[2]


@dataclass(frozen=True)
class StoreSpec:
    """How to open the store that holds one object: plain values only, so it crosses processes.

    ``kind`` is the scheme; ``root`` the bucket / container / ``scheme://host`` (``/`` for ``file``);
    ``config`` the obstore store config; ``client`` its client options; ``max_retries`` and
    ``retry_timeout`` the retry budget of a transient failure (None: no bound of that kind).
    """

    kind: str
    root: str
    config: tuple[tuple[str, Any], ...] = ()
    client: tuple[tuple[str, Any], ...] = field(default=())
    max_retries: int | None = DEFAULT_RETRIES
    retry_timeout: float | None = None


def split_url(url: str) -> tuple[str, str, str]:
    """``(scheme, root, key)`` of a URL: ``s3://b/a/x.mds`` -> ``("s3", "b", "a/x.mds")``.

    Raises:
        ValueError: not a URL of one of :data:`SCHEMES`, or no object key.
    """
    scheme = _scheme(url)
    if scheme not in SCHEMES:
        raise ValueError(f"{url!r} is not a URL with one of the schemes {list(SCHEMES)}")
    parts = urlsplit(url)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"{url!r}: a file:// URL names a local path (file:///abs/path)")
        return scheme, "/", unquote(parts.path).lstrip("/")
    if scheme in ("http", "https"):
        if not parts.netloc:
            raise ValueError(f"{url!r} has no host")
        return scheme, f"{scheme}://{parts.netloc}", unquote(parts.path).lstrip("/")
    # an object store key is taken as it is written, as the cloud CLIs take it: '#', '?' and '%' are
    # characters of the key (no fragment, no query, no percent-decoding)
    bucket, _, key = url.split("://", 1)[1].partition("/")
    key = key.lstrip("/")
    if not bucket or not key:
        raise ValueError(f"{url!r} must name a bucket and an object: {scheme}://bucket/path/to/object")
    return scheme, bucket, key


def _s3_env() -> dict[str, Any]:
    env = os.environ
    out: dict[str, Any] = {}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    for key, value in (("endpoint", endpoint), ("access_key_id", env.get("AWS_ACCESS_KEY_ID")),
                       ("secret_access_key", env.get("AWS_SECRET_ACCESS_KEY")),
                       ("session_token", env.get("AWS_SESSION_TOKEN")),
                       ("region", env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"))):
        if value:
            out[key] = value
    if env.get("AWS_ALLOW_HTTP", "").lower() in _TRUE:
        out["allow_http"] = True
    if env.get("AWS_SKIP_SIGNATURE", "").lower() in _TRUE:
        out["anonymous"] = True
    return out


def store_spec(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[StoreSpec, str]:
    """The store holding ``url`` and the object's key in it.

    Args:
        url: the object's URL.
        storage_options: see the module docstring; None for none.

    Raises:
        ValueError: a bad URL, or ``storage_options`` that is not a mapping of strings.
    """
    scheme, root, key = split_url(url)
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise ValueError(f"storage_options={storage_options!r} must be a dict such as "
                         "{'endpoint': 'http://127.0.0.1:9000', 'anonymous': True}")
    opts: dict[str, Any] = _s3_env() if scheme == "s3" else {}
    opts.update(storage_options or {})
    odd = [k for k in opts if not isinstance(k, str)]
    if odd:
        raise ValueError(f"storage_options keys must be strings, not {odd!r}")
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    if opts.pop("allow_http", False) in (True, "true", "True", "1"):
        client["allow_http"] = True
    if opts.pop("anonymous", False) in (True, "true", "True", "1"):
        config["skip_signature"] = True
    if "endpoint" in opts and not str(opts["endpoint"]).lower().startswith(("http://", "https://")):
        raise ValueError(f"storage_options endpoint={opts['endpoint']!r} must be a URL starting with http:// or "
                         "https:// (e.g. 'http://127.0.0.1:9000')")
    if ("endpoint" in opts and str(opts["endpoint"]).startswith("http://")) or scheme == "http":
        client["allow_http"] = True  # an explicit http:// endpoint or URL says so (a local test server)
    extra = opts.pop("client_options", None)  # obstore's client options (timeouts, proxies), any scheme
    if extra is not None and not isinstance(extra, Mapping):
        raise ValueError(f"storage_options['client_options']={extra!r} must be a dict such as {{'timeout': '30s'}}")
    client.update(extra or {})
    retries, timeout = _retry_budget(opts.pop("max_retries", None), opts.pop("retry_timeout", None))
    config.update(opts)
    if scheme in ("http", "https", "file"):
        config = {}
    return StoreSpec(scheme, root, tuple(sorted(config.items())), tuple(sorted(client.items())),
                     retries, timeout), key


def _retry_budget(retries: Any, timeout: Any) -> tuple[int | None, float | None]:
    """``(max_retries, retry_timeout)`` of a :class:`StoreSpec` from the ``storage_options`` values (None:
    not given); ValueError for a value that is not a count or a duration."""
    if retries is not None:
        if isinstance(retries, bool) or not isinstance(retries, (int, str)) or not str(retries).isdigit():
            raise ValueError(f"storage_options['max_retries']={retries!r} must be a count of retries (0 or more)")
        retries = int(retries)
    if timeout is not None:
        try:
            seconds = float(timeout)
        except (TypeError, ValueError):
            seconds = -1.0
        if isinstance(timeout, bool) or not 0 < seconds < float("inf"):
            raise ValueError(f"storage_options['retry_timeout']={timeout!r} must be a number of seconds > 0")
        return retries, seconds
    return (DEFAULT_RETRIES if retries is None else retries), None
