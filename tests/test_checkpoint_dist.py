"""Distributed checkpoints (issue 14): real gloo process groups in spawned processes, FSDP2 ``fully_shard`` on a
CPU device mesh and DDP, uneven shapes (7x5, 1-element, 0-dim ``step``). Save at world size 2; restore at
3, 4 and 1 (a plain process, no process group), across DDP <-> FSDP2; exact equality of every parameter and
optimizer state tensor; training continues bitwise; bytes written and read; ranks killed mid-save."""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _forkserver import fork_server, start_ranks
from safetensors.torch import load_file, save_file

from torchforge.checkpoint import Checkpointer
from torchforge.checkpoint.writer import CRASH_AT
from torchforge.errors import CheckpointError

pytest.importorskip("torch.distributed.fsdp")
if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(5, 7)  # weight 7x5: uneven over 2, 3 and 4 ranks
        self.b = torch.nn.Linear(7, 1)  # a 1-element bias
        self.c = torch.nn.Linear(7, 13, bias=False)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.b(h) * self.scale + self.c(h).mean()


def _build(kind: str, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = Net()
    if kind in ("fsdp", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # HSDP: a 2D mesh, replicated across its first dim and sharded across its second
        mesh = (init_device_mesh("cpu", (world,)) if kind == "fsdp"
                else init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")))
        fully_shard(m.a, mesh=mesh)
        fully_shard(m, mesh=mesh)
    elif kind == "ddp":
        m = torch.nn.parallel.DistributedDataParallel(m)
    return m, torch.optim.AdamW(m.parameters(), lr=0.01)


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer, first: int, last: int, rank: int) -> None:
    for s in range(first, last):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1000 * s + rank))
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()


