"""A committed step folder that lies: each lie is a CheckpointError naming the file, before any tensor
is written, never stale or uninitialized values restored and never a file read from outside the step.

The steps here are distributed-layout (version 2) steps built by hand, so that each test controls every
chunk and file; `tests/test_checkpoint_dist.py` saves real ones from gloo ranks.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from torchforge import DataLoader
from torchforge.checkpoint import Checkpointer
from torchforge.checkpoint.digest import BLOCK, BlockDigest
from torchforge.errors import CheckpointError
from torchforge.formats.safetensors import save_safetensors

F = "rank-00000-00000.safetensors"


class _W(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((4,), -7.0))


def _digests(path: str) -> list[str]:
    out = []
    with open(path, "rb") as f:
        while True:
            block = f.read(BLOCK)
            if not block and out:
                return out
            d = BlockDigest()
            d.update(memoryview(block))
            out.append(d.hexdigest())
            if len(block) < BLOCK:
                return out


def _step(root, tensors=None, table=None, spec=None, ranks=None, world=1):
    """Step 1 of a distributed-layout checkpoint under ``root``, with true sizes and digests for every
    file: ``tensors`` {file: {key: tensor}}, the manifest's tensor ``table``, its ``spec`` and the rank
    files' contents ``ranks`` (one dict per rank)."""
    step = os.path.join(root, "step-00000001")
    os.makedirs(step)
    tensors = tensors if tensors is not None else {F: {"model.w@0": torch.arange(4.0)}}
    for fn, d in tensors.items():
        save_safetensors(d, os.path.join(step, fn))
    for r, info in enumerate(ranks or [{}] * world):
        with open(os.path.join(step, f"rank-{r:05d}.json"), "w") as f:
            json.dump({"rank": r, "world_size": world, "state": None, "state_tensors": {}, "loader": None, **info}, f)
    files = {fn: {"size": os.path.getsize(os.path.join(step, fn)), "digests": _digests(os.path.join(step, fn))}
             for fn in sorted(os.listdir(step))}
    table = table if table is not None else {"model.w": {"shape": [4], "dtype": "float32", "chunks": [
        {"file": F, "key": "model.w@0", "offsets": [0], "sizes": [4]}]}}
    spec = spec if spec is not None else {"model": {"w": {"__tensor__": "model.w"}}, "extra": None}
    m = {"format": "torchforge-checkpoint", "version": 2, "step": 1, "world_size": world, "committed": 1,
         "checksum": "blake2b128-of-4KiB-page-sum64, 64MiB blocks", "files": files, "tensors": table, "spec": spec}
    with open(os.path.join(step, "manifest.json"), "w") as f:
        json.dump(m, f)
    return step


def _edit(path, fn):
    """Rewrite the JSON file at ``path`` with ``fn`` applied to its object."""
    with open(path) as f:
        doc = json.load(f)
    fn(doc)
    with open(path, "w") as f:
        json.dump(doc, f)


def _w(chunks, shape=(4,), dtype="float32"):
    return {"model.w": {"shape": list(shape), "dtype": dtype, "chunks": chunks}}


def _c(key, offsets, sizes, file=F):
    return {"file": file, "key": key, "offsets": offsets, "sizes": sizes}


def test_a_true_hand_built_step_restores(tmp_path):
    _step(tmp_path)
    m = _W()
    Checkpointer(tmp_path).restore(1, model=m, verify=True)
    assert m.w.tolist() == [0.0, 1.0, 2.0, 3.0]


HALVES = {F: {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0, 4.0]), "eight": torch.arange(8.0),
              "three": torch.tensor([1.0, 2.0, 3.0]), "one": torch.tensor(9.0)}}


