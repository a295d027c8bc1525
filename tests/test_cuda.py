"""CUDA paths: the loader's device stage and pinned batches, checkpoints and the feature store with device
tensors. Every test here needs a CUDA device and is skipped with that reason on a machine without one."""
from __future__ import annotations

from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from torchforge.loader import DataLoader

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

Pair = namedtuple("Pair", "x y")


class Rows(Dataset):
    """Sample i: a 4 KiB float32 row filled with i, its id, a namedtuple and an OrderedDict."""

    def __init__(self, n: int, width: int = 1024):
        self.n, self.width = n, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        row = torch.full((self.width,), float(i))
        return {"id": i, "row": row, "pair": Pair(torch.tensor(i), np.int64(2 * i)),
                "od": OrderedDict(a=torch.tensor([i, i]))}


def _check(batch, ids: list[int], width: int) -> None:
    want = torch.tensor(ids, dtype=torch.float32, device=batch["row"].device)
    assert torch.equal(batch["row"], want[:, None].expand(-1, width))
    assert torch.equal(batch["id"].cpu(), torch.tensor(ids))
    assert isinstance(batch["pair"], Pair) and isinstance(batch["od"], OrderedDict)
    assert torch.equal(batch["pair"].y.cpu(), 2 * torch.tensor(ids))


@pytest.mark.parametrize("workers", [0, 2])
def test_device_batches_keep_container_types_and_values(workers):
    n, bs = 96, 8
    for b, start in zip(DataLoader(Rows(n), bs, num_workers=workers, device="cuda"), range(0, n, bs)):
        assert b["row"].is_cuda and b["pair"].x.is_cuda and b["od"]["a"].is_cuda
        _check(b, list(range(start, start + bs)), 1024)


@pytest.mark.parametrize("workers", [0, 2])
def test_copies_are_correct_while_the_step_keeps_the_device_busy(workers):
    """The copy of batch k+1 overlaps batch k's step, and slabs are recycled: a batch read after a long
    kernel on the consumer's stream still holds its own rows (no slab reused under an unfinished copy,
    no tensor freed to the caching allocator while the consumer's stream still reads it)."""
    n, bs, width = 2048, 64, 16384  # 4 MiB batches
    total = 0
    for k, b in enumerate(DataLoader(Rows(n, width), bs, num_workers=workers, device="cuda", prefetch_factor=2
                                     if workers else None)):
        torch.cuda._sleep(2_000_000)  # ~1 ms of device time queued before this batch is read
        b["row"].mul_(1.0)  # the step writes into the batch on the current stream
        ids = list(range(k * bs, (k + 1) * bs))
        _check(b, ids, width)
        total += len(ids)
    assert total == n


