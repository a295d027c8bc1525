"""torchforge.checkpoint: layout, interop, tied weights, bitwise resume, async snapshots, verify, errors."""
from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from torchforge.checkpoint import Checkpointer
from torchforge.errors import CheckpointError, TorchforgeError
from torchforge.sizes import parse_size


class TiedLM(torch.nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.body = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                        torch.nn.LayerNorm(dim))
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("transposed", torch.arange(12.0).reshape(3, 4).t())  # non-contiguous buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)))


def _train(model: TiedLM, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        g = torch.Generator().manual_seed(1000 + s)  # data depends on the step only
        x = torch.randint(0, 64, (8, 7), generator=g)
        y = torch.randint(0, 64, (8, 7), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()


def _fresh(seed: int = 0) -> tuple[TiedLM, torch.optim.AdamW]:
    torch.manual_seed(seed)
    m = TiedLM()
    return m, torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.8, 0.95), weight_decay=0.1)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _bitwise_equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if isinstance(x, dict):
            if not _bitwise_equal(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(_raw(x), _raw(y)):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("blocking", [True, False])
def test_resume_trains_bitwise_identically(tmp_path, blocking):
    ref, ref_opt = _fresh()
    torch.manual_seed(123)
    _train(ref, ref_opt, range(8))
    ref_rng = torch.get_rng_state()

    run, run_opt = _fresh()
    torch.manual_seed(123)
    _train(run, run_opt, range(4))
    ck = Checkpointer(tmp_path / "ck")
    ck.save(4, model=run, optimizer=run_opt, extra={"rng": torch.get_rng_state(), "step": 4}, blocking=blocking)
    _train(run, run_opt, range(4, 5))  # training goes on while (or after) the save runs
    ck.wait()

    new, new_opt = _fresh(seed=99)  # different init and hyperparameters, no optimizer state
    new_opt.param_groups[0]["lr"] = 1.0
    extra = Checkpointer(tmp_path / "ck").restore(model=new, optimizer=new_opt)
    assert extra["step"] == 4 and new.head.weight is new.emb.weight
    torch.set_rng_state(extra["rng"])
    _train(new, new_opt, range(4, 8))
    assert _bitwise_equal(ref.state_dict(), new.state_dict())
    assert _bitwise_equal(ref_opt.state_dict()["state"], new_opt.state_dict()["state"])
    assert ref_opt.state_dict()["param_groups"] == new_opt.state_dict()["param_groups"]
    assert torch.equal(ref_rng, torch.get_rng_state())


def test_layout_index_and_official_interop(tmp_path):
    m, opt = _fresh()
    _train(m, opt, range(2))
    ck = Checkpointer(tmp_path, max_shard_size=4000)
    ck.save(7, model=m, optimizer=opt, extra={"epoch": 1, "lrs": (0.1, float("nan"))})
    folder = ck.path(7)
    names = sorted(os.listdir(folder))
    model_files = [n for n in names if n.startswith("model-")]
    assert len(model_files) > 1 and all(n.endswith(f"-of-{len(model_files):05d}.safetensors") for n in model_files)
    assert "optimizer.safetensors.index.json" in names and "state.json" in names and "manifest.json" in names
    manifest = json.loads(Path(os.path.join(folder, "manifest.json")).read_text())
    assert set(manifest["files"]) == set(names) - {"manifest.json"}
    for group in ("model", "optimizer"):
        index = json.loads(Path(os.path.join(folder, f"{group}.safetensors.index.json")).read_text())
        seen, total = {}, 0
        for fname in {f for f in names if f.startswith(group + "-")}:
            with safetensors.safe_open(os.path.join(folder, fname), framework="pt") as f:  # official reader
                for k in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    seen[k] = fname
                    t = f.get_tensor(k)
                    total += t.numel() * t.element_size()
        assert index["weight_map"] == seen and index["metadata"]["total_size"] == total
    sd = m.state_dict()
    model_index = json.loads(Path(os.path.join(folder, "model.safetensors.index.json")).read_text())["weight_map"]
    assert "head.weight" not in model_index and "emb.weight" in model_index  # tied: stored once
    for k, fname in model_index.items():
        with safetensors.safe_open(os.path.join(folder, fname), framework="pt") as f:
            assert torch.equal(f.get_tensor(k), sd[k])
    state = json.loads(Path(os.path.join(folder, "state.json")).read_text())
    assert state["model"]["aliases"] == {"head.weight": "emb.weight"}
    extra = ck.restore(7)
    assert extra["epoch"] == 1 and extra["lrs"][0] == 0.1 and extra["lrs"][1] != extra["lrs"][1]
    assert not any(n.endswith((".pkl", ".pt")) for n in names)


def test_checkpoint_files_align_every_whole_cache_line_tensor_and_stay_official(tmp_path):
    # 0-dim and odd-sized tensors sort between the layers in the official order and would misalign
    # every layer after them (copies to and from misaligned addresses are ~20% slower)
    state = {"a.step": torch.tensor(3.0), "b.weight": torch.randn(64, 32), "c.odd": torch.arange(5, dtype=torch.int16),
             "d.weight": torch.randn(16, 16), "e.ids": torch.arange(24), "f.half": torch.randn(32).half()}
    ck = Checkpointer(tmp_path)
    ck.save(1, extra=state)
    files = [os.path.join(ck.path(1), n) for n in os.listdir(ck.path(1)) if n.endswith(".safetensors")]
    assert files
    for path in files:
        raw = Path(path).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        assert (8 + n) % 64 == 0  # the data starts on a cache line
        header = json.loads(raw[8: 8 + n])
        for name, e in header.items():
            if name == "__metadata__":
                continue
            begin, end = e["data_offsets"]
            if (end - begin) % 64 == 0:
                assert begin % 64 == 0, (name, begin)
        loaded = safetensors.torch.load_file(path)  # the official reader takes the padded header
        assert loaded
    extra = ck.restore(1)
    for k, v in state.items():
        assert torch.equal(extra[k], v) and extra[k].dtype == v.dtype


def test_non_blocking_snapshot_is_taken_before_return(tmp_path):
    m, opt = _fresh()
    _train(m, opt, range(1))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    ck = Checkpointer(tmp_path)
    ck.save(1, model=m, optimizer=opt, blocking=False)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)  # allowed as soon as save() returns
    ck.wait()
    fresh, _ = _fresh(seed=5)
    ck.restore(1, model=fresh)
    assert _bitwise_equal(before, fresh.state_dict())


def test_keep_last_prunes_after_commit_and_resave_replaces(tmp_path):
    m, _ = _fresh()
    ck = Checkpointer(tmp_path, keep_last=2)
    for s in range(5):
        ck.save(s, model=m, extra={"s": s}, blocking=s % 2 == 0)
    ck.wait()
    assert ck.steps() == [3, 4] and ck.latest() == 4
    ck.save(4, model=m, extra={"s": "again"})
    assert ck.steps() == [3, 4] and ck.restore(4) == {"s": "again"}
    ck.close()  # old steps are deleted in the background
    assert sorted(os.listdir(tmp_path)) == ["step-00000003", "step-00000004"]
    assert Checkpointer(tmp_path, keep_last=None).steps() == [3, 4]