@pytest.mark.parametrize("chunks, shape, dtype, says", [
    ([_c("a", [0], [2]), _c("b", [0], [2])], [4], "float32", "do not tile"),  # the same half twice, [2:4] unwritten
    ([_c("eight", [0], [8])], [4], "float32", "outside the shape"),
    ([_c("eight", [-4], [8])], [4], "float32", "outside the shape"),
    ([_c("three", [0], [3]), _c("one", [], [])], [4], "float32", "not 1 ints"),  # a 0-dim chunk would broadcast
    ([_c("a", [0], [2]), _c("b", [2], [2])], [-2], "float32", "shape"),
    ([_c("a", [0], [2]), _c("b", [2], [2])], [4], "float99", "not a torch dtype"),
    ([_c("a", [0], [2]), _c("b", [2], [2])], [4], "nn", "not a torch dtype"),  # torch.nn is not a dtype
    ([_c("a", [0], [2]), _c("b", [2], [2], file="../outside.safetensors")], [4], "float32", "does not name a file"),
    ([_c("a", [0], ["2"]), _c("b", [2], [2])], [4], "float32", "not 1 ints"),
])
def test_a_lying_tensor_table_is_a_checkpoint_error_before_anything_is_written(tmp_path, chunks, shape, dtype, says):
    step = _step(tmp_path, HALVES, _w(chunks, shape, dtype))
    m = _W()
    with pytest.raises(CheckpointError, match=says) as e:
        Checkpointer(tmp_path).restore(1, model=m)
    assert e.value.path == os.path.join(step, "manifest.json")
    assert m.w.tolist() == [-7.0] * 4
    with pytest.raises(CheckpointError, match=says):
        Checkpointer(tmp_path).export(1, tmp_path / "hf")
    assert not os.path.exists(tmp_path / "hf")


def test_a_chunk_stored_in_another_dtype_than_the_manifest_says_is_not_converted(tmp_path):
    step = _step(tmp_path, {F: {"w": torch.tensor([1e300, 2, 3, 4], dtype=torch.float64)}},
                 _w([_c("w", [0], [4])]))
    m = _W()
    with pytest.raises(CheckpointError, match="float64 .4., the manifest says float32") as e:
        Checkpointer(tmp_path).restore(1, model=m)
    assert e.value.path == os.path.join(step, F) and m.w.tolist() == [-7.0] * 4


def test_extra_tensors_whose_chunks_repeat_are_never_returned_half_uninitialized(tmp_path):
    table = {**_w([_c("a", [0], [2]), _c("b", [2], [2])]),
             "extra.x": {"shape": [1000], "dtype": "float32", "chunks": [_c("a", [0], [2])] * 500}}
    _step(tmp_path, HALVES, table, spec={"model": {"w": {"__tensor__": "model.w"}},
                                         "extra": {"x": {"__tensor__": "extra.x"}}})
    with pytest.raises(CheckpointError, match="'extra.x'.*do not tile"):
        Checkpointer(tmp_path).restore(1, model=_W())


def test_a_damaged_tensor_file_is_named_with_its_offset_not_blamed_on_the_manifest(tmp_path):
    step = _step(tmp_path)
    with open(os.path.join(step, F), "r+b") as f:  # the header is no longer JSON; the size is unchanged
        f.seek(9)
        f.write(b"x")
    for call in (lambda ck: ck.restore(1, model=_W()), lambda ck: ck.export(1, tmp_path / "hf")):
        with pytest.raises(CheckpointError) as e:
            call(Checkpointer(tmp_path))
        assert e.value.path == os.path.join(step, F) and e.value.offset is not None


def test_rank_state_reads_only_files_the_manifest_lists_and_names_a_damaged_rank_file(tmp_path):
    outside = tmp_path / "outside.safetensors"
    save_safetensors({"secret": torch.tensor([42.0])}, str(outside))
    step = _step(tmp_path / "a", ranks=[{"state": {"s": {"__tensor__": "secret"}},
                                         "state_tensors": {"secret": {"file": "../../outside.safetensors"}}}])
    with pytest.raises(CheckpointError, match="does not list") as e:
        Checkpointer(tmp_path / "a").rank_state(1)
    assert e.value.path == os.path.join(step, "rank-00000.json")
    step = _step(tmp_path / "b", ranks=[{"state": {"s": {"__tensor__": "nowhere"}}}])
    with pytest.raises(CheckpointError, match="damaged") as e:
        Checkpointer(tmp_path / "b").rank_state(1)
    assert e.value.path == os.path.join(step, "rank-00000.json")
    step = _step(tmp_path / "c")
    os.unlink(os.path.join(step, "rank-00000.json"))
    with pytest.raises(CheckpointError, match="unreadable") as e:
        Checkpointer(tmp_path / "c").rank_state(1)
    mpath = os.path.join(_step(tmp_path / "d"), "manifest.json")
    _edit(mpath, lambda m: m.pop("world_size"))
    with pytest.raises(CheckpointError, match="world_size") as e:
        Checkpointer(tmp_path / "d").rank_state(1)
    assert e.value.path == mpath


