"""`make demo`: the whole pipeline on a small generated dataset, on the CPU, in well under two minutes.

1. generate a synthetic multimodal dataset (chat turns + a small image + a label) as JSONL;
2. convert it to JINX and to MDS with ``torchforge.convert``;
3. read it lazily and globally shuffled across two simulated ranks;
4. train a tiny model with ``torchforge.DataLoader`` over a ``GlobalSampler``;
5. save a checkpoint, restore it into a fresh model and check the weights are identical;
6. print throughput at each step.

Run: ``python -m torchforge.demo [--samples N] [--out DIR]``.
"""
from __future__ import annotations

import argparse
import base64
import os
import random
import tempfile
import time

import numpy as np
import orjson
import torch

IMAGE_SHAPE = (16, 16, 3)
WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "red", "blue", "green", "quick", "brown", "fox", "jumps", "over", "lazy"]


def write_jsonl(path: str, n: int, seed: int = 0) -> None:
    """Write ``n`` chat samples; the label is whether the image is brighter than average."""
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        for i in range(n):
            bright = rng.random() < 0.5
            img = nrng.integers(64 if bright else 0, 256 if bright else 192, IMAGE_SHAPE, dtype=np.uint8)
            turns = [{"role": r, "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 30)))}
                     for _ in range(rng.randint(1, 4)) for r in ("user", "assistant")]
            f.write(orjson.dumps({"id": i, "messages": turns, "label": int(bright),
                                  "image_b64": base64.b64encode(img.tobytes()).decode()}) + b"\n")


def to_training_sample(sample) -> dict:
    """Decode a stored sample into model inputs (runs in the loader's workers)."""
    img = np.frombuffer(base64.b64decode(sample["image_b64"]), dtype=np.uint8).reshape(IMAGE_SHAPE)
    return {"id": int(sample["id"]), "image": img, "label": int(sample["label"]),
            "n_turns": len(sample["messages"])}


class TrainView(torch.utils.data.Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        return to_training_sample(self.ds[i])


def _rate(n: int, t0: float) -> str:
    dt = time.perf_counter() - t0
    return f"{n} in {dt:.2f}s = {n / max(dt, 1e-9):,.0f}/s"


def main(argv: list[str] | None = None) -> None:
    import torchforge
    from torchforge.convert import convert

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default=None, help="work folder (default: a temporary one, removed after)")
    args = ap.parse_args(argv)
    tmp = None if args.out else tempfile.TemporaryDirectory(prefix="torchforge-demo-")
    root = args.out or tmp.name
    os.makedirs(root, exist_ok=True)
    t_all = time.perf_counter()

    src = os.path.join(root, "chat.jsonl")
    t0 = time.perf_counter()
    write_jsonl(src, args.samples)
    print(f"[1] generated {src}: {_rate(args.samples, t0)}")

    jinx_dir, mds_dir = os.path.join(root, "jinx"), os.path.join(root, "mds")
    t0 = time.perf_counter()
    convert(src, jinx_dir, to="jinx", compression="zst", encoding="b64", binary_threshold=1024)
    print(f"[2] JSONL -> JINX: {_rate(args.samples, t0)}")
    t0 = time.perf_counter()
    convert(src, mds_dir, to="mds", compression="zstd")
    print(f"    JSONL -> MDS:  {_rate(args.samples, t0)}")

    ds = torchforge.open_dataset(jinx_dir)
    mds = torchforge.open_dataset(mds_dir)
    assert len(ds) == len(mds) == args.samples
    t0 = time.perf_counter()
    ids = [ds[i]["id"] for i in range(len(ds))]  # lazy: only "id" is decoded
    print(f"[3] lazy read of one field (JINX): {_rate(len(ids), t0)}")
    seen = []
    for rank in range(2):
        s = torchforge.GlobalSampler(len(ds), shuffle=True, seed=1, rank=rank, world_size=2)
        seen += [ds[i]["id"] for i in s]
    print(f"    global shuffle over 2 simulated ranks covers {len(set(seen))}/{len(ds)} ids exactly once: "
          f"{sorted(seen) == list(range(len(ds)))}")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(int(np.prod(IMAGE_SHAPE)), 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = torchforge.GlobalSampler(len(ds), shuffle=True, seed=0)
    loader = torchforge.DataLoader(TrainView(ds), batch_size=64, sampler=sampler, num_workers=2)
    t0, seen, step = time.perf_counter(), 0, 0
    while step < args.steps:
        for batch in loader:
            x = batch["image"].float().div_(255.0)
            loss = torch.nn.functional.cross_entropy(model(x), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen += len(batch["label"])
            step += 1
            if step % 20 == 0:
                print(f"    step {step}: loss {loss.item():.4f}")
            if step >= args.steps:
                break
        sampler.set_epoch(sampler.epoch + 1)
    print(f"[4] trained {step} steps with torchforge.DataLoader: {_rate(seen, t0)}")

    ckpt = torchforge.Checkpointer(os.path.join(root, "ckpt"), keep_last=2)
    t0 = time.perf_counter()
    ckpt.save(step, model=model, optimizer=opt, extra={"step": step, "sampler": sampler.state_dict()})
    print(f"[5] saved checkpoint step {step} in {time.perf_counter() - t0:.3f}s")
    ckpt.verify(step)  # raises CheckpointError naming the damaged file
    print("    verified sizes and checksums")
    fresh = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(int(np.prod(IMAGE_SHAPE)), 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 2))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    extra = ckpt.restore(model=fresh, optimizer=fresh_opt)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    print(f"    restored step {extra['step']} in {time.perf_counter() - t0:.3f}s; weights identical: {same}")
    if not same:
        raise SystemExit("restore did not reproduce the weights")
    print(f"demo done in {time.perf_counter() - t_all:.1f}s")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