def _full(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and optimizer state tensor, whole (a collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    out = {f"model.{k}": v.detach().clone() for k, v in get_model_state_dict(m, options=opts).items()}
    osd = get_optimizer_state_dict(m, opt, options=opts)
    for fqn, entry in osd["state"].items():
        for k, v in entry.items():
            out[f"optim.{fqn}.{k}"] = v.detach().clone().reshape(v.shape)
    return {k: v.contiguous() for k, v in out.items()}


def _rank_main(rank: int, world: int, init: str, job: dict) -> None:
    if job.get("crash_rank") == rank:
        os.environ[CRASH_AT] = job["crash_at"]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    result: dict = {"rank": rank}
    code = 0
    try:
        m, opt = _build(job["kind"], world)
        ck = Checkpointer(job["root"], timeout=job.get("timeout", 60), max_shard_size=job.get("shard", "2GB"))
        if job["phase"] == "save":
            _train(m, opt, 0, job["steps"], rank)
            if job.get("fail_rank") == rank:  # this rank's data writes fail (a full disk)
                import torchforge.checkpoint.distributed as dmod

                def enospc(*a, **k):
                    raise OSError(28, "No space left on device (injected)")

                dmod.write_files = enospc
            for step in job.get("save_at", [job["steps"]]):
                ck.save(step, model=m, optimizer=opt, extra={"epoch": 1, "t": torch.arange(3)},
                        rank_state={"rank": rank, "rng": torch.get_rng_state()}, export_to=job.get("export"))
        elif job["phase"] == "restore":
            extra = ck.restore(model=m, optimizer=opt)
            result["extra"] = [extra["epoch"], extra["t"].tolist()]
            result["read"] = ck.last_restore
            try:
                result["rank_state"] = ck.rank_state()["rank"]
            except CheckpointError as e:
                result["rank_state_error"] = str(e)
            _train(m, opt, job["steps"], job.get("more", job["steps"]), rank)
        elif job["phase"] == "async":  # many non-blocking saves of a larger model: memory stays flat
            big = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
            if job["kind"] == "fsdp":
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import fully_shard

                fully_shard(big, mesh=init_device_mesh("cpu", (world,)))
            bopt = torch.optim.AdamW(big.parameters(), lr=0.01)
            big(torch.randn(2, 1024)).sum().backward()
            bopt.step()
            ck = Checkpointer(job["root"], keep_last=2, timeout=60)
            rss = []
            for step in range(int(os.environ.get("TF_TEST_SAVES", "20"))):
                ck.save(step, model=big, optimizer=bopt, blocking=False)
                with torch.no_grad():  # the state may change as soon as save returns
                    for p in big.parameters():
                        p.add_(1.0)
                ck.wait()
                with open("/proc/self/statm") as f:
                    rss.append(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
            result["rss"] = rss
            result["state_bytes"] = sum(p.numel() * 4 * 3 for p in big.parameters())  # params + 2 AdamW
            full = {k: v.contiguous() for k, v in _full(big, bopt).items()}
            if rank == 0:
                save_file(full, os.path.join(job["out"], f"{job['name']}.safetensors"))
            ck.close()
            return
        elif job["phase"] == "replan":  # non-blocking saves while one rank's state changes shape
            ck = Checkpointer(job["root"], keep_last=4, timeout=60)
            for step in range(4):  # rank 1's extra grows at step 2: every rank plans that save again
                full = _full(m, opt)
                if rank == 0:
                    save_file(full, os.path.join(job["out"], f"replan-{step}.safetensors"))
                t = torch.arange(4 if rank == 1 and step >= 2 else 3) + step
                ck.save(step, model=m, optimizer=opt, extra={"epoch": step, "t": t}, blocking=False)
                with torch.no_grad():  # the state may change as soon as save returns
                    for p in m.parameters():
                        p.add_(1.0)
                ck.wait()
        else:  # an uninterrupted run
            _train(m, opt, 0, job["steps"], rank)
        full = _full(m, opt)
        if rank == 0:
            save_file(full, os.path.join(job["out"], f"{job['name']}.safetensors"))
        ck.close()
    except CheckpointError as e:
        result["error"] = str(e)
        result["error_at"] = time.monotonic()
    except BaseException:  # noqa: BLE001 - printed, and the exit code says so
        traceback.print_exc()
        code = 1
    finally:
        with open(os.path.join(job["out"], f"{job['name']}-rank{rank}.json"), "w") as f:
            json.dump(result, f)
        if "crash_rank" not in job:  # every rank done with its collectives before the group goes
            with contextlib.suppress(Exception):
                dist.barrier()
        with contextlib.suppress(Exception):  # a dead peer may break the teardown
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        # gloo's threads can still be winding down at interpreter exit ("terminate called without an active
        # exception", SIGABRT): leave without the C++ static destructors, with this rank's own verdict
        os._exit(code)


def _spawn(world: int, job: dict, tmp_path, timeout: float = 240) -> list[int | None]:
    """Run ``world`` ranks of a job in processes of a fork server that imported torch and torchforge once
    (not a fork of the test process, whose threads a child must not inherit); returns their exit codes."""
    ctx = fork_server(__name__)
    init = f"file://{tmp_path}/store-{job['name']}"
    procs = [ctx.Process(target=_rank_main, args=(r, world, init, job)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def _result(out, name: str, rank: int) -> dict:
    with open(os.path.join(out, f"{name}-rank{rank}.json")) as f:
        return json.load(f)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        assert v.dtype == b[k].dtype and torch.equal(v, b[k]), k


def _restore_plain(root: str) -> tuple[dict[str, torch.Tensor], dict]:
    """World size 1 in this process, no process group: a plain model."""
    m, opt = _build("plain", 1)
    ck = Checkpointer(root)
    extra = ck.restore(model=m, optimizer=opt)
    full = _full(m, opt)
    ck.close()
    return full, {"extra": [extra["epoch"], extra["t"].tolist()], "read": ck.last_restore}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One FSDP2 and one DDP checkpoint, saved at world size 2 after 3 steps."""
    out = tmp_path_factory.mktemp("dist")
    for kind in ("fsdp", "ddp"):
        job = {"kind": kind, "phase": "save", "steps": 3, "root": str(out / f"ck-{kind}"), "out": str(out),
               "name": f"save-{kind}", "export": str(out / f"hf-{kind}")}
        assert _spawn(2, job, out) == [0, 0]
        assert "error" not in _result(out, job["name"], 0)
    return out


@pytest.mark.parametrize("saved_kind", ["fsdp", "ddp"])
@pytest.mark.parametrize(("kind", "world"), [("fsdp", 3), ("ddp", 3), ("fsdp", 4)])
def test_restore_at_another_world_size_and_wrapping_is_exact(saved, saved_kind, kind, world):
    out = saved
    ref = load_file(out / f"save-{saved_kind}.safetensors")
    name = f"restore-{saved_kind}-into-{kind}-{world}"
    job = {"kind": kind, "phase": "restore", "steps": 3, "root": str(out / f"ck-{saved_kind}"), "out": str(out),
           "name": name}
    assert _spawn(world, job, out) == [0] * world
    _same(ref, load_file(out / f"{name}.safetensors"))
    for r in range(world):
        res = _result(out, name, r)
        assert res["extra"] == [1, [0, 1, 2]]
        assert "per-rank state was saved by 2 ranks" in res["rank_state_error"]  # never silently dropped
        # a rank reads the bytes it needs, no others
        assert res["read"]["bytes_read"] <= 1.1 * res["read"]["bytes_needed"], res["read"]


@pytest.mark.parametrize("saved_kind", ["fsdp", "ddp"])
def test_restore_in_a_plain_process_is_exact(saved, saved_kind):
    full, res = _restore_plain(str(saved / f"ck-{saved_kind}"))
    _same(load_file(saved / f"save-{saved_kind}.safetensors"), full)
    assert res["extra"] == [1, [0, 1, 2]] and res["read"]["bytes_read"] == res["read"]["bytes_needed"]


@pytest.mark.parametrize("saved_kind", ["fsdp", "ddp"])
def test_restore_into_an_optimizer_with_other_param_groups_is_an_error_before_anything_changes(saved, saved_kind):
    m, _ = _build("plain", 1)
    params = list(m.parameters())
    two = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=0.01)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"optimizer has groups of sizes \[2, \d+\], the checkpoint \[\d+\]"):
        Checkpointer(str(saved / f"ck-{saved_kind}")).restore(model=m, optimizer=two)
    _same(before, m.state_dict())  # (torch's loader folded the groups into one, silently)


@pytest.mark.parametrize("saved_kind", ["fsdp", "ddp"])
@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_restore_into_a_model_that_does_not_fit_is_an_error_before_anything_changes(saved, saved_kind, change):
    """A later tensor of another shape (the error came after the earlier tensors were copied) or of an
    integer dtype (a float buffer was cast into it: 2.0 -> 2, 1.5 -> 1, silently) is refused first."""
    m, _ = _build("plain", 1)
    if change == "shape":
        m.c = torch.nn.Linear(7, 12, bias=False)  # the last tensor of the model
        match = r"'c.weight' has shape \[13, 7\] in the checkpoint, \[12, 7\] in the model"
    else:
        m.scale = torch.tensor(0, dtype=torch.int64)
        match = r"'scale' is float32 in the checkpoint, int64 in the model"
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(CheckpointError, match=match):
        Checkpointer(str(saved / f"ck-{saved_kind}")).restore(model=m)
    _same(before, m.state_dict())


def test_restore_into_a_meta_model_in_a_plain_process_is_an_error(saved):
    with torch.device("meta"):
        m, _ = _build("plain", 1)
    with pytest.raises(CheckpointError, match=r"meta device.*to_empty"):
        Checkpointer(str(saved / "ck-fsdp")).restore(model=m)


def test_hsdp_saves_each_slice_once_and_restores_at_other_world_sizes_and_layouts(tmp_path):
    """HSDP (2x2 mesh at world size 4) holds each slice on two ranks: one writes it (the step was committed
    with every slice twice, and no restore could read it: 'chunks do not tile the shape')."""
    job = {"kind": "hsdp", "phase": "save", "steps": 3, "root": str(tmp_path / "ck"), "out": str(tmp_path),
           "name": "save-hsdp"}
    assert _spawn(4, job, tmp_path) == [0, 0, 0, 0]
    assert "error" not in _result(tmp_path, "save-hsdp", 0)
    ref = load_file(tmp_path / "save-hsdp.safetensors")
    full, _ = _restore_plain(job["root"])
    _same(ref, full)
    manifest = json.loads((Path(Checkpointer(job["root"]).path(3)) / "manifest.json").read_text())
    for name, entry in manifest["tensors"].items():  # written once: the chunks' elements are the tensor's
        total = 1
        for z in entry["shape"]:
            total *= z
        assert sum(math.prod(c["sizes"]) for c in entry["chunks"]) == total, name
    back = {"kind": "fsdp", "phase": "restore", "steps": 3, "root": job["root"], "out": str(tmp_path),
            "name": "hsdp-into-fsdp-2"}
    assert _spawn(2, back, tmp_path) == [0, 0]
    _same(ref, load_file(tmp_path / "hsdp-into-fsdp-2.safetensors"))


def test_a_save_before_the_first_optimizer_step_leaves_the_optimizer_and_the_training_as_they_were(tmp_path):
    """torch's get_optimizer_state_dict fills a never-stepped optimizer's state by stepping it with lr 0
    (AdamW's step counts became 1, and every later update differed from the run without the save)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def run(save: bool, restore: bool) -> list[float]:
        torch.manual_seed(0)
        m = Net()
        fully_shard(m, mesh=init_device_mesh("cpu", (1,)))
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        ck = Checkpointer(tmp_path / "ck")
        if save:
            ck.save(0, model=m, optimizer=opt)
            assert not opt.state  # still never stepped
        if restore:
            ck.restore(0, model=m, optimizer=opt)
            assert not opt.state
        ck.close()
        losses = []
        for s in range(3):
            x = torch.randn(8, 5, generator=torch.Generator().manual_seed(s))
            opt.zero_grad()
            loss = m(x).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        plain = run(save=False, restore=False)
        assert run(save=True, restore=False) == plain
        assert run(save=False, restore=True) == plain  # the step-0 checkpoint restores a fresh optimizer
    finally:
        dist.destroy_process_group()


class Tied(torch.nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        if tie:
            self.head.weight = self.emb.weight


def test_a_distributed_step_saved_untied_into_a_model_that_ties_the_two_is_an_error(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        Checkpointer(tmp_path / "ck").save(1, model=Tied(tie=False))  # two different values
        Checkpointer(tmp_path / "ck").save(2, model=Tied(tie=True))
    finally:
        dist.destroy_process_group()
    ck = Checkpointer(tmp_path / "ck")
    assert json.loads((Path(ck.path(1)) / "manifest.json").read_text())["world_size"] == 1  # the distributed layout
    with pytest.raises(CheckpointError, match=r"ties 'emb.weight' and 'head.weight'.*different values"):
        ck.restore(1, model=Tied(tie=True))
    ck.restore(1, model=Tied(tie=False))
    ck.restore(2, model=Tied(tie=True))


def test_a_single_process_step_restores_into_a_ddp_model_under_a_process_group(tmp_path):
    torch.manual_seed(0)
    bare = Net()
    Checkpointer(tmp_path / "ck").save(1, model=bare)  # no process group: the single-process layout
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        torch.manual_seed(1)
        ddp = torch.nn.parallel.DistributedDataParallel(Net())  # keys module.a.weight ...
        Checkpointer(tmp_path / "ck").restore(1, model=ddp)
        _same(bare.state_dict(), ddp.module.state_dict())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_training_resumed_at_the_same_world_size_continues_bitwise(saved, kind, tmp_path):
    out = saved
    straight = {"kind": kind, "phase": "train", "steps": 5, "root": str(tmp_path / "unused"), "out": str(out),
                "name": f"straight-{kind}"}
    resumed = {"kind": kind, "phase": "restore", "steps": 3, "more": 5, "root": str(out / f"ck-{kind}"),
               "out": str(out), "name": f"resumed-{kind}"}
    assert _spawn(2, straight, tmp_path) == [0, 0]
    assert _spawn(2, resumed, tmp_path) == [0, 0]
    assert [_result(out, resumed["name"], r)["rank_state"] for r in range(2)] == [0, 1]  # each its own
    _same(load_file(out / f"straight-{kind}.safetensors"), load_file(out / f"resumed-{kind}.safetensors"))


def test_bytes_written_once_and_spread(saved):
    for kind in ("fsdp", "ddp"):
        folder = saved / f"ck-{kind}" / "step-00000003"
        m = json.loads((folder / "manifest.json").read_text())
        assert m["world_size"] == 2 and m["version"] == 2
        unique = 0
        payload = {0: 0, 1: 0}
        for name, e in m["tensors"].items():
            n = 1
            for s in e["shape"]:
                n *= s
            nbytes = n * torch.empty((), dtype=getattr(torch, e["dtype"])).element_size()
            if not name.startswith("extra."):
                unique += nbytes
            covered = 0
            for c in e["chunks"]:
                size = c["range"][1] - c["range"][0]
                covered += size
                payload[int(c["file"].split("-")[1])] += size
            assert covered == nbytes, name  # each element written exactly once
        extra_bytes = 3 * 8
        total = sum(payload.values())
        assert total == unique + extra_bytes  # the tensor payload is the unique state, no replica twice
        assert max(payload.values()) / (total / 2) <= 1.25, payload
        shards = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
        own = 0  # per-rank state (the RNG states) lives in the same files
        for r in range(2):
            info = json.loads((folder / f"rank-{r:05d}.json").read_text())
            own += sum(e["range"][1] - e["range"][0] for e in info["state_tensors"].values())
        headers = sum(os.path.getsize(folder / f) for f in shards) - total - own
        assert 0 < headers < 2048 * len(shards)  # only the safetensors headers besides the tensors


# --- commit and failures -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("crash_rank", "point"), [
    (1, "tmp-created"),  # before any write
    (1, "data-written"),  # after its data, before its part is reported
    (0, "manifest-written"),  # every part in, before the manifest
    (0, "before-rename"),  # the manifest written, before the rename
])
def test_a_rank_killed_mid_save_leaves_the_previous_step_and_the_others_raise(tmp_path, crash_rank, point):
    root = str(tmp_path / "ck")
    first = {"kind": "fsdp", "phase": "save", "steps": 2, "root": root, "out": str(tmp_path), "name": "first"}
    assert _spawn(2, first, tmp_path) == [0, 0]
    crash = {"kind": "fsdp", "phase": "save", "steps": 2, "save_at": [4], "root": root, "out": str(tmp_path),
             "name": "crash", "crash_rank": crash_rank, "crash_at": point, "timeout": 5}
    start = time.monotonic()
    codes = _spawn(2, crash, tmp_path, timeout=120)
    assert codes[crash_rank] == -9  # SIGKILLed at the point
    survivor = 1 - crash_rank
    res = _result(tmp_path, "crash", survivor)
    assert "error" in res and res["error_at"] - start < 60, res  # typed error within the timeout, no hang
    assert "died" in res["error"], res  # on one host the death is seen at once, not after the timeout
    ck = Checkpointer(root)
    assert ck.steps() == [2] and ck.latest() == 2
    ck.verify(2)
    full, _ = _restore_plain(root)
    _same(load_file(tmp_path / "first.safetensors"), full)


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_rank_whose_write_fails_makes_every_rank_raise_at_once_not_at_the_timeout(tmp_path, fail_rank):
    root = str(tmp_path / "ck")
    first = {"kind": "ddp", "phase": "save", "steps": 2, "root": root, "out": str(tmp_path), "name": "first"}
    assert _spawn(2, first, tmp_path) == [0, 0]
    job = {"kind": "ddp", "phase": "save", "steps": 2, "save_at": [4], "root": root, "out": str(tmp_path),
           "name": "full", "fail_rank": fail_rank, "timeout": 90}
    assert _spawn(2, job, tmp_path, timeout=200) == [0, 0]
    failed, other = _result(tmp_path, "full", fail_rank), _result(tmp_path, "full", 1 - fail_rank)
    assert "injected" in failed["error"] and "nothing was committed" in failed["error"], failed
    # before: with rank 0's write failing, rank 1 waited the whole timeout for a commit that never came
    assert "aborted" in other["error"] or "reported a failure" in other["error"], other
    assert abs(other["error_at"] - failed["error_at"]) < 30, (failed, other)
    ck = Checkpointer(root)
    assert ck.steps() == [2] and ck.latest() == 2
    ck.verify(2)


def test_manifest_is_json_and_a_lying_manifest_is_a_checkpoint_error(saved, tmp_path):
    import shutil

    root = tmp_path / "ck"
    shutil.copytree(saved / "ck-ddp", root)
    mpath = root / "step-00000003" / "manifest.json"
    m = json.loads(mpath.read_text())
    assert m["format"] == "torchforge-checkpoint"
    good = json.loads(json.dumps(m["tensors"]["model.a.weight"]["chunks"]))
    m["tensors"]["model.a.weight"]["chunks"][0]["sizes"] = [3, 5]  # disagrees with the file
    mpath.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=r"do not tile the shape \[7, 5\]"):
        _restore_plain(str(root))
    m["tensors"]["model.a.weight"]["chunks"] = good[:0]  # a slice nobody wrote
    mpath.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="0 chunks do not tile"):
        _restore_plain(str(root))
    m["tensors"]["model.a.weight"]["chunks"] = "nonsense"
    mpath.write_text(json.dumps(m))
    with pytest.raises(CheckpointError):
        _restore_plain(str(root))


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_async_saves_snapshot_and_memory_stays_flat(tmp_path, kind):
    job = {"kind": kind, "phase": "async", "steps": 0, "root": str(tmp_path / "ck"), "out": str(tmp_path),
           "name": f"async-{kind}"}
    assert _spawn(2, job, tmp_path) == [0, 0]
    for r in range(2):
        res = _result(tmp_path, job["name"], r)
        assert "error" not in res, res
        growth = res["rss"][-1] - res["rss"][1]
        assert growth <= 0.05 * res["state_bytes"], (growth, res["state_bytes"], [x // 1024 for x in res["rss"]])
    ck = Checkpointer(tmp_path / "ck")
    assert ck.steps() == [18, 19]
    ck.verify(19)
    # step 19 holds the state as it was when save() returned: the parameters before their last +1
    saved = json.loads((tmp_path / "ck" / "step-00000019" / "manifest.json").read_text())
    assert saved["world_size"] == 2
    big = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    ck.restore(model=big)
    final = load_file(tmp_path / f"async-{kind}.safetensors")
    for k, v in big.state_dict().items():
        want = final[f"model.{k}"] - (1.0 if k.endswith(("weight", "bias")) else 0.0)
        assert torch.equal(v, want), k


def test_a_rank_whose_state_changes_shape_makes_every_rank_plan_the_save_again(tmp_path):
    job = {"kind": "fsdp", "phase": "replan", "steps": 0, "root": str(tmp_path / "ck"), "out": str(tmp_path),
           "name": "replan"}
    assert _spawn(2, job, tmp_path, timeout=120) == [0, 0]
    ck = Checkpointer(tmp_path / "ck")
    assert ck.steps() == [0, 1, 2, 3]
    for step in ck.steps():  # each step holds the state as it was when its save() returned
        ck.verify(step)
        m, opt = _build("plain", 1)
        extra = ck.restore(step, model=m, optimizer=opt)
        _same(_full(m, opt), load_file(tmp_path / f"replan-{step}.safetensors"))
        assert extra["t"].tolist() == [step, step + 1, step + 2]  # rank 0's extra


def _same_state(a, b, path=""):
    """Equal structure and values; tensors the same memory (views of the live state, not copies)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr() and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b))
        for k in a:
            _same_state(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same_state(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def test_the_kept_parameter_name_map_gives_torchs_state_dicts_and_follows_the_model(tmp_path):
    """A save keeps the map torch's state-dict functions build first (parameter -> name) while the model
    holds the same parameters under the same names: the state is what the public functions return, and
    a replaced parameter, a new alias or a dead model drops the map."""
    import gc
    import weakref

    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from torchforge.checkpoint import distributed as tfd

    ck = Checkpointer(tmp_path)
    model, opt = _build("plain", 1)
    _train(model, opt, 0, 1, 0)

    def check(model, opt):
        m, o = tfd._canonical_state(ck, model, opt)
        _same_state(m, get_model_state_dict(model))
        _same_state(o, get_optimizer_state_dict(model, opt))
        return ck._sd_info[2]

    info = check(model, opt)
    assert check(model, opt) is info  # kept
    model.a.weight = torch.nn.Parameter(torch.randn(7, 5))  # a new parameter object under an old name
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, 1, 2, 0)
    info2 = check(model, opt)
    assert info2 is not info and check(model, opt) is info2
    model.alias = model.c  # the same parameters under second names
    assert check(model, opt) is not info2
    ref = weakref.ref(model)
    del model, opt
    gc.collect()
    assert ref() is None and ck._sd_info is None  # the map does not keep a dropped model's parameters


def test_rank_file_layouts_kept_across_saves_are_the_layouts_a_fresh_plan_makes():
    from torchforge.checkpoint import distributed as tfd

    def layout(files, where):
        return [(f.name, f.head, [(off, t.data_ptr()) for off, t in f.parts], f.size) for f in files], where

    cache: dict = {}
    first = {"a": torch.randn(3, 5), "b": torch.arange(7), "c": torch.zeros(()), "d": torch.ones(4, 4)}
    assert layout(*tfd._rank_files("rank-00001", first, 64, cache)) == layout(*tfd._rank_files("rank-00001", first, 64))
    again = {k: v.clone() for k, v in first.items()}  # other memory, the same names, dtypes and shapes
    kept = layout(*tfd._rank_files("rank-00001", again, 64, cache))
    assert kept == layout(*tfd._rank_files("rank-00001", again, 64)) and len(kept[0]) > 1
    for change in ({"b": torch.arange(8)}, {"b": torch.arange(7.0)}, {"e": torch.ones(1)}):
        tfd._rank_files("rank-00001", again, 64, cache)  # kept, then one name, dtype or shape changes
        other = {**again, **change}
        assert layout(*tfd._rank_files("rank-00001", other, 64, cache)) == layout(*tfd._rank_files("rank-00001", other, 64))
    assert layout(*tfd._rank_files("rank-00002", again, 64, cache)) == layout(*tfd._rank_files("rank-00002", again, 64))


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_export_is_consolidated_hugging_face_safetensors(saved, kind, tmp_path):
    ref = {k.removeprefix("model."): v for k, v in load_file(saved / f"save-{kind}.safetensors").items()
           if k.startswith("model.")}
    for folder in (saved / f"hf-{kind}",  # written at save time by rank 0
                   Path(Checkpointer(saved / f"ck-{kind}").export(None, tmp_path / "hf", max_shard_size=200))):
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        got = {}
        for fname in sorted(set(index["weight_map"].values())):
            got.update(load_file(folder / fname))  # safetensors' own reader
        _same(ref, got)
        assert not [n for n in os.listdir(folder.parent) if ".tmp-" in n]
    assert len(set(index["weight_map"].values())) > 1  # max_shard_size=200 split it
    with pytest.raises(CheckpointError, match="exists"):
        Checkpointer(saved / f"ck-{kind}").export(None, tmp_path / "hf")


# --- random kills -----------------------------------------------------------------------------------------
TRIALS = 30


def _trial_rank(rank: int, world: int, init: str, root: str, victim: int, fraction: float, out: str) -> None:
    """One rank of a trial, in a forked child: save step 1, then step 2 with the victim SIGKILLing itself
    ``fraction`` of its save of step 1's time into the save of step 2."""
    import signal
    import threading

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    result = {"rank": rank}
    try:
        m, opt = _build("fsdp", world)
        _train(m, opt, 0, 1, rank)
        ck = Checkpointer(root, timeout=5)  # a victim killed before it registered costs the survivor this
        t0 = time.monotonic()
        ck.save(1, model=m, optimizer=opt, extra={"step": 1})
        took = result["took"] = time.monotonic() - t0
        _train(m, opt, 1, 2, rank)
        timer = None
        if rank == victim:
            timer = threading.Timer(fraction * took, lambda: os.kill(os.getpid(), signal.SIGKILL))
            timer.start()
        start = time.monotonic()
        try:
            ck.save(2, model=m, optimizer=opt, extra={"step": 2})
            result["outcome"] = "saved"
        except CheckpointError as e:
            result["outcome"] = "error"
            result["error"] = str(e)
        result["seconds"] = time.monotonic() - start
        if timer is not None:  # the save was quicker: the kill lands after it, which is a valid trial too
            timer.join()
            time.sleep(5)
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        os._exit(0)


def _trials(base: str, n: int, seed: int) -> None:
    """The driver (a spawned process that imported torch once): forks two ranks per trial."""
    import random

    rng = random.Random(seed)
    scale = 1.0  # a save of step 2 over one of step 1 (its plan is cached), from trial 0: the kills' clock
    for k in range(n):
        folder = os.path.join(base, f"trial-{k:02d}")
        os.makedirs(folder)
        if k == 1:
            with open(os.path.join(base, "trial-00", "rank0.json")) as f:
                first = json.load(f)
            scale = min(1.0, max(0.05, first["seconds"] / first["took"]))
        victim, fraction = (rng.randrange(2), scale * rng.uniform(0.0, 1.3)) if k else (-1, 0.0)  # trial 0: no kill
        with open(os.path.join(folder, "plan.json"), "w") as f:
            json.dump({"victim": victim, "fraction": fraction}, f)
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                _trial_rank(rank, 2, f"file://{folder}/store", os.path.join(folder, "ck"), victim, fraction, folder)
            pids.append(pid)
        for pid in pids:
            os.waitpid(pid, 0)


def test_random_kills_during_a_save_leave_a_complete_step_and_typed_errors(tmp_path):
    proc = fork_server(__name__).Process(target=_trials, args=(str(tmp_path), TRIALS, 1234))
    proc.start()
    proc.join(600)
    assert proc.exitcode == 0
    reference: dict[int, dict[str, torch.Tensor]] = {}
    clean = tmp_path / "trial-00" / "ck"  # trial 0 was not killed: both steps, the states to compare with
    for step in (1, 2):
        m, opt = _build("plain", 1)
        Checkpointer(clean).restore(step, model=m, optimizer=opt)
        reference[step] = _full(m, opt)
    outcomes = {"committed": 0, "absent": 0}
    for k in range(1, TRIALS):
        folder = tmp_path / f"trial-{k:02d}"
        plan = json.loads((folder / "plan.json").read_text())
        survivor = 1 - plan["victim"]
        res = json.loads((folder / f"rank{survivor}.json").read_text())
        assert res.get("outcome") in ("saved", "error"), (k, res)  # never a hang or an untyped error
        assert res["seconds"] < 60, (k, res)
        ck = Checkpointer(folder / "ck")
        latest = ck.latest()
        assert latest in (1, 2), (k, os.listdir(folder / "ck"))
        assert ck.steps() == sorted({1, latest}), k  # complete or absent: nothing half-written is visible
        if res["outcome"] == "error":
            assert latest == 1, (k, res)
        ck.verify(latest)
        m, opt = _build("plain", 1)
        assert ck.restore(model=m, optimizer=opt) == {"step": latest}
        _same(reference[latest], _full(m, opt))
        outcomes["committed" if latest == 2 else "absent"] += 1
        ck.close()
    assert outcomes["absent"] >= 5, outcomes  # the kills really landed inside saves


def test_a_step_0_checkpoint_saved_before_any_optimizer_step_verifies_and_restores(tmp_path):
    """AdamW has no state before its first step: the optimizer's part of the save holds no tensors, and
    the step must still be whole (verify) and restore at another world size and in a plain process."""
    job = {"kind": "fsdp", "phase": "save", "steps": 0, "root": str(tmp_path / "ck"), "out": str(tmp_path),
           "name": "save0"}
    assert _spawn(2, job, tmp_path) == [0, 0]
    assert "error" not in _result(tmp_path, "save0", 0)
    Checkpointer(job["root"]).verify(0)
    full, _ = _restore_plain(job["root"])
    _same(load_file(tmp_path / "save0.safetensors"), full)
    back = {"kind": "ddp", "phase": "restore", "steps": 0, "root": job["root"], "out": str(tmp_path), "name": "r3"}
    assert _spawn(3, back, tmp_path) == [0, 0, 0]
    _same(load_file(tmp_path / "save0.safetensors"), load_file(tmp_path / "r3.safetensors"))


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))


def _bn_step(m: torch.nn.Module, opt: torch.optim.Optimizer, s: int, rank: int) -> None:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * s + rank))
    opt.zero_grad()
    m(x).pow(2).mean().backward()
    opt.step()


def _bn_rank(rank: int, world: int, init: str, root: str, phase: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        m = torch.nn.parallel.DistributedDataParallel(_bn_model())
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        if phase == "save":
            for s in range(2):
                _bn_step(m, opt, s, rank)
            Checkpointer(root).save(2, model=m, optimizer=opt)
            save_file({k: v.clone() for k, v in m.module.state_dict().items()}, f"{root}-rank{rank}.safetensors")
        else:
            Checkpointer(root).restore(model=m, optimizer=opt)
        _bn_step(m, opt, 2, rank)  # one more step: the uninterrupted run's, or the resumed one's
        if rank == 0:
            save_file({k: v.clone() for k, v in m.module.state_dict().items()}, f"{root}-{phase}-next.safetensors")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_buffers_that_differ_between_ranks_are_saved_as_rank_0s(tmp_path):
    """After a step each DDP rank has its own BatchNorm running statistics (DDP broadcasts rank 0's at the
    next forward): the checkpoint holds rank 0's, whole (it held one rank's running_mean and another's
    running_var), and training resumed from it goes on as the uninterrupted run."""
    root = str(tmp_path / "ck")
    for phase in ("save", "restore"):
        start_ranks(_bn_rank, args=(2, f"file://{tmp_path}/store-{phase}", root, phase), nprocs=2,
                                    join=True)
    r0, r1 = load_file(f"{root}-rank0.safetensors"), load_file(f"{root}-rank1.safetensors")
    assert not torch.equal(r0["1.running_var"], r1["1.running_var"])  # the ranks do differ
    m = _bn_model()
    Checkpointer(root).restore(model=m)
    for k in ("1.running_mean", "1.running_var"):
        assert torch.equal(m.state_dict()[k], r0[k]), k
    _same(load_file(f"{root}-save-next.safetensors"), load_file(f"{root}-restore-next.safetensors"))


def _step_rank(rank: int, world: int, init: str, root: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        for first in (True, False):  # a fresh plan (all_gather), then the kept plan (its all_reduce)
            ck = Checkpointer(root, timeout=60)
            if not first:
                ck.save(1, model=m)
            t = time.monotonic()
            try:
                ck.save(5 + rank, model=m)
            except CheckpointError as e:
                assert "ranks save different steps" in str(e) and time.monotonic() - t < 10, e
            else:
                raise AssertionError("saved different steps")
            dist.barrier()
            assert ck.steps() == ([] if first else [1]) and not [n for n in os.listdir(root) if n.startswith(".")]
    finally:
        dist.destroy_process_group()


def test_ranks_saving_different_steps_all_raise_at_once(tmp_path):
    """Every rank must save the same step: an off-by-one on one rank is a CheckpointError on every rank at
    once (each waited the whole timeout for files that never came), and nothing is left behind."""
    start_ranks(_step_rank, args=(2, f"file://{tmp_path}/store", str(tmp_path / "ck")), nprocs=2,
                                join=True)


def _alone_rank(rank: int, world: int, init: str, root: str, case: str) -> None:
    """One rank alone fails (before the plan, or while taking its snapshot); every rank must raise at
    once, and the group stays usable: the next save of every rank commits."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        ck = Checkpointer(root, timeout=60)
        for kept in (False, True):  # a fresh plan (all_gather), then the kept plan (its all_reduce)
            if kept:
                ck.save(1, model=m)
            state: dict = {"rank": rank}
            real_stage = ck._arena.stage
            if rank == 1 and case == "state":
                state["bad"] = object()  # this rank's state cannot be stored
            if rank == 1 and case == "snapshot":
                def stage(*a, **k):
                    raise MemoryError("no memory for the snapshot (injected)")
                ck._arena.stage = stage
            t = time.monotonic()
            try:
                ck.save(5, model=m, rank_state=state, blocking=case != "snapshot")
                ck.wait()
            except CheckpointError as e:
                took = time.monotonic() - t
                assert took < 15, (took, e)  # at once, not after the 60 s timeout (nor the group's own)
                if case == "state":
                    assert "rank 1 could not take its state" in str(e) and "object" in str(e), e
            except MemoryError:
                assert rank == 1 and case == "snapshot"
            else:
                raise AssertionError(f"rank {rank}: the save of step 5 went through")
            ck._arena.stage = real_stage
            dist.barrier()
            assert 5 not in ck.steps(), ck.steps()
            ck.save(6 + kept, model=m, rank_state={"rank": rank})  # the group is still in step
            assert 6 + kept in ck.steps()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["state", "snapshot"])
def test_one_rank_failing_before_it_writes_makes_every_rank_raise_at_once(tmp_path, case):
    """A rank whose own state cannot be stored (before the plan's collective) or whose snapshot fails (after
    it) used to leave the others waiting: in the collective for the group's timeout, or for its files for
    the Checkpointer's. Now every rank raises CheckpointError at once and the next save works."""
    start_ranks(_alone_rank, args=(2, f"file://{tmp_path}/store", str(tmp_path / "ck"), case),
                                nprocs=2, join=True)


def _after_rank(rank: int, world: int, init: str, root: str, export: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        ck = Checkpointer(root, keep_last=1, timeout=60)
        if rank == 0:  # a slow disk: what rank 0 does after the commit takes a while
            real_export, real_prune = ck._export, ck._prune

            def slow_export(*a, **k):
                time.sleep(1.0)
                return real_export(*a, **k)

            def slow_prune(*a, **k):
                time.sleep(1.0)
                return real_prune(*a, **k)

            ck._export, ck._prune = slow_export, slow_prune
        for step in (1, 2):
            ck.save(step, model=m, export_to=export)
            # every rank sees the same folder when save() returns: older steps pruned, the export written
            assert ck.steps() == [step], (rank, ck.steps())
            assert os.path.exists(os.path.join(export, "model.safetensors.index.json")) or \
                os.path.exists(os.path.join(export, "model.safetensors")), (rank, os.listdir(export))
            dist.barrier()
        if rank == 0:
            ck._export = real_export
        blocked = os.path.join(os.path.dirname(root), "a-file")
        with open(blocked, "wb"):
            pass
        try:  # the export fails on rank 0 (its folder's parent is a file): every rank says so
            ck.save(3, model=m, export_to=os.path.join(blocked, "hf"))
        except CheckpointError as e:
            assert getattr(e, "installed", False) and "export" in str(e), (rank, e)
        else:
            raise AssertionError(f"rank {rank}: a failed export went unreported")
        assert ck.steps() == [3], (rank, ck.steps())  # committed all the same
        dist.barrier()
        ck.save(4, model=m)  # the failed export's report is cleaned up by the next save
        dist.barrier()
        assert ck.steps() == [4] and not [n for n in os.listdir(root) if n.startswith(".")], os.listdir(root)
    finally:
        dist.destroy_process_group()


def test_every_rank_returns_after_rank_0_pruned_and_exported(tmp_path):
    """save() returned on ranks other than 0 as soon as the step was committed, while rank 0 was still
    pruning older steps and exporting: right after save(), rank 1 listed a step about to be deleted and
    found no export, and a failed export was reported by rank 0 only."""
    start_ranks(_after_rank, args=(2, f"file://{tmp_path}/store", str(tmp_path / "ck"),
                                                   str(tmp_path / "hf")), nprocs=2, join=True)


class _KeyedState(torch.utils.data.Dataset):
    """A dataset whose state has int keys, a tuple and a tensor (what JSON alone cannot hold)."""

    def __init__(self):
        self.loaded = None

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        return i

    def state_dict(self) -> dict:
        return {"seen": {0: 3, 1: 5}, "span": (2, 4), "rng": torch.Generator().manual_seed(1).get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


def _keyed_rank(rank: int, world: int, init: str, root: str) -> None:
    from torchforge import DataLoader, GlobalSampler

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        loader = DataLoader(_KeyedState(), batch_size=2, sampler=GlobalSampler(16, seed=0))
        next(iter(loader))
        ck = Checkpointer(root, timeout=60)
        ck.save(1, loader=loader)
        again = DataLoader(_KeyedState(), batch_size=2, sampler=GlobalSampler(16, seed=0))
        ck.restore(loader=again)
        got, want = again.dataset.loaded, loader.dataset.state_dict()
        assert got["seen"] == want["seen"] and got["span"] == want["span"], got  # were {'0': 3, '1': 5}, [2, 4]
        assert torch.equal(got["rng"], want["rng"])  # was a raw TypeError on every rank
    finally:
        dist.destroy_process_group()


def test_a_loader_state_is_saved_by_every_rank_as_a_single_process_save_saves_it(tmp_path):
    """The distributed save wrote the DataLoader state with plain json.dumps: int keys came back as strings,
    tuples as lists, and a tensor in it was a raw TypeError on every rank."""
    start_ranks(_keyed_rank, args=(2, f"file://{tmp_path}/store", str(tmp_path / "ck")), nprocs=2,
                                join=True)


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(9, 4)  # 9 rows over 2 ranks: uneven shards of the tied weight
        self.mid = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 9, bias=False)
        self.head.weight = self.emb.weight


def _tied_rank(rank: int, world: int, init: str, root: str, kind: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        m = _Tied()
        if kind == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            fully_shard(m, mesh=init_device_mesh("cpu", (world,)))
        else:
            m = torch.nn.parallel.DistributedDataParallel(m)
        Checkpointer(root, timeout=60).save(1, model=m, export_to=f"{root}-hf")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_tied_weights_are_saved_and_exported_once(tmp_path, kind):
    """A distributed save wrote a tied weight under each of its names (twice the bytes), and export wrote
    both keys, where the single-process save and transformers' save_pretrained write it once."""
    root = str(tmp_path / "ck")
    start_ranks(_tied_rank, args=(2, f"file://{tmp_path}/store", root, kind), nprocs=2, join=True)
    ck = Checkpointer(root)
    model_tensors = [n for n in ck.manifest(1)["tensors"] if n.startswith("model.")]
    assert sorted(model_tensors) == ["model.emb.weight", "model.mid.bias", "model.mid.weight"]
    exported = {}
    for name in os.listdir(f"{root}-hf"):
        if name.endswith(".safetensors"):
            exported.update(load_file(os.path.join(f"{root}-hf", name)))
    torch.manual_seed(0)
    want = _Tied()
    assert sorted(exported) == ["emb.weight", "mid.bias", "mid.weight"]
    assert torch.equal(exported["emb.weight"], want.emb.weight.detach())
    m = _Tied()
    torch.nn.init.zeros_(m.emb.weight)
    ck.restore(model=m)
    assert m.head.weight is m.emb.weight and torch.equal(m.emb.weight, want.emb.weight)


def _rng_save(root: str) -> None:
    from torchforge import DataLoader, GlobalSampler

    dist.init_process_group("gloo", init_method=f"file://{root}/rv1", rank=0, world_size=1)
    try:
        torch.manual_seed(1234)
        loader = DataLoader(list(range(64)), batch_size=4, sampler=GlobalSampler(64, seed=0))
        it = iter(loader)
        next(it)
        Checkpointer(os.path.join(root, "ck"), timeout=60).save(1, model=torch.nn.Linear(2, 2), loader=loader)
    finally:
        dist.destroy_process_group()


def _rng_restore(rank: int, root: str) -> None:
    from torchforge import DataLoader, GlobalSampler

    dist.init_process_group("gloo", init_method=f"file://{root}/rv2", rank=rank, world_size=2)
    try:
        torch.manual_seed(1000 + rank)  # each rank seeded apart, as the script does
        loader = DataLoader(list(range(64)), batch_size=4, sampler=GlobalSampler(64, seed=0))
        Checkpointer(os.path.join(root, "ck"), timeout=60).restore(model=torch.nn.Linear(2, 2), loader=loader)
        out: list = [None, None]
        dist.all_gather_object(out, torch.rand(3).tolist())
        assert out[0] != out[1], out  # was: rank 0's saved generator on every rank
    finally:
        dist.destroy_process_group()


def test_an_elastic_restore_leaves_each_ranks_generator_its_own(tmp_path):
    """A loader state remapped to another world size is rank 0's, whose torch generator state every rank
    then took: ranks seeded apart drew the same numbers (dropout, augmentations) from then on."""
    p = fork_server(__name__).Process(target=_rng_save, args=(str(tmp_path),))
    p.start()
    p.join()
    assert p.exitcode == 0
    start_ranks(_rng_restore, args=(str(tmp_path),), nprocs=2, join=True)
