"""Crash safety: a save SIGKILLed at each defined point of its course leaves a consistent checkpoint folder.

A forked child process saves steps 1 and 2, then saves step 3 with ``TORCHFORGE_CRASH_AT`` naming one of the
save's crash points (``torchforge.checkpoint.writer.CRASH_POINTS``), where the save SIGKILLs its own process. The
test checks that the child died there and nowhere else, lists exactly what is on disk, and checks that
the steps committed before the crash verify and restore bit for bit, that step 3 is either absent or
complete, that a half-written step cannot pass as a valid one, and that the next Checkpointer cleans up.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import traceback

import pytest
import torch

from torchforge.checkpoint import MANIFEST, Checkpointer
from torchforge.checkpoint.writer import CRASH_AT, CRASH_POINTS
from torchforge.errors import CheckpointError

BEFORE_COMMIT = {"tmp-created", "data-written", "manifest-written", "before-rename"}
CASES = [(point, mode) for point in (*CRASH_POINTS, "no-such-point") for mode in ("blocking", "background")]


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(64, 32)
    model = torch.nn.Sequential(emb, torch.nn.Linear(32, 32), torch.nn.Linear(32, 64, bias=False))
    model[2].weight = emb.weight  # tied
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, dtype=torch.long)).sum().backward()
    opt.step()
    return model, opt


@torch.no_grad()
def _fill(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    for p in model.parameters():
        p.fill_(step)
    for state in opt.state.values():
        state["exp_avg"].fill_(step)
        state["exp_avg_sq"].fill_(step)


def _restored(ck: Checkpointer, step: int) -> None:
    """Restore ``step`` (checksums included) into fresh objects: every tensor holds ``step``."""
    model, opt = _model()
    _fill(model, opt, -1)
    assert ck.restore(step, model=model, optimizer=opt, verify=True) == {"step": step}
    tensors = list(model.parameters()) + [t for s in opt.state.values() for k, t in s.items() if k != "step"]
    assert len(tensors) == 3 + 3 * 2  # emb (tied to the head), linear weight and bias, 2 AdamW moments each
    for t in tensors:
        assert (t == step).all(), (step, t)


def _save_steps_then_crash(root: str, point: str, mode: str) -> None:
    """Save steps 1 and 2, then step 3 with the hook armed at ``point``."""
    model, opt = _model()
    ck = Checkpointer(root, keep_last=2, max_shard_size="8KB", threads=2)
    for step in (1, 2, 3):
        _fill(model, opt, step)
        if step == 3:
            ck.wait()  # step 2 is committed before the hook is armed
            os.environ[CRASH_AT] = point
        ck.save(step, model=model, optimizer=opt, extra={"step": step}, blocking=mode == "blocking")
    ck.close()
    print("the save of step 3 finished: the crash point was never reached", file=sys.stderr)


def _drive(base: str) -> None:
    """The driver (this file run as a script, so that no pytest thread is forked): one forked child per
    case saves into ``base/<point>-<mode>/ck`` with its stderr in ``stderr.txt``; its wait status goes to
    ``status.json``. Forking after the imports keeps the cases fast."""
    torch.set_num_threads(1)
    _model()  # lazy imports (torch.nn.init, torch.optim) happen once, not in every child
    for point, mode in CASES:
        case = os.path.join(base, f"{point}-{mode}")
        os.makedirs(case)
        pid = os.fork()
        if pid == 0:
            try:
                fd = os.open(os.path.join(case, "stderr.txt"), os.O_WRONLY | os.O_CREAT, 0o644)
                os.dup2(fd, 2)
                _save_steps_then_crash(os.path.join(case, "ck"), point, mode)
                code = 0
            except BaseException:  # noqa: BLE001 - reported through stderr.txt and the exit status
                traceback.print_exc()
                code = 1
            finally:
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        with open(os.path.join(case, "status.json"), "w") as f:
            json.dump({"signal": signum, "exit": code}, f)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """Run every case once; return ``case(point, mode) -> (folder, wait status, stderr)``."""
    base = str(tmp_path_factory.mktemp("crash"))
    env = {k: v for k, v in os.environ.items() if k != CRASH_AT}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), base], capture_output=True, text=True,
                         timeout=300, check=False, env=env)
    assert out.returncode == 0, out.stderr[-3000:]

    def case(point: str, mode: str) -> tuple[str, dict, str]:
        folder = os.path.join(base, f"{point}-{mode}")
        with open(os.path.join(folder, "status.json")) as f:
            status = json.load(f)
        with open(os.path.join(folder, "stderr.txt")) as f:
            return folder, status, f.read()

    return case


@pytest.mark.parametrize("mode", ["blocking", "background"])
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_save_killed_at_each_point_leaves_previous_steps_and_no_partial_step(crashed, tmp_path, point, mode):
    folder, status, stderr = crashed(point, mode)
    root = os.path.join(folder, "ck")
    # it died by the hook's SIGKILL, at this point (the hook says which before it kills)
    assert status == {"signal": signal.SIGKILL, "exit": None}, (status, stderr[-3000:])
    assert stderr.count(f"{CRASH_AT}=") == 1 and f"{CRASH_AT}={point} reached" in stderr, stderr

    # what the crash left in the folder: exactly these names at each point
    names = sorted(os.listdir(root))
    tmps = [n for n in names if re.fullmatch(r"\.tmp-step-00000003-h\w+-p\d+-[0-9a-f]{8}", n)]
    trash = [n for n in names if re.fullmatch(r"\.trash-step-00000001-[0-9a-f]{8}", n)]
    if point in BEFORE_COMMIT:
        assert len(tmps) == 1 and names == sorted(tmps + ["step-00000001", "step-00000002"]), names
        visible = [1, 2]
    elif point == "after-rename":  # committed, not yet pruned
        assert names == ["step-00000001", "step-00000002", "step-00000003"], names
        visible = [1, 2, 3]
    else:  # "old-step-hidden": step 1 is pruned out of sight, its files not yet deleted
        assert point == "old-step-hidden"
        assert len(trash) == 1 and names == sorted(trash + ["step-00000002", "step-00000003"]), names
        visible = [2, 3]
    complete = sorted(os.listdir(os.path.join(root, "step-00000002")))
    assert MANIFEST in complete and "state.json" in complete and len(complete) >= 6, complete
    if tmps:  # the unfinished step 3 holds what the save had written when it died
        inside = sorted(os.listdir(os.path.join(root, tmps[0])))
        data = [n for n in complete if n != MANIFEST]
        want = {"tmp-created": [], "data-written": data}.get(point, complete)
        assert inside == want, (point, inside)

    # a half-written step cannot pass for a valid one: promoted by hand, it is refused or it is complete
    if tmps:
        copy = str(tmp_path / "promoted")
        shutil.copytree(os.path.join(root, tmps[0]), os.path.join(copy, "step-00000003"))
        promoted = Checkpointer(copy)
        if point in ("tmp-created", "data-written"):
            with pytest.raises(CheckpointError, match="manifest") as ei:
                promoted.restore(3, model=_model()[0])
            assert ei.value.path == os.path.join(copy, "step-00000003", MANIFEST)
        else:
            _restored(promoted, 3)
        promoted.close()

    # the next Checkpointer sees the committed steps, which verify and restore, and removes the leftovers
    with Checkpointer(root, keep_last=2) as ck:
        assert ck.steps() == visible and ck.latest() == visible[-1]
        assert sorted(os.listdir(root)) == [f"step-{s:08d}" for s in visible]
        for s in visible:
            ck.verify(s)
            _restored(ck, s)
        model, opt = _model()
        _fill(model, opt, 4)
        ck.save(4, model=model, optimizer=opt, extra={"step": 4})
        assert ck.steps() == [visible[-1], 4]
        _restored(ck, 4)


@pytest.mark.parametrize("mode", ["blocking", "background"])
def test_unknown_crash_point_does_not_kill(crashed, mode):
    folder, status, stderr = crashed("no-such-point", mode)
    assert status == {"signal": None, "exit": 0} and "never reached" in stderr, (status, stderr[-3000:])
    assert Checkpointer(os.path.join(folder, "ck")).steps() == [2, 3]


def _resave_then_crash(root: str, point: str, exchange: bool) -> None:
    """Save steps 2 and 3, then save step 2 again (new values) with the hook armed at ``point``."""
    import torchforge.checkpoint.checkpointer as mod

    if not exchange:  # a system without renameat2(RENAME_EXCHANGE): the two-rename path
        mod.exchange_paths = lambda a, b: False
    model, opt = _model()
    ck = Checkpointer(root, threads=2)
    for step, value in ((2, 2), (3, 3), (2, 20)):
        _fill(model, opt, value)
        if (step, value) == (2, 20):
            os.environ[CRASH_AT] = point
        ck.save(step, model=model, optimizer=opt, extra={"step": value})
    ck.close()


@pytest.mark.parametrize("exchange", [True, False])
@pytest.mark.parametrize(("point", "survivor"), [("before-rename", 2), ("old-step-hidden", None),
                                                 ("after-rename", 20)])
def test_resaving_a_step_is_atomic(tmp_path, point, survivor, exchange):
    """Killed anywhere in a re-save, the step is the complete old one or the complete new one."""
    import multiprocessing

    root = str(tmp_path / "ck")
    proc = multiprocessing.get_context("spawn").Process(target=_resave_then_crash, args=(root, point, exchange))
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL
    if survivor is None:  # swapped in one rename (the new one), or the old one put back by the next open
        survivor = 20 if exchange else 2
    with Checkpointer(root) as ck:
        assert ck.steps() == [2, 3], os.listdir(root)
        assert sorted(os.listdir(root)) == ["step-00000002", "step-00000003"]  # leftovers cleaned
        ck.verify(2)
        if survivor == 2:
            _restored(ck, 2)
        else:
            model, opt = _model()
            assert ck.restore(2, model=model, optimizer=opt, verify=True) == {"step": 20}
            assert all((p == 20).all() for p in model.parameters())


if __name__ == "__main__":
    _drive(sys.argv[1])