@pytest.mark.parametrize("workers", [0, 2])
def test_with_cuda_a_batch_comes_out_before_the_next_ones_error(workers):
    class FailsAt(Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            if i == 12:
                raise ValueError("bad 12")
            return torch.tensor(i)

    seen = []
    with pytest.raises(ValueError, match="bad 12"):
        for b in DataLoader(FailsAt(), batch_size=4, num_workers=workers, device="cuda"):
            assert b.is_cuda
            seen.append(b.tolist())
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.mark.parametrize("workers", [0, 2])
def test_pin_memory_pins_every_tensor_and_keeps_types(workers):
    for b in DataLoader(Rows(16), 4, num_workers=workers, pin_memory=True):
        assert b["row"].is_pinned() and b["id"].is_pinned() and b["pair"].x.is_pinned()
        assert isinstance(b["pair"], Pair) and isinstance(b["od"], OrderedDict) and b["od"]["a"].is_pinned()


def test_device_loader_resumes_mid_epoch_with_the_same_batches():
    def run(loader, stop=None):
        out = []
        for i, b in enumerate(loader):
            out.append(b["id"].tolist())
            if stop is not None and i + 1 == stop:
                break
        return out

    from torchforge.sampler import GlobalSampler

    full = run(DataLoader(Rows(80), 8, sampler=GlobalSampler(80, seed=5), num_workers=2, device="cuda"))
    first = DataLoader(Rows(80), 8, sampler=GlobalSampler(80, seed=5), num_workers=2, device="cuda")
    head = run(first, stop=4)
    state = first.state_dict()
    second = DataLoader(Rows(80), 8, sampler=GlobalSampler(80, seed=5), num_workers=2, device="cuda")
    second.load_state_dict(state)
    assert head + run(second) == full


def test_feature_store_takes_device_tensors_and_returns_them_exactly(tmp_path):
    from torchforge.features import FeatureStore

    store = FeatureStore(tmp_path / "fs", {"emb": ((8,), torch.float16), "loss": ((), torch.float32)}, create=True)
    ids = torch.arange(0, 1000, 3, device="cuda")
    emb = torch.randn(len(ids), 8, device="cuda", dtype=torch.float16)
    loss = torch.rand(len(ids), device="cuda")
    w = store.writer()
    w.write(ids, emb=emb, loss=loss)
    assert w.commit() == store.version
    w.close()
    got = FeatureStore(tmp_path / "fs").get(ids.flip(0))
    assert torch.equal(got["emb"], emb.flip(0).cpu()) and torch.equal(got["loss"], loss.flip(0).cpu())


def test_checkpoint_of_a_cuda_model_blocking_save_verifies_and_restores_onto_the_device(tmp_path):
    from torchforge.checkpoint import Checkpointer

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.GELU(), torch.nn.Linear(200, 7)).cuda()
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(16, 300, device="cuda")).sum().backward()
    opt.step()
    ck = Checkpointer(tmp_path)
    ck.save(3, model=m, optimizer=opt)
    ck.verify(3)
    fresh = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.GELU(), torch.nn.Linear(200, 7)).cuda()
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    ck.restore(3, model=fresh, optimizer=fresh_opt)
    for (k, a), b in zip(m.state_dict().items(), fresh.state_dict().values()):
        assert b.is_cuda and torch.equal(a, b), k
    for s, t in zip(opt.state.values(), fresh_opt.state.values()):
        assert torch.equal(s["exp_avg_sq"], t["exp_avg_sq"]) and t["exp_avg_sq"].is_cuda


class _CollectsGarbage(Dataset):
    """Runs the garbage collector in the worker, as any allocation-heavy worker eventually does."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        import gc

        gc.collect()
        return i


def test_a_torch_loader_forked_after_a_device_epoch_does_not_free_device_tensors_in_its_workers():
    """A forked child that frees a CUDA tensor aborts. An ended device iterator must leave none of its
    batches in a reference cycle that the child's collector would free."""
    import gc

    gc.collect()
    gc.disable()  # the cycle, if any, must still exist when the workers fork
    try:
        for _ in DataLoader(Rows(64), 8, num_workers=2, device="cuda"):
            pass
        for _ in range(2):
            assert sum(len(b) for b in torch.utils.data.DataLoader(_CollectsGarbage(), 4, num_workers=2)) == 16
    finally:
        gc.enable()


def test_dropped_device_iterators_unregister_their_slabs(caplog):
    """Each iterator page-locks its slab mappings; one dropped mid-epoch (not closed) must unregister
    them before they are unmapped, or a later mapping at the same address cannot be page-locked."""
    import gc
    import logging

    caplog.set_level(logging.WARNING, logger="torchforge.loader.device")
    for k in range(6):
        it = iter(DataLoader(Rows(256, 4096), 16, num_workers=2, device="cuda"))
        for _ in range(3 + k):
            next(it)
        del it
        gc.collect()
    assert not [r for r in caplog.records if "cudaHostRegister" in r.getMessage()]
    _check(next(iter(DataLoader(Rows(64, 4096), 8, num_workers=2, device="cuda"))), list(range(8)), 4096)