def test_verify_names_the_damaged_file(tmp_path):
    m, opt = _fresh()
    _train(m, opt, range(1))
    ck = Checkpointer(tmp_path)
    ck.save(3, model=m, optimizer=opt)
    ck.verify(3)
    folder = ck.path(3)
    shard = os.path.join(folder, "optimizer-00001-of-00001.safetensors")
    raw = bytearray(Path(shard).read_bytes())
    raw[len(raw) // 2] ^= 0x10  # one flipped bit in the tensor data
    Path(shard).write_bytes(raw)
    with pytest.raises(CheckpointError) as ei:
        ck.verify(3)
    assert ei.value.path == shard and ei.value.offset == 0 and "checksum" in str(ei.value)
    fresh, fresh_opt = _fresh()
    with pytest.raises(CheckpointError):
        ck.restore(3, model=fresh, optimizer=fresh_opt, verify=True)
    Path(shard).write_bytes(raw[:-3])  # truncated: caught by the cheap size check of every restore
    with pytest.raises(CheckpointError) as ei:
        ck.restore(3, optimizer=fresh_opt)
    assert ei.value.path == shard and "bytes" in str(ei.value)
    os.unlink(shard)
    with pytest.raises(CheckpointError, match="missing"):
        ck.verify(3)


def _resign(folder: str, name: str) -> None:
    """Make the manifest agree with a changed file (size and block digests): a step that lies consistently,
    as a buggy writer would leave it, which only the structural checks can catch."""
    from torchforge.checkpoint.digest import BLOCK, BlockDigest

    data = Path(folder, name).read_bytes()
    digests = []
    for b in range(max(1, -(-len(data) // BLOCK))):
        d = BlockDigest()
        d.update(memoryview(data[b * BLOCK:(b + 1) * BLOCK]))
        digests.append(d.hexdigest())
    mpath = os.path.join(folder, "manifest.json")
    manifest = json.loads(Path(mpath).read_text())
    manifest["files"][name] = {**manifest["files"][name], "size": len(data), "digests": digests}
    Path(mpath).write_text(json.dumps(manifest))


def test_damaged_header_and_state_are_checkpoint_errors(tmp_path):
    m, _ = _fresh()
    ck = Checkpointer(tmp_path)
    ck.save(1, model=m)
    shard = os.path.join(ck.path(1), "model-00001-of-00001.safetensors")
    raw = bytearray(Path(shard).read_bytes())
    raw[9] = ord("[")  # header JSON broken, same size
    Path(shard).write_bytes(raw)
    with pytest.raises(CheckpointError) as ei:
        ck.restore(1, model=_fresh()[0])
    assert ei.value.path == shard
    ck.save(2, model=m)
    Path(ck.path(2), "manifest.json").write_text("{")
    with pytest.raises(CheckpointError, match="manifest"):
        ck.verify(2)
    ck.save(4, model=m)
    mpath = os.path.join(ck.path(4), "manifest.json")
    text = Path(mpath).read_text().replace('"state.json"', '"../../state.json"')
    Path(mpath).write_text(text)
    with pytest.raises(CheckpointError, match="plain file names"):
        ck.verify(4)
    ck.save(3, model=m)
    index = os.path.join(ck.path(3), "model.safetensors.index.json")
    text = Path(index).read_text().replace("model-00001-of-00001", "model-00009-of-00009")  # same size
    Path(index).write_text(text)
    with pytest.raises(CheckpointError, match="checksum mismatch"):  # the small JSON files: always checked
        ck.restore(3, model=_fresh()[0])
    _resign(ck.path(3), "model.safetensors.index.json")
    with pytest.raises(CheckpointError, match="not in the manifest"):  # an index naming a file not there
        ck.restore(3, model=_fresh()[0])
    ck.save(6, model=m)
    state = os.path.join(ck.path(6), "state.json")
    Path(state).write_text(Path(state).read_text().replace('"aliases"', '"aliasex"'))  # same size, valid JSON
    _resign(ck.path(6), "state.json")
    with pytest.raises(CheckpointError, match="state.json is damaged") as ei:
        ck.restore(6, model=_fresh()[0])
    assert ei.value.path == state


@pytest.mark.parametrize("old,new,problem", [
    ('{\n "format"', '[\n "format"', "unreadable state.json"),  # not JSON any more
    ('"aliases"', '"aliasex"', "no 'aliases'"),  # JSON, but not the state restore needs (was KeyError)
    ('"param_groups"', '"param_groupx"', "'param_groups'"),
    ('"step": 5,', '"step": 6,', "'step': 6"),  # the state of another step
    ('"__float__": "inf"', '"__float__": "inx"', "cannot decode"),  # a broken tagged value (was ValueError)
])
def test_damaged_state_json_is_a_checkpoint_error_naming_it(tmp_path, old, new, problem):
    m, opt = _fresh()
    _train(m, opt, range(1))
    ck = Checkpointer(tmp_path)
    ck.save(5, model=m, optimizer=opt, extra={"limit": float("inf")})
    state = os.path.join(ck.path(5), "state.json")
    text = Path(state).read_text()
    assert text.count(old) == 1 and len(new) == len(old)
    Path(state).write_text(text.replace(old, new))  # same size: the size check alone does not see it
    m2, opt2 = _fresh(1)
    for check in (lambda: ck.restore(5, model=m2, optimizer=opt2), lambda: ck.verify(5)):
        with pytest.raises(CheckpointError, match="checksum mismatch") as ei:  # found by its checksum
            check()
        assert ei.value.path == state and f"bytes 0..{len(text)} " in str(ei.value)  # the block, within the file
    _resign(ck.path(5), "state.json")  # a step that lies consistently: the structural checks find it
    with pytest.raises(CheckpointError, match=problem) as ei:
        ck.restore(5, model=m2, optimizer=opt2)
    assert ei.value.path == state and "state.json" in str(ei.value)


def test_missing_step_and_mismatched_objects(tmp_path):
    ck = Checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        ck.restore()
    with pytest.raises(CheckpointError, match="step 5"):
        ck.restore(5)
    with pytest.raises(CheckpointError):
        ck.verify(5)
    m, opt = _fresh()
    _train(m, opt, range(1))
    ck.save(1, model=m, optimizer=opt)
    with pytest.raises(CheckpointError, match="keys differ"):
        ck.restore(1, model=torch.nn.Linear(2, 2))
    other = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="groups"):
        ck.restore(1, optimizer=torch.optim.AdamW(other.parameters()))
    ck.save(2, extra={"only": "extra"})
    with pytest.raises(CheckpointError, match="no model"):
        ck.restore(2, model=m)
    with pytest.raises(CheckpointError, match="without pickle"):
        ck.save(3, extra={"bad": object()})
    assert isinstance(CheckpointError("x"), TorchforgeError)


def test_restore_into_a_model_that_ties_two_tensors_saved_with_different_values_is_an_error(tmp_path):
    ck = Checkpointer(tmp_path)
    untied, _ = _fresh()
    untied.head.weight = torch.nn.Parameter(untied.emb.weight.detach() + 1)  # saved untied: two values
    ck.save(1, model=untied)
    tied, _ = _fresh(seed=1)
    before = tied.emb.weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"ties 'emb.weight' and 'head.weight'.*different values"):
        ck.restore(1, model=tied)
    assert torch.equal(tied.emb.weight, before)  # checked before anything is copied
    untied.head.weight = torch.nn.Parameter(untied.emb.weight.detach().clone())  # equal values: restores
    untied.emb.weight.data[0, 0] = float("nan")
    untied.head.weight.data[0, 0] = float("nan")
    ck.save(2, model=untied)
    ck.restore(2, model=tied)
    assert torch.equal(tied.head.weight.view(torch.int32), untied.head.weight.view(torch.int32))


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


def test_compiled_wrapped_and_bare_models_share_names_restore_into_each_other_and_export_plain(tmp_path):
    ck = Checkpointer(tmp_path / "ck")
    bare = _mlp()
    ck.save(1, model=torch.compile(bare, backend="eager"))  # state_dict keys: _orig_mod.0.weight ...
    ck.save(2, model=torch.nn.DataParallel(bare))  # module.0.weight ...
    plain = {"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"}
    for step in (1, 2):
        with safetensors.safe_open(os.path.join(ck.path(step), "model-00001-of-00001.safetensors"), "pt") as f:
            assert set(f.keys()) == plain
        for into in (_mlp(), torch.compile(_mlp(), backend="eager"), torch.nn.DataParallel(_mlp())):
            for p in into.parameters():
                p.data.zero_()
            ck.restore(step, model=into)
            got = {k.replace("_orig_mod.", "").removeprefix("module."): v for k, v in into.state_dict().items()}
            assert _bitwise_equal(got, bare.state_dict())
        out = ck.export(step, tmp_path / f"hf{step}")
        assert set(safetensors.torch.load_file(os.path.join(out, "model-00001-of-00001.safetensors"))) == plain


def test_a_step_saved_with_wrapper_names_before_they_were_canonical_still_restores_and_exports_plain(
        tmp_path, monkeypatch):
    from torchforge.checkpoint import state

    monkeypatch.setattr(state, "canonical_keys", lambda model, keys: {k: k for k in keys})  # the old naming
    ck = Checkpointer(tmp_path / "ck")
    bare = _mlp()
    ck.save(1, model=torch.compile(bare, backend="eager"))
    monkeypatch.undo()
    with safetensors.safe_open(os.path.join(ck.path(1), "model-00001-of-00001.safetensors"), "pt") as f:
        stored = f.keys()
    assert all(k.startswith("_orig_mod.") for k in stored)
    for into in (_mlp(), torch.compile(_mlp(), backend="eager")):
        ck.restore(1, model=into)
        got = {k.removeprefix("_orig_mod."): v for k, v in into.state_dict().items()}
        assert _bitwise_equal(got, bare.state_dict())
    out = ck.export(1, tmp_path / "hf")
    assert set(safetensors.torch.load_file(os.path.join(out, "model-00001-of-00001.safetensors"))) == set(
        bare.state_dict())
    with pytest.raises(CheckpointError, match=r"keys differ from the checkpoint: 1 missing \['2.weight'\], 0 unexpected"):
        ck.restore(1, model=torch.nn.Sequential(*_mlp(), torch.nn.Linear(4, 1, bias=False)))


class _Extra(torch.nn.Module):
    """State that is not the module's own memory: an extra state tensor, a hook's converted copies."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.counter = torch.zeros(())
        self.cache = None
        self.lin._register_state_dict_hook(lambda mod, sd, prefix, local: {
            k: v.to(torch.float64) if k.startswith(prefix) else v for k, v in sd.items()})
        self.register_load_state_dict_post_hook(lambda mod, keys: setattr(mod, "cache", mod.lin.weight.detach().sum()))

    def get_extra_state(self) -> torch.Tensor:
        return self.counter.clone()

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.counter = state.clone()


def test_extra_state_hooked_state_dicts_load_hooks_and_lazy_modules_restore_as_load_state_dict_does(tmp_path):
    ck = Checkpointer(tmp_path)
    m = _Extra()
    m.counter.fill_(42)
    ck.save(1, model=m)
    back = _Extra()
    ck.restore(1, model=back)
    assert float(back.counter) == 42 and torch.equal(back.lin.weight, m.lin.weight)  # set_extra_state ran
    assert back.cache is not None and float(back.cache) == float(m.lin.weight.detach().sum())  # the post hook ran
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(3))
    lazy(torch.ones(1, 5))
    ck.save(2, model=lazy)
    fresh = torch.nn.Sequential(torch.nn.LazyLinear(3))  # not run yet: no shape, materialized by the restore
    ck.restore(2, model=fresh)
    assert torch.equal(fresh[0].weight, lazy[0].weight)


def test_a_failing_optimizer_restore_leaves_the_model_as_it_was_and_lossy_dtypes_are_errors(tmp_path):
    ck = Checkpointer(tmp_path)
    m, opt = _fresh()
    _train(m, opt, range(1))
    ck.save(1, model=m, optimizer=opt)
    other, _ = _fresh(seed=3)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    two_groups = torch.optim.AdamW([{"params": list(other.parameters())[:2]}, {"params": list(other.parameters())[2:]}])
    with pytest.raises(CheckpointError, match="groups of sizes"):
        ck.restore(1, model=other, optimizer=two_groups)
    assert _bitwise_equal(other.state_dict(), before)  # all or nothing
    ints = torch.nn.Module()
    ints.register_buffer("f", torch.tensor([0.7, 1e10]))
    ck.save(2, model=ints)
    ints.f = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(CheckpointError, match=r"'f' is float32 in the checkpoint, int32 in the model"):
        ck.restore(2, model=ints)
    ints.f = torch.zeros(2, dtype=torch.bfloat16)  # precision only: a cast, as load_state_dict does
    ck.restore(2, model=ints)
    assert ints.f[0] == torch.tensor(0.7).bfloat16()


@pytest.mark.filterwarnings("ignore:.*(Sparse CSR|nested tensors).*:UserWarning")
@pytest.mark.parametrize(("make", "says"), [
    (lambda: torch.eye(3).to_sparse(), "sparse_coo tensor"),
    (lambda: torch.eye(3).to_sparse_csr(), "sparse_csr tensor"),
    (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensor"),
    (lambda: torch.ones(2, dtype=torch.complex128), "complex128, which safetensors cannot hold"),
])
def test_tensors_a_checkpoint_cannot_hold_are_errors_naming_them_and_leave_nothing(tmp_path, make, says):
    ck = Checkpointer(tmp_path)
    m = torch.nn.Module()
    m.register_buffer("odd", make())
    with pytest.raises(CheckpointError, match=f"'odd' is .*{says}"):
        ck.save(1, model=m)
    with pytest.raises(CheckpointError, match=says):
        ck.save(1, extra={"x": make()})
    assert ck.latest() is None and not [n for n in os.listdir(tmp_path) if "tmp" in n]


def test_restore_into_a_meta_model_is_an_error_not_a_silent_no_op(tmp_path):
    ck = Checkpointer(tmp_path)
    m, _ = _fresh()
    ck.save(1, model=m)
    with torch.device("meta"):
        lazy, _ = _fresh()
    with pytest.raises(CheckpointError, match=r"meta device.*to_empty"):
        ck.restore(1, model=lazy)
    lazy.to_empty(device="cpu")
    ck.restore(1, model=lazy)
    assert _bitwise_equal(lazy.state_dict(), m.state_dict())


def test_background_failure_is_raised_by_wait(tmp_path, monkeypatch):
    import torchforge.checkpoint.checkpointer as mod

    m, _ = _fresh()
    ck = Checkpointer(tmp_path)

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mod, "write_files", boom)
    ck.save(1, model=m, blocking=False)
    with pytest.raises(CheckpointError, match="No space"):
        ck.wait()
    with pytest.raises(CheckpointError, match="nothing was committed"):
        ck.save(2, model=m)
    assert ck.steps() == [] and os.listdir(tmp_path) == []  # the temporary folder is gone too


def test_leftovers_of_dead_writers_are_invisible_and_cleaned(tmp_path):
    from torchforge.checkpoint.distributed import host_name, tmp_name

    dead = tmp_path / tmp_name(9, pid=999999999)
    dead.mkdir()
    (dead / "model-00001-of-00001.safetensors").write_bytes(b"partial")
    (tmp_path / ".trash-step-00000001-12345678").mkdir()
    other_node = tmp_path / tmp_name(9, pid=999999999, host=host_name() + "x")  # another host's save
    other_node.mkdir()
    ck = Checkpointer(tmp_path)
    assert ck.steps() == [] and os.listdir(tmp_path) == [other_node.name]  # never another node's folder


def test_another_hosts_save_is_cleaned_only_once_idle_for_an_hour(tmp_path):
    """A save SIGKILLed in a container left its folder named for that container's PID namespace: the next
    container is another host to it, so the folder (a whole partial step) was never cleaned, one more per
    crash. Another host's folder is now deleted once nothing in it changed for an hour (twice the timeout
    when that is longer); one that changes is a save in progress, never touched."""
    from torchforge.checkpoint.distributed import host_name, tmp_name

    old_container = tmp_path / tmp_name(9, pid=2, host=host_name() + "x")
    old_container.mkdir()
    (old_container / "rank-00000-00000.safetensors").write_bytes(b"partial")
    (tmp_path / (old_container.name + ".busy")).write_bytes(b"")
    live = tmp_path / tmp_name(10, pid=2, host=host_name() + "y")
    live.mkdir()
    (live / "rank-00000-00000.safetensors").write_bytes(b"being written")
    hours_ago = time.time() - 3700
    for p in (old_container / "rank-00000-00000.safetensors", old_container, tmp_path / (old_container.name + ".busy"),
              live):
        os.utime(p, (hours_ago, hours_ago))  # the live save's folder is old, but its file was just written
    Checkpointer(tmp_path, timeout=60)
    assert sorted(os.listdir(tmp_path)) == [live.name]
    waiting = tmp_path / tmp_name(11, pid=3, host=host_name() + "z")  # rank 0 waiting for slow ranks
    waiting.mkdir()
    os.utime(waiting, (hours_ago, hours_ago))
    Checkpointer(tmp_path, timeout=3600)  # within twice the timeout a waiting save is not idle: kept
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, waiting.name])
    Checkpointer(tmp_path, timeout=60)
    assert sorted(os.listdir(tmp_path)) == [live.name]


def test_every_dtype_and_shared_views_in_extra(tmp_path):
    base = torch.arange(20, dtype=torch.float32)
    extra = {f"{dt}": torch.arange(6).to(dt) for dt in (torch.bfloat16, torch.float16, torch.int8, torch.uint8,
                                                         torch.bool, torch.float64, torch.int64)}
    extra["f8"] = torch.arange(6, dtype=torch.float32).to(torch.float8_e4m3fn)
    extra["a"], extra["b"], extra["strided"] = base, base, base[::3]
    extra[3] = "int key"
    ck = Checkpointer(tmp_path)
    ck.save(0, extra=extra)
    got = ck.restore(0)
    assert got[3] == "int key"
    for k, v in extra.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k].float(), v.float()), k
    assert got["a"] is got["b"]  # saved once as one tensor: restored as one, as torch.load does
    got["a"][0] = -1.0
    assert got["b"][0] == -1.0


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1GiB") == 2**30 and parse_size(123) == 123
    assert parse_size("500kb") == 500_000 and parse_size("1.5MB") == 1_500_000
    for bad in ("2XB", "-1", 0, "GB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_tensor_hyperparameters_and_sgd_state(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    opts = [torch.optim.AdamW(m.parameters(), lr=torch.tensor(0.01), foreach=False),
            torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)]
    x = torch.randn(5, 4)
    for opt in opts:
        for _ in range(2):
            opt.zero_grad()
            m(x).square().sum().backward()
            opt.step()
    ck = Checkpointer(tmp_path)
    for i, opt in enumerate(opts):
        ck.save(i, model=m, optimizer=opt)
        m2 = torch.nn.Linear(4, 3)
        fresh = type(opt)(m2.parameters(), lr=0.5)
        ck.restore(i, model=m2, optimizer=fresh)
        sd, sd2 = opt.state_dict(), fresh.state_dict()
        assert _bitwise_equal(sd["state"], sd2["state"])
        for g, g2 in zip(sd["param_groups"], sd2["param_groups"]):
            assert g.keys() == g2.keys()
            for k in g:
                assert (torch.equal(g[k], g2[k]) if isinstance(g[k], torch.Tensor) else g[k] == g2[k]), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_non_blocking_save_and_restore(tmp_path):
    torch.manual_seed(0)
    m = TiedLM().cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    _train_cuda = lambda: (opt.zero_grad(), m(torch.randint(0, 64, (4, 5), device="cuda")).sum().backward(), opt.step())
    _train_cuda()
    before = {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
    ck = Checkpointer(tmp_path)
    ck.save(1, model=m, optimizer=opt, blocking=False)
    assert ck.staging_buffer is not None and ck.staging_buffer.is_pinned()
    _train_cuda()  # changes the parameters while the write runs
    ck.wait()
    fresh = TiedLM().cuda()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    ck.restore(1, model=fresh, optimizer=fresh_opt)
    assert _bitwise_equal(before, {k: v.cpu() for k, v in fresh.state_dict().items()})
    assert all(s["exp_avg"].is_cuda for s in fresh_opt.state.values())


def test_block_digest_streaming_and_what_it_detects():
    import random

    from torchforge.checkpoint.digest import PAGE, BlockDigest

    rng = random.Random(0)
    data = bytes(rng.getrandbits(8) for _ in range(3 * PAGE + 123))

    def digest(*parts: bytes) -> str:
        d = BlockDigest()
        for p in parts:
            d.update(memoryview(p))
        return d.hexdigest()

    whole = digest(data)
    for cuts in ([1], [PAGE - 1, PAGE + 5], [7, 8, 9, 3 * PAGE], [3 * PAGE + 122]):  # any split, same digest
        bounds = [0, *cuts, len(data)]
        assert digest(*[data[a:b] for a, b in itertools.pairwise(bounds)]) == whole
    damaged = []
    flipped = bytearray(data)
    flipped[PAGE + 17] ^= 0x04
    damaged.append(bytes(flipped))
    zeroed = bytearray(data)
    zeroed[PAGE: 2 * PAGE] = bytes(PAGE)
    damaged.append(bytes(zeroed))
    swapped = data[PAGE: 2 * PAGE] + data[:PAGE] + data[2 * PAGE:]  # misdirected pages
    damaged.append(swapped)
    damaged.append(data[:-1])  # truncated
    damaged.append(data + b"\0")  # extended by a zero byte (the size check catches this too)
    for d in damaged:
        assert digest(d) != whole
    assert digest(b"") != digest(bytes(8))


def _small_direct_io(monkeypatch) -> list[int]:
    """Direct I/O for every file, with blocks, runs and digest pieces small enough that a small model
    spans many of each and tensors straddle their boundaries. Returns a list that counts the runs."""
    import torchforge.checkpoint.writer as io
    from torchforge.checkpoint import digest

    monkeypatch.setattr(io, "DIRECT_MIN", 0)
    monkeypatch.setattr(digest, "BLOCK", 64 << 10)
    monkeypatch.setattr(io, "DIRECT_RUN", 16 << 10)
    monkeypatch.setattr(io, "SUM_PIECE", 8 << 10)
    calls: list[int] = []
    real = io.write_run_direct
    monkeypatch.setattr(io, "write_run_direct", lambda fd, off, views: calls.append(off) or real(fd, off, views))
    return calls


def _o_direct_works(folder: Path) -> bool:
    if not getattr(os, "O_DIRECT", 0):
        return False
    try:
        os.close(os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError:
        return False
    os.unlink(folder / "probe")
    return True


@pytest.mark.parametrize("blocking", [True, False])
def test_direct_io_writes_the_same_bytes_as_buffered_io(tmp_path, monkeypatch, blocking):
    if not _o_direct_works(tmp_path):
        pytest.skip("the test folder's filesystem refuses O_DIRECT")
    calls = _small_direct_io(monkeypatch)
    torch.manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(37, 53), torch.nn.Linear(53, 1001), torch.nn.Embedding(77, 9))
    opt = torch.optim.AdamW(m.parameters())
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    roots = {d: tmp_path / ("direct" if d else "buffered") for d in (True, False)}
    for direct, root in roots.items():
        with Checkpointer(root, direct_io=direct) as ck:
            ck.save(5, model=m, optimizer=opt, extra={"note": "x"}, blocking=blocking)
            ck.wait()
            ck.verify(5)
    assert len(calls) > 20  # the direct path really ran, over many runs
    a, b = (sorted(os.listdir(r / "step-00000005")) for r in roots.values())
    assert a == b and len(a) >= 5
    for name in a:
        x, y = ((r / "step-00000005" / name).read_bytes() for r in roots.values())
        if name == "manifest.json":  # the commit times differ
            x, y = ({k: v for k, v in json.loads(d).items() if k != "committed"} for d in (x, y))
        assert x == y, name
    m2 = torch.nn.Sequential(torch.nn.Linear(37, 53), torch.nn.Linear(53, 1001), torch.nn.Embedding(77, 9))
    opt2 = torch.optim.AdamW(m2.parameters())
    Checkpointer(roots[True]).restore(model=m2, optimizer=opt2)
    assert _bitwise_equal(m.state_dict(), m2.state_dict())
    assert _bitwise_equal(opt.state_dict()["state"], opt2.state_dict()["state"])


def test_direct_io_falls_back_where_the_filesystem_refuses_it(tmp_path, monkeypatch):
    calls = _small_direct_io(monkeypatch)
    real_open = os.open

    def refuse_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", refuse_direct)
    m, opt = _fresh()
    _train(m, opt, range(2))
    with Checkpointer(tmp_path) as ck:
        ck.save(1, model=m, optimizer=opt)
        ck.verify(1)
    assert calls == []
    m2, opt2 = _fresh(seed=1)
    Checkpointer(tmp_path).restore(model=m2, optimizer=opt2)
    assert _bitwise_equal(m.state_dict(), m2.state_dict())


def test_a_damaged_block_written_with_direct_io_is_named(tmp_path, monkeypatch):
    if not _o_direct_works(tmp_path):
        pytest.skip("the test folder's filesystem refuses O_DIRECT")
    _small_direct_io(monkeypatch)
    torch.manual_seed(0)
    m = torch.nn.Linear(300, 200)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, model=m)
        f = tmp_path / "step-00000001" / "model-00001-of-00001.safetensors"
        data = bytearray(f.read_bytes())
        data[150_000] ^= 0x10
        f.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match="checksum mismatch") as e:
            ck.verify(1)
        assert e.value.path == str(f) and e.value.offset == 150_000 // (64 << 10) * (64 << 10)


def test_direct_io_buffers_are_private_and_aligned_for_huge_pages():
    import ctypes

    from torchforge.checkpoint.writer import huge_page_buffer

    buf = huge_page_buffer(3 << 20)
    assert len(buf) == 3 << 20 and not buf.readonly
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert addr % (2 << 20) == 0
    buf[-1:] = b"\x07"
    assert buf[-1] == 7
    if os.path.exists("/proc/self/maps"):  # a shared anonymous map would be shmem: no huge pages for it
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
        for line in lines:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                assert line.split()[1][3] == "p", line
                break
        else:
            raise AssertionError("the buffer is in no mapping of /proc/self/maps")


def test_export_loads_in_safetensors_and_transformers(tmp_path):
    from safetensors.torch import load_file

    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=97, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)  # lm_head is tied to the token embedding
    ck = Checkpointer(tmp_path / "ck")
    ck.save(7, model=model, export_to=tmp_path / "at-save")
    out = Path(ck.export(7, tmp_path / "hf", max_shard_size="8KB"))
    for folder in (out, tmp_path / "at-save"):
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        tensors = {}
        for fname in sorted(set(index["weight_map"].values())):
            tensors.update(load_file(folder / fname))
        state = model.state_dict()
        assert set(tensors) == set(state) - {"lm_head.weight"}  # tied: written once, as save_pretrained does
        for k, v in tensors.items():
            assert torch.equal(v, state[k]), k
        config.save_pretrained(folder)
        loaded, info = transformers.GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info  # lists, or sets in transformers 5
        for k, v in loaded.state_dict().items():
            assert torch.equal(v, state[k]), k
    assert len(set(index["weight_map"].values())) == 1  # the save-time export uses max_shard_size (2GB)
    assert len(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1


# --- hardening of the single-process path (issue 14 item 6) ----------------------------------------------
@pytest.mark.parametrize("recycle", [True, False])
@pytest.mark.parametrize("blocking", [True, False])
def test_nothing_touches_the_folder_after_save_or_wait_returns(tmp_path, monkeypatch, blocking, recycle):
    import shutil as real_shutil

    import torchforge.checkpoint.checkpointer as mod

    slow_rmtree = real_shutil.rmtree

    def rmtree(path, *a, **k):  # deleting a pruned step takes a while
        import time

        time.sleep(0.2)
        slow_rmtree(path, *a, **k)

    monkeypatch.setattr(mod.shutil, "rmtree", rmtree)
    direct = _o_direct_works(tmp_path)
    if direct:
        _small_direct_io(monkeypatch)  # every file written with O_DIRECT: each one a spare once pruned
    m, _ = _fresh()
    ck = Checkpointer(tmp_path / "ck", keep_last=1, recycle=recycle)
    for step in range(3):
        ck.save(step, model=m, blocking=blocking)
        ck.wait()
        names = sorted(os.listdir(tmp_path / "ck"))
        hidden = [n for n in names if n.startswith(".")]
        assert [n for n in names if n not in hidden] == [f"step-{step:08d}"]  # pruned steps already gone
        # with recycle the step pruned last stays hidden, as files for the next save to write over
        assert len(hidden) == (step > 0 and recycle and direct) and all(n.startswith(".trash-") for n in hidden)
    real_shutil.move(tmp_path / "ck", tmp_path / "moved")  # the user moves the folder right away
    ck.close()  # nothing left running to fail on it
    assert Checkpointer(tmp_path / "moved").steps() == [2]
    assert os.listdir(tmp_path / "moved") == ["step-00000002"]  # the next Checkpointer drops the spares


def test_a_pruned_steps_files_are_written_over_by_the_next_save_never_a_linked_one(tmp_path, monkeypatch):
    """keep_last with recycle (the default): the files of the step a save prunes stay hidden and the next
    save writes over them (same inodes), cut to the new sizes; every step restores bit-exact and verifies;
    a file the user hard-linked elsewhere is never written over; close() deletes what is left."""
    import copy

    if not _o_direct_works(tmp_path):
        pytest.skip("the test folder's filesystem refuses O_DIRECT")
    _small_direct_io(monkeypatch)
    big = [torch.nn.Linear(64, 300), torch.nn.Linear(300, 2)]  # steps 0-1: larger files than steps 2-4

    def model(k: int) -> torch.nn.Module:
        torch.manual_seed(k)
        return torch.nn.Sequential(*copy.deepcopy(big)) if k < 2 else torch.nn.Sequential(torch.nn.Linear(64, 30))

    root = tmp_path / "ck"
    ck = Checkpointer(root, keep_last=1)
    inodes, saved = {}, {}

    def data_files(step: int) -> dict[str, int]:  # the manifest is written last, never over a spare
        folder = root / f"step-{step:08d}"
        return {n: os.stat(folder / n).st_ino for n in os.listdir(folder) if n != "manifest.json"}

    def spares() -> set[int]:  # files alive in the hidden folder: new files cannot take their inode numbers
        return {os.stat(d / n).st_ino for d in root.iterdir() if d.name.startswith(".trash-") for n in os.listdir(d)}

    for step in range(5):
        m = model(step)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(step)
        before = spares()
        assert bool(before) == (step >= 2)  # the step pruned by the save before (none before step 1's save)
        ck.save(step, model=m, extra={"step": step})
        saved[step] = {k: v.clone() for k, v in m.state_dict().items()}
        inodes[step] = data_files(step)
        if step == 2:  # the user keeps a hard link to one of step 2's files
            linked_name = min(inodes[2])
            os.link(root / "step-00000002" / linked_name, tmp_path / "mine")
            linked_bytes = (tmp_path / "mine").read_bytes()
        if step >= 2:  # written over the files of step - 2, kept hidden when the save before pruned it
            assert set(inodes[step].values()) <= before, step  # every data file (step 4: not the linked one)
        ck.verify(step)
        fresh = model(step)
        assert ck.restore(step, model=fresh) == {"step": step}
        assert _bitwise_equal(fresh.state_dict(), saved[step])
    assert os.stat(tmp_path / "mine").st_ino not in inodes[4].values()
    assert (tmp_path / "mine").read_bytes() == linked_bytes  # the linked file was never written over
    assert any(n.startswith(".trash-") for n in os.listdir(root))
    ck.close()
    assert os.listdir(root) == ["step-00000004"]


def test_a_pruned_steps_file_a_reader_still_maps_or_holds_open_is_never_written_over(tmp_path, monkeypatch):
    """A reader (an evaluation job restoring the step, here a map in this process and a descriptor held
    by another process) still uses files of a step that keep_last prunes: the next save writes over the
    others and leaves those alone, so the reader keeps its bytes, as it did when pruned files were
    deleted."""
    import hashlib
    import mmap
    import subprocess
    import sys

    if not _o_direct_works(tmp_path):
        pytest.skip("the test folder's filesystem refuses O_DIRECT")
    _small_direct_io(monkeypatch)
    root = tmp_path / "ck"
    ck = Checkpointer(root, keep_last=1)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 2))
    ck.save(1, model=m, extra={"step": 1})
    step1 = root / "step-00000001"
    shard = next(n for n in os.listdir(step1) if n.endswith(".safetensors"))
    other = "state.json"
    before = {n: (step1 / n).read_bytes() for n in (shard, other)}
    with open(step1 / shard, "rb") as f:  # mapped, its descriptor closed: the map alone holds the file
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    code = ("import hashlib, sys; f = open(sys.argv[1], 'rb'); print('open', flush=True); sys.stdin.readline(); "
            "print(hashlib.sha256(f.read()).hexdigest(), flush=True)")  # holds the file open meanwhile
    holder = subprocess.Popen([sys.executable, "-c", code, str(step1 / other)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        held, mapped_ino = os.stat(step1 / other).st_ino, os.stat(step1 / shard).st_ino
        for step in (2, 3):  # 2 prunes step 1 (its files kept as spares), 3 writes over the spares
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(1)
            ck.save(step, model=m, extra={"step": step})
        inodes = {os.stat(root / "step-00000003" / n).st_ino for n in os.listdir(root / "step-00000003")}
        assert mapped_ino not in inodes and held not in inodes  # left to their readers...
        assert len(inodes) >= 3 and inodes - {mapped_ino, held}  # ...while the others were written over
        assert mapped[:] == before[shard]  # the readers' bytes are step 1's
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == hashlib.sha256(before[other]).hexdigest()
        ck.verify(3)
        assert ck.restore(model=m) == {"step": 3}
    finally:
        holder.kill()
        holder.wait()
        mapped.close()
        ck.close()


def test_a_save_that_prunes_several_steps_keeps_one_of_them_as_spares(tmp_path, monkeypatch):
    if not _o_direct_works(tmp_path):
        pytest.skip("the test folder's filesystem refuses O_DIRECT")
    _small_direct_io(monkeypatch)
    m, _ = _fresh()
    with Checkpointer(tmp_path / "ck", keep_last=3) as ck:
        for step in range(3):
            ck.save(step, model=m)
    with Checkpointer(tmp_path / "ck", keep_last=1) as ck:  # keep_last lowered: one save prunes three steps
        ck.save(3, model=m)
        names = sorted(os.listdir(tmp_path / "ck"))
        assert names[-1] == "step-00000003" and len(names) == 2 and names[0].startswith(".trash-step-00000000")
        spares = {os.stat(tmp_path / "ck" / names[0] / n).st_ino for n in os.listdir(tmp_path / "ck" / names[0])}
        ck.save(4, model=m)
        assert {os.stat(tmp_path / "ck" / "step-00000004" / n).st_ino
                for n in os.listdir(tmp_path / "ck" / "step-00000004") if n != "manifest.json"} <= spares
    assert os.listdir(tmp_path / "ck") == ["step-00000004"]


_KILLED_OVER_SPARES = """
import os, signal, sys, torch
import torchforge.checkpoint.writer as io
from torchforge.checkpoint import Checkpointer, digest
io.DIRECT_MIN, io.DIRECT_RUN, io.SUM_PIECE, digest.BLOCK = 0, 16 << 10, 8 << 10, 64 << 10
real, runs = io.write_run_direct, []
def write_run_direct(fd, off, views):
    runs.append(off)
    if os.environ.get("ARMED") and len(runs) == 3:  # a few runs over the spares written: killed mid-file
        os.kill(os.getpid(), signal.SIGKILL)
    return real(fd, off, views)
io.write_run_direct = write_run_direct
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 2))
ck = Checkpointer(sys.argv[1], keep_last=1)
for step in range(3):
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1)
    if step == 2:
        assert any(n.startswith(".trash-") for n in os.listdir(sys.argv[1]))  # step 0's files, kept as spares
        os.environ["ARMED"] = "1"
        runs.clear()
    ck.save(step, model=m, extra={"step": step})
