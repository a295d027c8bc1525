"""A local S3 for benchmarks: moto's server on 127.0.0.1 counting, per verb, the requests it serves and the
response body bytes it sends (GETs and their bytes are what a reader fetched).

(A counting HTTP proxy in front of moto, tried first, stalled MosaicML Streaming's boto3 downloads for its
60 s read timeout and once left it a corrupt shard; counting inside the server has no extra hop.)
"""
from __future__ import annotations

import logging
import os
import threading

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
               "AWS_DEFAULT_REGION": "us-east-1"}


def serve_ranges_in_place() -> None:
    """Make moto's range GETs cost the range, not the object, as S3's do.

    moto 5 reads an object's whole value from its spooled temporary file for every GET and then slices the
    range out (``FakeKey.value``, ``S3Response._handle_range_header``): a 100 kB range of a 64 MiB object
    took ~38 ms, a whole 64 MiB GET ~107 ms, so a reader of ranges (torchforge ``mode="ranges"``, and
    Streaming's boto3, which downloads a shard as 8 MiB ranged GETs) would pay for the object on each one.
    Here each object's value is read once and kept (bytes, immutable; a new value drops it), so a range GET
    copies only its range. Patches this process's moto only.
    """
    from moto.s3.models import FakeKey

    prop = FakeKey.__dict__["value"]
    if getattr(prop.fget, "_kept", False):
        return

    def get(self):
        v = self.__dict__.get("_bench_value")
        if v is None:
            v = self.__dict__["_bench_value"] = prop.fget(self)
        return v

    def put(self, new_value) -> None:
        self.__dict__.pop("_bench_value", None)
        prop.fset(self, new_value)

    get._kept = True  # type: ignore[attr-defined]
    FakeKey.value = property(get, put)


class LocalS3:
    """moto's server on a free port of 127.0.0.1 (as ``ThreadedMotoServer``, range GETs served in place, see
    :func:`serve_ranges_in_place`), its WSGI app wrapped in a counter of requests and response body bytes
    per verb: every reader talks to ``url`` directly and what it fetched is counted where it is served."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        serve_ranges_in_place()
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.body_bytes: dict[str, int] = {}
        app = DomainDispatcherApplication(create_backend_app)

        def counted(environ, start_response):
            method, sent = environ["REQUEST_METHOD"], 0
            if method == "GET" and "list-type=" in environ.get("QUERY_STRING", ""):
                method = "LIST"  # a listing (metadata, like a HEAD): not an object GET, its XML not object bytes
            body = app(environ, start_response)
            try:
                for chunk in body:
                    sent += len(chunk)
                    yield chunk
            finally:
                close = getattr(body, "close", None)
                if close is not None:
                    close()
                with self.lock:
                    self.requests[method] = self.requests.get(method, 0) + 1
                    self.body_bytes[method] = self.body_bytes.get(method, 0) + (sent if method != "HEAD" else 0)

        self.server = make_server("127.0.0.1", 0, counted, True, request_handler=MotoRequestHandler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True, name="local-s3").start()

    def counts(self) -> tuple[int, int, int, int]:
        """(object GET requests, their body bytes, other requests: HEAD, LIST, ..., the LISTs' body bytes)
        so far."""
        with self.lock:
            gets = self.requests.get("GET", 0)
            return (gets, self.body_bytes.get("GET", 0), sum(self.requests.values()) - gets,
                    self.body_bytes.get("LIST", 0))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name=CREDENTIALS["AWS_REGION"],
                        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])


def upload_folder(endpoint: str, folder: str, bucket: str, prefix: str) -> int:
    """Every file of ``folder`` to ``s3://bucket/prefix/`` (index.json last); returns the bytes uploaded."""
    client = s3_client(endpoint)
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    names = sorted(os.listdir(folder), key=lambda n: (n == "index.json", n))
    total = 0
    for name in names:
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=f)
        total += os.path.getsize(path)
    return total
