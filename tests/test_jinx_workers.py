"""JinxDataset in torch DataLoader worker processes (fork and spawn): lazy samples arrive materialized."""
from __future__ import annotations

import multiprocessing as mp

import pytest
import torch.utils.data
from expected import rich, same

from torchforge.datasets.jinx import JinxDataset
from torchforge.formats.jinx import JinxWriter


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("workers") / "ds"
    with JinxWriter(path, encoding="b64", binary_threshold=256, shard_size=40_000) as w:
        for s in rich(64, 9, tensors=True):
            w.write(s)
    return path


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers(folder, context):
    if context not in mp.get_all_start_methods():
        pytest.skip(f"start method {context} not available on this platform")
    expected = list(rich(64, 9, tensors=True))
    ds = JinxDataset(folder)
    assert len(ds.shards) > 1
    _ = ds[0]["image"]  # the parent has its maps open (fork inherits them, spawn re-opens)
    loader = torch.utils.data.DataLoader(ds, batch_size=5, num_workers=2, collate_fn=list,
                                         multiprocessing_context=context, shuffle=False)
    got = [s for batch in loader for s in batch]
    assert len(got) == len(expected)
    for exp, s in zip(expected, got):
        assert type(s) is dict and type(s["meta"]) is dict and type(s["image"]) is bytes
        assert same(exp, s) == ""


def _worker(ds, indices, queue, done):
    queue.put([ds[i] for i in indices])
    done.wait(60)  # torch shares tensors through this process's fds: stay until the parent has them


def test_dataset_and_samples_through_a_spawned_process(folder):
    ctx = mp.get_context("spawn")
    ds = JinxDataset(folder)
    queue, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_worker, args=(ds, [3, 40, 63], queue, done))
    proc.start()
    got = queue.get(timeout=120)
    done.set()
    proc.join(60)
    assert proc.exitcode == 0
    expected = list(rich(64, 9, tensors=True))
    assert [same(expected[i], s) for i, s in zip([3, 40, 63], got)] == ["", "", ""]