"""


def test_a_save_killed_while_writing_over_a_pruned_steps_files_leaves_the_last_step_intact(tmp_path, monkeypatch):
    import signal
    import subprocess
    import sys

    if not _o_direct_works(tmp_path):
        pytest.skip("the test folder's filesystem refuses O_DIRECT")
    _small_direct_io(monkeypatch)  # the child's block size: the manifest's digests are per 64 KiB block
    root = tmp_path / "ck"
    out = subprocess.run([sys.executable, "-c", _KILLED_OVER_SPARES, str(root)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    assert any(n.startswith(".tmp-step-") for n in os.listdir(root))  # the killed save's half-written files
    ck = Checkpointer(root, keep_last=1)  # cleans the dead process's leftovers, spares included
    assert os.listdir(root) == ["step-00000001"] and ck.latest() == 1
    ck.verify(1)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 2))
    assert ck.restore(model=m) == {"step": 1}
    torch.manual_seed(0)
    want = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 2))
    for p, q in zip(m.parameters(), want.parameters()):
        assert torch.equal(p, q.detach() + 1 + 1)  # step 1: the initial weights plus 1 twice
    ck.close()


def test_descriptors_outlive_every_queued_write_and_enospc_is_a_checkpoint_error(tmp_path, monkeypatch):
    import errno
    import time

    import torchforge.checkpoint.writer as io
    from torchforge.checkpoint import digest

    monkeypatch.setattr(digest, "BLOCK", 64 << 10)  # many blocks per file, written in parallel
    real = io.write_block
    seen_closed = []
    calls = itertools.count(1)  # no failure until it is reset to start at 0

    def write_block(fd, offset, views, flusher, flushes):
        if next(calls) == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        before = os.fstat(fd).st_ino
        time.sleep(0.05)  # still writing when the failure is reported
        try:
            if os.fstat(fd).st_ino != before:
                seen_closed.append(offset)
        except OSError:
            seen_closed.append(offset)
        return real(fd, offset, views, flusher, flushes)

    monkeypatch.setattr(io, "write_block", write_block)
    m, _ = _fresh()
    ck = Checkpointer(tmp_path, direct_io=False, threads=4)
    ck.save(1, model=m)
    calls = itertools.count()  # the first block of the next save fails
    big = torch.nn.Linear(256, 512)  # 512 KiB: 8 blocks
    with pytest.raises(CheckpointError, match="No space left"):
        ck.save(2, model=big)
    ck.close()  # every write the pool still had has run
    assert seen_closed == []  # no write ever found its descriptor closed or reused
    ck = Checkpointer(tmp_path)
    assert ck.steps() == [1] and sorted(os.listdir(tmp_path)) == ["step-00000001"]
    ck.verify(1)


def test_keep_last_keeps_the_most_recently_committed_steps_after_a_rollback(tmp_path):
    m, _ = _fresh()
    ck = Checkpointer(tmp_path, keep_last=2)
    for step in (8, 9):
        ck.save(step, model=m)
    # the run is rolled back to step 3 and goes on from there
    ck.save(4, model=m)
    assert ck.steps() == [4, 9] and ck.latest() == 4  # the new save is kept; latest() is the last commit
    ck.save(5, model=m)
    assert ck.steps() == [4, 5] and ck.committed() == [4, 5] and ck.latest() == 5


_DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(("name", "bad"), [
    ("model.safetensors.index.json", []),
    ("model.safetensors.index.json", {"weight_map": 3}),
    ("model.safetensors.index.json", {"weight_map": {"embed.weight": 5}}),
    ("model.safetensors.index.json", {"weight_map": {"embed.weight": "../../etc/passwd"}}),
    ("manifest.json", {"format": "torchforge-checkpoint", "version": 1, "step": 1, "files": []}),
    ("manifest.json", {"format": "torchforge-checkpoint", "version": 1, "step": 1,
                       "files": {"state.json": {"size": "12", "digests": []}}}),
    ("manifest.json", {"format": "torchforge-checkpoint", "version": 2, "step": 1, "files": {}}),
    ("manifest.json", [1, 2]),
    ("state.json", {"format": "torchforge-checkpoint", "version": 1, "step": 1, "extra": None, "model": []}),
    # JSON nested deeper than the parser recurses (was a raw RecursionError)
    ("manifest.json", _DEEP), ("state.json", _DEEP), ("model.safetensors.index.json", _DEEP),
])
def test_structurally_wrong_json_is_a_checkpoint_error(tmp_path, name, bad):
    m, opt = _fresh()
    ck = Checkpointer(tmp_path)
    ck.save(1, model=m, optimizer=opt)
    path = tmp_path / "step-00000001" / name
    path.write_text(bad if bad is _DEEP else json.dumps(bad))
    if name != "manifest.json":  # keep the manifest's size and digests right: only the structure is wrong
        from torchforge.checkpoint.digest import BlockDigest

        mpath = tmp_path / "step-00000001" / "manifest.json"
        man = json.loads(mpath.read_text())
        data = path.read_bytes()
        d = BlockDigest()
        d.update(memoryview(data))
        man["files"][name] = {"size": len(data), "digests": [d.hexdigest()]}
        mpath.write_text(json.dumps(man))
    m2, opt2 = _fresh(1)
    with pytest.raises(CheckpointError) as e:
        ck.restore(1, model=m2, optimizer=opt2)
    assert name in str(e.value) or "step-00000001" in str(e.value)
    if name == "manifest.json" and not (isinstance(bad, dict) and bad.get("files") == {}):
        with pytest.raises(CheckpointError, match="manifest"):  # verify reads the manifest as restore does
            ck.verify(1)
    # later saves go on, pruning the damaged step
    ck2 = Checkpointer(tmp_path, keep_last=1)
    ck2.save(2, model=m, optimizer=opt)
    assert ck2.steps() == [2]
    ck2.restore(2, model=m2, optimizer=opt2)


def test_a_manifest_listing_a_negative_size_is_refused(tmp_path):
    ck = Checkpointer(tmp_path)
    ck.save(1, model=_fresh()[0])
    mpath = tmp_path / "step-00000001" / "manifest.json"
    man = json.loads(mpath.read_text())
    man["files"]["state.json"]["size"] = -5
    mpath.write_text(json.dumps(man))
    for call in (ck.manifest, ck.verify, ck.restore):
        with pytest.raises(CheckpointError, match="size of 0 or more bytes") as e:
            call(1)
        assert e.value.path == str(mpath)


def test_conjugate_and_negative_views_are_saved_as_their_values(tmp_path):
    z = torch.tensor([1 + 2j, 3 - 4j])
    extra = {"conj": z.conj(), "neg": torch._neg_view(z), "plain": z}
    assert extra["conj"].is_conj() and extra["neg"].is_neg()
    ck = Checkpointer(tmp_path)
    for step, blocking in ((1, True), (2, False)):
        ck.save(step, extra=extra, blocking=blocking)
        ck.wait()
        back = ck.restore(step)
        for k, v in extra.items():
            assert torch.equal(back[k], v.resolve_conj().resolve_neg()) and not back[k].is_conj(), (k, blocking)
        ck.verify(step)
    assert extra["conj"].is_conj() and torch.equal(z, torch.tensor([1 + 2j, 3 - 4j]))  # the inputs untouched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_staging_is_sized_to_the_state_not_rounded_up(tmp_path):
    from torchforge.checkpoint.staging import pinned_empty

    n = (5 << 20) + 12345  # the caching host allocator would round this up to 8 MiB
    before = torch.cuda.memory.host_memory_stats().get("reserved_bytes.all.current", 0)
    buf = pinned_empty(n)
    assert buf.numel() == n and buf.is_pinned()
    after = torch.cuda.memory.host_memory_stats().get("reserved_bytes.all.current", 0)
    assert after - before < n  # nothing rounded up to a power of two in torch's host allocator
    m = torch.nn.Linear(1000, 1001).cuda()
    ck = Checkpointer(tmp_path)
    ck.save(1, model=m, blocking=False)
    ck.wait()
    state = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    assert state <= ck.staging_buffer.numel() < state + 4096 and ck.staging_buffer.is_pinned()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_blocking_save_of_a_model_on_two_devices_waits_for_both(tmp_path):
    a = torch.nn.Linear(2048, 2048).to("cuda:0")
    b = torch.nn.Linear(2048, 2048).to("cuda:1")
    model = torch.nn.ModuleDict({"a": a, "b": b})
    with torch.cuda.device(1):
        torch.cuda._sleep(200_000_000)  # keep device 1 busy: its copy is queued behind this
        with torch.no_grad():
            b.weight.fill_(7.0)
    ck = Checkpointer(tmp_path)
    ck.save(1, model=model)  # current device is 0: device 1 must be synchronized too
    fresh = torch.nn.ModuleDict({"a": torch.nn.Linear(2048, 2048), "b": torch.nn.Linear(2048, 2048)})
    ck.restore(1, model=fresh)
    assert (fresh["b"].weight == 7.0).all()


# --- failures after the data is written: what is committed stays committed, and the error says so ---
def _eio(what="injected"):
    import errno

    return OSError(errno.EIO, f"Input/output error ({what})")


def _unreadable(monkeypatch, step_dir, code):
    """``open()`` of ``step_dir``'s manifest for reading fails with ``code`` while ``on["on"]``."""
    import builtins

    real, on = builtins.open, {"on": True}

    def fake_open(path, *a, **k):
        mode = a[0] if a else k.get("mode", "r")
        if on["on"] and str(path).endswith(os.path.join(step_dir, "manifest.json")) and "r" in mode:
            raise OSError(code, f"{os.strerror(code)} (injected)", str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    return on


def test_a_manifest_unreadable_while_pruning_never_deletes_the_step_just_committed(tmp_path, monkeypatch):
    import errno

    m, _ = _fresh()
    ck = Checkpointer(tmp_path, keep_last=2)
    ck.save(1, model=m)
    ck.save(2, model=m)
    on = _unreadable(monkeypatch, "step-00000003", errno.EMFILE)  # the new step's, for a moment
    ck.save(3, model=m)
    on["on"] = False
    assert ck.steps() == [2, 3] and ck.latest() == 3  # before: step 3 pruned as "oldest", save returned


def test_an_old_step_whose_manifest_cannot_be_read_is_kept_and_saves_go_on(tmp_path, monkeypatch, caplog):
    import errno

    m, _ = _fresh()
    ck = Checkpointer(tmp_path, keep_last=2)
    ck.save(1, model=m)
    on = _unreadable(monkeypatch, "step-00000001", errno.EACCES)  # for good
    for step in (2, 3, 4, 5):
        ck.save(step, model=m)  # never deleted unread, never an error: the others are pruned around it
    assert ck.steps() == [1, 4, 5]
    assert "not pruning step 1: its manifest cannot be read" in caplog.text
    on["on"] = False
    ck.save(6, model=m)
    assert ck.steps() == [5, 6]


def test_a_resave_whose_second_rename_fails_puts_the_committed_step_back_at_once(tmp_path, monkeypatch):
    import torchforge.checkpoint.checkpointer as mod

    m, _ = _fresh(0)
    ck = Checkpointer(tmp_path)
    ck.save(5, model=m)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    monkeypatch.setattr(mod, "exchange_paths", lambda a, b: False)  # a filesystem without RENAME_EXCHANGE
    real = os.rename

    def rename(src, dst):
        if os.path.basename(str(src)).startswith(".tmp-step-"):
            raise _eio()
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(CheckpointError, match="nothing was committed"):
        ck.save(5, model=_fresh(1)[0])
    monkeypatch.setattr(os, "rename", real)
    assert ck.steps() == [5] and sorted(os.listdir(tmp_path)) == ["step-00000005"]  # before: hidden as .old-*
    m2 = _fresh(2)[0]
    ck.restore(5, model=m2)
    assert _bitwise_equal(m2.state_dict(), want)


def test_a_root_fsync_failing_after_the_rename_says_the_step_is_in_place(tmp_path, monkeypatch):
    import torchforge.checkpoint.checkpointer as mod

    m, _ = _fresh()
    ck = Checkpointer(tmp_path)
    real = mod.fsync_dir

    def fsync_dir(path):
        if os.path.abspath(path) == os.path.abspath(tmp_path):
            raise _eio()
        return real(path)

    monkeypatch.setattr(mod, "fsync_dir", fsync_dir)
    with pytest.raises(CheckpointError, match="step-00000001 is in place, but .* may not survive a crash") as e:
        ck.save(1, model=m)
    assert e.value.installed and ck.latest() == 1  # before: "nothing was committed", yet it was
    assert os.listdir(tmp_path) == ["step-00000001"]
    for exchange in (True, False):  # a re-save: the folder swapped in one rename, or in two
        if not exchange:
            monkeypatch.setattr(mod, "exchange_paths", lambda a, b: False)
        with pytest.raises(CheckpointError, match="step-00000001 is in place") as e:
            ck.save(1, model=m)
        assert e.value.installed and os.listdir(tmp_path) == ["step-00000001"]  # no old copy left behind


def test_a_prune_that_fails_is_a_checkpoint_error_and_leaves_no_hidden_step(tmp_path, monkeypatch):
    import torchforge.checkpoint.checkpointer as mod

    m, _ = _fresh()
    ck = Checkpointer(tmp_path, keep_last=1)
    ck.save(1, model=m)
    real = mod.fsync_dir
    fail = {"on": True}

    def fsync_dir(path):  # the root's fsync after the pruned step was renamed away
        if fail["on"] and any(n.startswith(".trash-") for n in os.listdir(tmp_path)):
            raise _eio()
        return real(path)

    monkeypatch.setattr(mod, "fsync_dir", fsync_dir)
    with pytest.raises(CheckpointError, match="step 2 was committed, but pruning"):
        ck.save(2, model=m)  # before: a raw OSError
    assert os.listdir(tmp_path) == ["step-00000002"]  # before: .trash-step-00000001-* stayed
    ck.save(3, model=m, blocking=False)
    with pytest.raises(CheckpointError, match="step 3 was committed, but pruning"):
        ck.wait()
    fail["on"] = False
    ck.save(4, model=m)
    assert os.listdir(tmp_path) == ["step-00000004"]


def test_a_failed_export_keeps_the_previous_one_and_later_exports_work(tmp_path, monkeypatch):
    import safetensors.torch as st

    import torchforge.checkpoint.checkpointer as mod

    m, _ = _fresh(0)
    root, out = tmp_path / "ck", tmp_path / "export"
    ck = Checkpointer(root, keep_last=2)
    ck.save(1, model=m, export_to=out)
    first = st.load_file(out / "model-00001-of-00001.safetensors")
    monkeypatch.setattr(mod, "exchange_paths", lambda a, b: False)  # the two-rename fallback
    real = os.rename

    def rename(src, dst):
        if ".export.tmp-" in str(src) and ".old-" not in str(src) and os.path.abspath(dst) == os.path.abspath(out):
            raise _eio()
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(CheckpointError, match="step 2 was committed, but its export failed"):
        ck.save(2, model=_fresh(1)[0], export_to=out)
    monkeypatch.setattr(os, "rename", real)
    again = st.load_file(out / "model-00001-of-00001.safetensors")  # before: the export folder was gone
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    for step in (3, 4, 5):  # before: every later export failed (the stale .old folder), pruning stopped
        ck.save(step, model=_fresh(step)[0], export_to=out)
    assert ck.steps() == [4, 5] and sorted(os.listdir(tmp_path)) == ["ck", "export"]


def test_a_failed_write_names_the_file_it_was_writing(tmp_path, monkeypatch):
    from torchforge.checkpoint import writer

    m, _ = _fresh()
    ck = Checkpointer(tmp_path)
    real = writer.write_block

    def write_block(fd, *a, **k):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors"):
            raise OSError(28, "No space left on device (injected)")
        return real(fd, *a, **k)

    monkeypatch.setattr(writer, "write_block", write_block)
    monkeypatch.setattr(writer, "_O_DIRECT", 0)  # the buffered path, where write_block runs
    with pytest.raises(CheckpointError, match="injected") as e:
        ck.save(1, model=m)
    assert e.value.path.endswith(".safetensors")  # before: the save's temporary folder


def test_rank_zero_drops_its_own_aborted_saves_only(tmp_path):
    from torchforge.checkpoint import distributed

    aborted, running = tmp_path / distributed.tmp_name(4), tmp_path / distributed.tmp_name(5)
    other_pid = tmp_path / distributed.tmp_name(4, pid=os.getpid() + 1)
    for d in (aborted, running, other_pid):
        d.mkdir()
        (d / "rank-00000-00000.safetensors").write_bytes(b"part")
    (aborted / "ABORT").touch()
    (other_pid / "ABORT").touch()  # another process's: its ranks may still be looking at it
    distributed._drop_aborted(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([running.name, other_pid.name])


def test_an_export_that_cannot_start_after_the_commit_still_prunes_and_says_so(tmp_path, monkeypatch):
    import errno

    m, _ = _fresh()
    root, out = tmp_path / "ck", tmp_path / "export"
    ck = Checkpointer(root, keep_last=1)
    ck.save(1, model=m, export_to=out)
    real = os.mkdir

    def mkdir(path, *a, **k):
        if ".export.tmp-" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", mkdir)
    with pytest.raises(CheckpointError, match="step 2 was committed, but its export failed") as e:
        ck.save(2, model=m, export_to=out)  # before: a raw OSError, and step 1 was never pruned
    assert e.value.installed and ck.steps() == [2]


def test_an_export_folder_that_is_a_symlink_is_replaced_and_later_exports_work(tmp_path):
    m, _ = _fresh()
    (tmp_path / "v1").mkdir()
    out = tmp_path / "export"
    out.symlink_to(tmp_path / "v1", target_is_directory=True)
    ck = Checkpointer(tmp_path / "ck", keep_last=1)
    for step in (1, 2, 3):  # before: from the second export on, the swapped-out link blocked every export
        ck.save(step, model=m, export_to=out)
    assert ck.steps() == [3] and sorted(os.listdir(tmp_path)) == ["ck", "export", "v1"]
    assert not out.is_symlink() and (out / "model.safetensors.index.json").is_file()


def test_model_aliases_that_lie_are_a_checkpoint_error_not_weights_restored_into_others(tmp_path):
    """Tied weights are stored once and aliased; an alias that is also a stored name (or names nothing
    stored) would copy one tensor's values into another, silently."""
    m, _ = _fresh()
    ck = Checkpointer(tmp_path)
    ck.save(1, model=m)
    state = tmp_path / "step-00000001" / "state.json"
    doc = json.loads(state.read_text())
    names = list(json.loads((tmp_path / "step-00000001" / "model.safetensors.index.json").read_text())["weight_map"])
    a, b = [n for n in names if n.endswith("weight")][:2]
    for aliases in ({a: b, b: a}, {"head.weight": "nothing.weight"}):
        doc["model"]["aliases"] = aliases
        _rewrite_digested(tmp_path / "step-00000001", "state.json", json.dumps(doc).encode())
        with pytest.raises(CheckpointError, match="aliases"):
            ck.restore(1, model=_fresh(1)[0])


def _rewrite_digested(folder: Path, name: str, data: bytes) -> None:
    """Replace a file of a step and record its new size and digests: only its content is wrong."""
    from torchforge.checkpoint.digest import BlockDigest

    (folder / name).write_bytes(data)
    man = json.loads((folder / "manifest.json").read_text())
    d = BlockDigest()
    d.update(memoryview(data))
    man["files"][name] = {"size": len(data), "digests": [d.hexdigest()]}
    (folder / "manifest.json").write_text(json.dumps(man))


def test_a_reader_changes_nothing_and_cannot_save(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint folder"):
        Checkpointer.reader(tmp_path / "absent")
    assert not (tmp_path / "absent").exists()
    m, _ = _fresh()
    Checkpointer(tmp_path).save(3, model=m)
    leftover = tmp_path / ".tmp-step-00000004-otherhost-1"  # a save in progress elsewhere: left alone
    leftover.mkdir()
    before = sorted(os.listdir(tmp_path))
    ck = Checkpointer.reader(tmp_path)
    assert ck.steps() == [3] and ck.latest() == 3
    ck.verify(3)
    m2 = _fresh(1)[0]
    ck.restore(3, model=m2)
    assert all(torch.equal(x, y) for x, y in zip(m.state_dict().values(), m2.state_dict().values()))
    with pytest.raises(CheckpointError, match="cannot save"):
        ck.save(4, model=m)
    ck.close()
    assert sorted(os.listdir(tmp_path)) == before


def test_cli_inspect_and_verify_understand_a_checkpoint_folder_and_a_step(tmp_path, capsys):
    from torchforge.cli import main

    m, opt = _fresh()
    ck = Checkpointer(tmp_path / "ck")
    for step in (1, 2):
        ck.save(step, model=m, optimizer=opt, extra={"epoch": step})
    root, step2 = str(tmp_path / "ck"), str(tmp_path / "ck" / "step-00000002")
    assert main(["inspect", root]) == 0
    out = capsys.readouterr().out
    assert "format: checkpoint" in out and "steps: [1, 2]" in out and "latest: 2" in out
    assert "step-00000002/model-00001-of-00001.safetensors" in out
    assert main(["inspect", step2, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == [2]
    assert main(["verify", root]) == 0
    assert "2 checkpoint steps checked, 0 problems" in capsys.readouterr().out
    shard = Path(step2) / "model-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # same size, header intact: only the block digest sees it
    shard.write_bytes(bytes(data))
    assert main(["verify", root]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED step 2:" in out and "checksum mismatch" in out and str(shard) in out and "Traceback" not in out
    assert main(["verify", str(tmp_path / "ck" / "step-00000001")]) == 0  # the other step is whole
    os.remove(Path(step2) / "manifest.json")  # a step folder without its manifest is still a checkpoint's
    assert main(["verify", root]) == 1
    assert "unreadable manifest" in capsys.readouterr().out


@pytest.mark.parametrize("blocking", [True, False])
def test_an_optimizer_that_has_not_stepped_yet_is_saved_whole_and_restores(tmp_path, blocking):
    """A step-0 checkpoint: AdamW has no state tensors yet, so its shard is a header with no tensors
    (was: a blocking save left that header unwritten, zeros, and the step did not verify or restore)."""
    m, opt = _fresh()
    ck = Checkpointer(tmp_path)
    ck.save(0, model=m, optimizer=opt, blocking=blocking)
    ck.wait()
    ck.verify(0)
    m2, opt2 = _fresh(1)
    ck.restore(0, model=m2, optimizer=opt2)
    assert opt2.state_dict()["state"] == {} and opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    for model, optim in ((m, opt), (m2, opt2)):  # and training goes on from it as from the original
        torch.manual_seed(7)  # (dropout)
        _train(model, optim, range(2))
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))


def test_a_restore_that_fails_leaves_the_model_and_optimizer_as_they_were(tmp_path):
    """Every part of the step is read and decoded before anything is copied: a damaged extra (or loader
    state) is an error with the model and optimizer untouched, not half restored."""
    m, opt = _fresh()
    torch.manual_seed(7)
    _train(m, opt, range(2))
    ck = Checkpointer(tmp_path)
    ck.save(1, model=m, optimizer=opt, extra={"limit": float("inf")})
    folder = tmp_path / "step-00000001"
    doc = json.loads((folder / "state.json").read_text())
    doc["extra"] = {"limit": {"__float__": "inx"}}  # a broken tagged value, digests made to match
    _rewrite_digested(folder, "state.json", json.dumps(doc).encode())
    m2, opt2 = _fresh(1)
    torch.manual_seed(7)
    _train(m2, opt2, range(1))
    before_m = {k: v.clone() for k, v in m2.state_dict().items()}
    before_o = json.dumps(opt2.state_dict()["param_groups"])
    with pytest.raises(CheckpointError, match="cannot decode"):
        ck.restore(1, model=m2, optimizer=opt2)
    assert all(torch.equal(before_m[k], v) for k, v in m2.state_dict().items())
    assert json.dumps(opt2.state_dict()["param_groups"]) == before_o


def test_values_whose_dotted_names_coincide_each_keep_their_own_tensor(tmp_path):
    """{"a.b": x, "a": {"b": y}} and {1: x, "1": y} name two tensors "a.b" and "1": each is kept (the second
    one overwrote the first)."""
    extra = {"x": {"a.b": torch.tensor([1.0]), "a": {"b": torch.tensor([2.0])}},
             "y": {1: torch.tensor([3.0]), "1": torch.tensor([4.0])}}
    ck = Checkpointer(tmp_path)
    ck.save(1, extra=extra)
    got = ck.restore(1)
    assert got["x"]["a.b"].item() == 1.0 and got["x"]["a"]["b"].item() == 2.0
    assert got["y"][1].item() == 3.0 and got["y"]["1"].item() == 4.0


def test_an_export_never_replaces_the_checkpoint_folder_or_a_step_and_a_closed_checkpointer_says_so(tmp_path):
    """export(step, ck.path(2), overwrite=True) replaced step 2 with Hugging Face files (still listed, no longer
    restorable); save(export_to=root) deleted every step, the one just committed included. After close() (the
    end of a with block) restore and save raised executor's RuntimeError 'cannot schedule new futures'."""
    root = tmp_path / "ck"
    m, _ = _fresh()
    with Checkpointer(root) as ck:
        ck.save(1, model=m)
        ck.save(2, model=m)
        for folder in (ck.path(2), root, tmp_path, os.path.join(ck.path(1), "hf")):
            with pytest.raises(CheckpointError, match="cannot export into"):
                ck.export(1, folder, overwrite=True)
        with pytest.raises(CheckpointError, match="cannot export into"):
            ck.save(3, model=m, export_to=root)
        with pytest.raises(CheckpointError, match="pass model= too"):  # (it saved and exported nothing, silently)
            ck.save(3, extra={"lr": 0.1}, export_to=tmp_path / "hf")
        assert ck.steps() == [1, 2]
        ck.restore(2, model=_fresh()[0])
        ck.export(1, root / "hf")  # a plain folder of its own inside the checkpoint folder is fine
        assert ck.steps() == [1, 2]
    with pytest.raises(CheckpointError, match="closed"):
        ck.restore(1, model=_fresh()[0])
    with pytest.raises(CheckpointError, match="closed"):
        ck.save(3, model=m)


def test_a_checkpointer_or_feature_store_where_a_file_is_in_the_way_is_a_typed_error_naming_it(tmp_path):
    from torchforge.features import FeatureStore

    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(CheckpointError, match="cannot make the checkpoint folder") as e:
        Checkpointer(afile)  # was: FileExistsError
    assert e.value.path == str(afile)
    with pytest.raises(TorchforgeError, match="cannot make the feature store's folders") as e:
        FeatureStore(afile, {"a": ((), torch.float32)}, create=True)  # was: NotADirectoryError
    assert e.value.path.startswith(str(afile)) and afile.read_text() == "x"


# --- a long run's lifecycle ---------------------------------------------------------------------------
_ASYNC_AT_EXIT = """
import sys, torch
from torchforge.checkpoint import Checkpointer
ck = Checkpointer(sys.argv[1])
m = torch.nn.Linear(256, 256)
ck.save(1, model=m)
ck.save(2, model=m, blocking=False)  # the script's last line: no wait()
"""


def test_an_async_save_on_a_scripts_last_line_is_committed_before_the_interpreter_exits(tmp_path):
    """At exit, concurrent.futures shut its pools down before the save thread ran: the save failed with
    'cannot schedule new futures after interpreter shutdown', kept for a wait() that never came, and step 2
    was silently not written (exit code 0)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _ASYNC_AT_EXIT, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    ck = Checkpointer(tmp_path)
    assert ck.steps() == [1, 2] and ck.latest() == 2
    ck.verify(2)


def test_latest_and_pruning_follow_the_commit_order_not_the_hosts_clock(tmp_path, monkeypatch):
    """A run resumed on a host whose clock is an hour behind: latest() stayed on the old host's step 3, and
    keep_last pruned each new save at the next one (the folder ended [2, 3, 7])."""
    m = torch.nn.Linear(4, 4)
    ck = Checkpointer(tmp_path, keep_last=3)
    for s in (1, 2, 3):
        ck.save(s, model=m)
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() - 3600 * 10**9)
    for s in (4, 5, 6, 7):
        ck.save(s, model=m)
        assert ck.latest() == s
    assert ck.steps() == [5, 6, 7]
    ck.restore(6)  # a rollback: the next save is the latest, whatever its number
    ck.save(6, model=m)
    assert ck.latest() == 6 and ck.committed() == [5, 7, 6]


def test_a_save_never_prunes_a_step_another_job_committed_after_it(tmp_path):
    """Two jobs saving into one folder with keep_last=1: A committed 10, B committed 11 and pruned 10, then
    A's prune deleted 11, committed after A's own step; both saves returned and no step was left."""
    m = torch.nn.Linear(8, 8)
    a, b = Checkpointer(tmp_path, keep_last=1), Checkpointer(tmp_path, keep_last=1)
    a.save(5, model=m)
    prune = a._prune

    def interleaved(step, key, recycle=False):
        b.save(11, model=m)  # the other job commits (and prunes) between A's commit and A's prune
        return prune(step, key, recycle)

    a._prune = interleaved
    a.save(10, model=m)
    assert a.steps() == [11] and a.latest() == 11
    Checkpointer(tmp_path).verify(11)


def test_pruning_a_step_folder_that_is_a_link_removes_the_link_not_what_it_names(tmp_path):
    """A step linked in from an archive (the run's starting point) was pruned through the link: the files
    inside the archived step were deleted, and the next save wrote over its shard."""
    m = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 1024))  # a shard of 24 MiB
    archive = Checkpointer(tmp_path / "archive")
    archive.save(0, model=m)
    (tmp_path / "run").mkdir()
    os.symlink(archive.path(0), tmp_path / "run" / "step-00000000")
    ck = Checkpointer(tmp_path / "run", keep_last=2)
    assert ck.steps() == [0]
    for s in (1, 2, 3):
        ck.save(s, model=m)
    assert ck.steps() == [2, 3] and not os.path.lexists(tmp_path / "run" / "step-00000000")
    Checkpointer(tmp_path / "archive").verify(0)


def test_a_folder_named_like_a_step_but_not_as_path_names_it_is_not_a_step(tmp_path):
    """'step-000000007' (nine digits) was listed as step 7, whose path() is 'step-00000007': restore could not
    find it and every later save's pruning failed, so the folder grew without bound."""
    (tmp_path / "step-000000007").mkdir()
    ck = Checkpointer(tmp_path, keep_last=2)
    m = torch.nn.Linear(4, 4)
    for s in (11, 12, 13):
        ck.save(s, model=m)
    assert ck.steps() == [12, 13] and (tmp_path / "step-000000007").is_dir()
    ck.save(123456789, model=m)  # nine digits where eight do not hold the number: its own name, listed
    assert ck.steps() == [13, 123456789] and ck.latest() == 123456789


def test_a_deleted_checkpoint_folder_lists_no_step_and_restore_says_so(tmp_path):
    import shutil

    ck = Checkpointer(tmp_path / "ck")
    ck.save(1, model=torch.nn.Linear(2, 2))
    shutil.rmtree(tmp_path / "ck")
    assert ck.steps() == [] and ck.latest() is None  # were raw FileNotFoundErrors
    with pytest.raises(CheckpointError):
        ck.restore(model=torch.nn.Linear(2, 2))


def test_verify_of_a_step_whose_manifest_is_gone_names_the_manifest(tmp_path, capsys):
    from torchforge.cli import main

    ck = Checkpointer(tmp_path)
    ck.save(2, model=torch.nn.Linear(2, 2))
    os.remove(os.path.join(ck.path(2), "manifest.json"))
    assert main(["verify", ck.path(2)]) == 1
    out = capsys.readouterr().out
    assert "manifest.json" in out and "not a dataset" not in out  # it said: not a dataset of any known format


_EFBIG = """
import resource, signal, sys, torch
from torchforge.checkpoint import Checkpointer
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
ck = Checkpointer(sys.argv[1], direct_io=False)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
try:
    ck.save(1, model=torch.nn.Linear(1024, 1024))
except Exception as e:
    print(type(e).__name__, e.path)
"""


def test_a_file_that_cannot_be_made_as_large_as_it_must_be_is_named_in_the_error(tmp_path):
    """EFBIG from preallocating a shard (RLIMIT_FSIZE; ENOSPC alike) named the step's temporary folder."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _EFBIG, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.stdout.startswith("CheckpointError ") and proc.stdout.strip().endswith(".safetensors"), proc
    assert Checkpointer(tmp_path).steps() == []


def test_an_export_killed_before_it_finished_is_cleaned_by_the_next_export(tmp_path):
    from torchforge.checkpoint.distributed import host_name

    dead = tmp_path / f".hf.tmp-h{host_name()}-p{2**22 + 12345}"  # (no such pid)
    dead.mkdir()
    (dead / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 4096)
    ck = Checkpointer(tmp_path / "ck")
    ck.save(1, model=torch.nn.Linear(4, 4))
    ck.export(1, tmp_path / "hf")
    assert not dead.exists() and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
