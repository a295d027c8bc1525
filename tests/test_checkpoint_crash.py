"""Crash safety: writers SIGKILLed at random moments never leave a bad or mixed latest checkpoint.

A driver process (spawned, so the test's own threads are not inherited) forks writer children that save
continuously (blocking and non-blocking saves, several shards per group, keep_last pruning; every other
writer with direct I/O) and kills
each one with SIGKILL after a random delay. After every kill it checks, with no help from the writer,
that every visible step verifies and holds one step's values only.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

DRIVER = textwrap.dedent(r'''
    import json, os, random, signal, sys, time
    import numpy as np
    import torch
    torch.set_num_threads(1)
    from torchforge._ckpt_io import verify_files
    from torchforge.checkpoint import Checkpointer, MANIFEST, STATE
    from torchforge.formats.safetensors import load_safetensors

    root, kills, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)

    def child(k):
        if k % 2:  # every other writer uses direct I/O for every file, in small runs
            import torchforge._ckpt_io as io
            io.DIRECT_MIN, io.DIRECT_RUN, io._SUM_PIECE = 0, 64 << 10, 16 << 10
        torch.manual_seed(k)
        emb = torch.nn.Embedding(256, 128)
        model = torch.nn.Sequential(emb, torch.nn.Linear(128, 128), torch.nn.Linear(128, 256, bias=False))
        model[2].weight = emb.weight  # tied
        opt = torch.optim.AdamW(model.parameters())
        model(torch.zeros(1, dtype=torch.long)).sum().backward()
        opt.step()
        ck = Checkpointer(root, keep_last=3, max_shard_size="200KB", threads=2)
        step = (ck.latest() or 0) + 1
        while True:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(step)
                for st in opt.state.values():
                    st["exp_avg"].fill_(step)
                    st["exp_avg_sq"].fill_(step)
            ck.save(step, model=model, optimizer=opt, extra={"step": step}, blocking=step % 2 == 0)
            step += 1

    def check(folder, step):
        manifest = json.load(open(os.path.join(folder, MANIFEST)))
        verify_files(folder, manifest["files"], checksums=True)  # sizes and block digests
        state = json.load(open(os.path.join(folder, STATE)))
        assert state["step"] == step and state["extra"] == {"step": step}, (step, state["extra"])
        n = 0
        for name in manifest["files"]:
            if name.endswith(".safetensors"):
                for k, t in load_safetensors(os.path.join(folder, name)).items():
                    a = t.numpy()
                    if k.endswith(".step"):
                        continue
                    assert (a == step).all(), (name, k, step)  # not mixed with another step
                    n += 1
        assert n == 3 + 3 * 2, n  # emb, linear weight and bias (tied head stored once) + 2 AdamW moments each

    # lazy imports (torch.nn.init, torch.optim) happen here once, not in every child
    torch.optim.AdamW(torch.nn.Sequential(torch.nn.Embedding(2, 2), torch.nn.Linear(2, 2)).parameters())
    report = {"kills": 0, "mid_save": 0, "checked": 0, "latest": [], "errors": []}
    for k in range(kills):
        pid = os.fork()
        if pid == 0:
            try:
                child(k)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.02, 0.3))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        report["kills"] += 1
        names = os.listdir(root)
        report["mid_save"] += any(n.startswith((".tmp-", ".trash-")) for n in names)
        steps = Checkpointer.__new__(Checkpointer)
        steps.root = root
        visible = steps.steps()
        report["latest"].append(visible[-1] if visible else None)
        for s in visible:
            try:
                check(steps.path(s), s)
                report["checked"] += 1
            except Exception as e:
                report["errors"].append(f"kill {k} step {s}: {e!r}")
    print(json.dumps(report))
''')


def test_sigkill_at_random_moments_never_leaves_a_bad_latest_checkpoint(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    out = subprocess.run([sys.executable, "-c", DRIVER, str(root), "24", "7"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["errors"] == []
    assert report["kills"] >= 20
    assert report["mid_save"] >= 5, report  # the kills did land inside saves
    latest = [s for s in report["latest"] if s is not None]
    assert latest and latest == sorted(latest) and latest[-1] > 10, report  # progress survives the kills
    assert report["checked"] >= len(latest)
