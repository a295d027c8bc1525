"""A training loop over a remote MDS dataset that records, after every batch, the ids it read and the
loader's state, atomically (tests/test_remote.py kills it mid-download and starts it again).

    python remote_resume.py URL CACHE_DIR ENDPOINT RECORD
"""
from __future__ import annotations

import os
import pickle
import sys

import torchforge
from torchforge.sampler import GlobalSampler


def blob(i: int) -> bytes:
    return bytes([i % 251]) * (40_000 + 997 * i)


def main() -> None:
    url, cache, endpoint, record = sys.argv[1:5]
    ds = torchforge.open_dataset(url, cache_dir=cache, storage_options={"endpoint": endpoint})
    loader = torchforge.DataLoader(ds, batch_size=4, sampler=GlobalSampler(len(ds), seed=3), num_workers=0,
                                   collate_fn=lambda b: [(int(s["id"]), bytes(s["blob"])) for s in b])
    ids: list[int] = []
    if os.path.exists(record):
        with open(record, "rb") as f:
            saved = pickle.load(f)
        ids = saved["ids"]
        loader.load_state_dict(saved["state"])
    for batch in loader:
        for i, b in batch:
            if b != blob(i):
                raise SystemExit(f"sample {i} read wrong bytes")
        ids += [i for i, _ in batch]
        with open(record + ".tmp", "wb") as f:
            pickle.dump({"ids": ids, "state": loader.state_dict()}, f)
        os.replace(record + ".tmp", record)
    with open(record + ".done", "w") as f:
        f.write("ok")


if __name__ == "__main__":
    main()
