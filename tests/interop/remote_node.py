"""One rank of the simulated multi-node run in tests/test_remote.py (started by torchrun, gloo).

Every node (a torchrun of its own, ``--node-rank``) reads the remote MDS dataset through its own cache
folder and its own counting proxy, with ``GlobalSampler(shard_affinity=True)``: each rank writes the ids
it read, per epoch, to ``<out>/rank-<rank>.json``.

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank N --master-addr 127.0.0.1 --master-port P \\
        remote_node.py URL CACHE_DIR ENDPOINT SEED OUT
"""
from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

import torchforge
from torchforge.sampler import GlobalSampler


def main() -> None:
    url, cache, endpoint, seed, out = sys.argv[1:6]
    dist.init_process_group("gloo")
    ds = torchforge.open_dataset(url, cache_dir=cache, storage_options={"endpoint": endpoint})
    sampler = GlobalSampler(ds, seed=int(seed), shard_affinity=True)
    loader = torchforge.DataLoader(ds, batch_size=4, sampler=sampler, num_workers=1,
                                   collate_fn=lambda b: [int(s["id"]) for s in b])
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        epochs.append([i for batch in loader for i in batch])
    with open(os.path.join(out, f"rank-{dist.get_rank()}.json"), "w") as f:
        json.dump({"node": sampler.rank // int(os.environ["LOCAL_WORLD_SIZE"]), "epochs": epochs}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