@pytest.mark.parametrize("loader_state", [[1, 2], {"sampler": {"epoch": 0, "position": 3}, "workers": [5]}])
def test_a_malformed_loader_state_saved_at_another_world_size_is_a_checkpoint_error(tmp_path, loader_state):
    step = _step(tmp_path, ranks=[{"loader": loader_state}] * 2, world=2)
    with pytest.raises(CheckpointError, match="not a loader's state_dict") as e:
        Checkpointer(tmp_path).restore(1, model=_W(), loader=DataLoader(list(range(8)), batch_size=2))
    assert e.value.path == os.path.join(step, "rank-00000.json")


def test_a_nul_byte_in_a_listed_file_name_is_a_checkpoint_error(tmp_path):
    step = _step(tmp_path)
    mpath = os.path.join(step, "manifest.json")
    _edit(mpath, lambda m: m["files"].update({"a\x00b": {"size": 1, "digests": ["00"]}}))
    for call in (lambda ck: ck.restore(1, model=_W()), lambda ck: ck.verify(1)):
        with pytest.raises(CheckpointError, match="unreadable manifest") as e:
            call(Checkpointer(tmp_path))
        assert e.value.path == mpath


def test_verify_fails_when_the_manifest_lists_fewer_block_digests_than_the_file_has_blocks(tmp_path):
    step = _step(tmp_path)
    Checkpointer(tmp_path).verify(1)
    with open(os.path.join(step, F), "r+b") as f:  # one bit of the data flipped
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        Checkpointer(tmp_path).verify(1)
    mpath = os.path.join(step, "manifest.json")
    _edit(mpath, lambda m: m["files"][F].update(digests=[]))  # the damage would go unseen with no digest
    for call in (lambda ck: ck.verify(1), lambda ck: ck.restore(1, model=_W(), verify=True)):
        with pytest.raises(CheckpointError, match="block digests") as e:
            call(Checkpointer(tmp_path))
        assert e.value.path == os.path.join(step, F)


def _adamw_step(root: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    ck = Checkpointer(root)
    ck.save(1, model=m, optimizer=opt)
    ck.close()
    return m, opt


@pytest.mark.parametrize(("old", "new"), [('"step": {', '"stdp": {'), ('"__tensor__": "state.0.step"',
                                                                        '"__tensoR__": "state.0.step"')])
def test_a_flipped_byte_in_state_json_is_a_checkpoint_error_naming_it_without_verify(tmp_path, old, new):
    """One flipped bit in state.json (a key of the optimizer state) reached torch's Adam.__setstate__ as a
    raw KeyError/TypeError: restore without verify=True trusted the file. Its checksum is now always
    checked (the small JSON files only; tensors' checksums still need verify=True)."""
    root = str(tmp_path / "ck")
    _adamw_step(root)
    path = os.path.join(root, "step-00000001", "state.json")
    with open(path) as f:
        text = f.read()
    assert old in text and len(old) == len(new)
    with open(path, "w") as f:
        f.write(text.replace(old, new, 1))
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="checksum mismatch") as e:
        Checkpointer.reader(root).restore(model=m, optimizer=opt)
    assert e.value.path == path


def test_an_optimizer_state_its_optimizer_rejects_is_a_checkpoint_error():
    from torchforge.checkpoint.state import restore_optimizer

    m = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    saved = {"state": {0: {"exp_avg": torch.zeros(2, 4), "exp_avg_sq": torch.zeros(2, 4)}},  # no "step"
             "param_groups": [{**{k: v for k, v in opt.param_groups[0].items() if k != "params"}, "params": [0, 1]}]}
    with pytest.raises(CheckpointError, match="AdamW rejects the stored optimizer state") as e:
        restore_optimizer(opt, saved, "/ck/step-00000001/state.json")
    assert e.value.path == "/ck/step-00000001/state.json"


def test_an_out_of_order_loader_state_saved_at_another_world_size_is_not_remapped(tmp_path):
    """with in_order=False, batches yielded ahead of a rank's position are batch numbers of that world size:
    remapped to another, they skipped the wrong batches (samples lost and repeated)."""
    state = {"version": 2, "finished": False, "batches": 0, "extra": [1, 3], "samples": 0, "base_seed": 1,
             "sampler": {"epoch": 0, "position": 0}, "dataset": None, "workers": [], "skip_batches": False}
    step = _step(tmp_path, ranks=[{"loader": state}] * 2, world=2)
    with pytest.raises(CheckpointError, match="out of order") as e:
        Checkpointer(tmp_path).restore(1, model=_W(), loader=DataLoader(list(range(8)), batch_size=2))
    assert e.value.path == step
