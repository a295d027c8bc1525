"""Loaded at start-up by every Python process the test-suite runs start (PYTHONPATH points here): puts
torchforge.DataLoader in place of torch.utils.data.DataLoader when TORCHFORGE_SWAP=1, and of torchdata's
StatefulDataLoader when TORCHFORGE_SWAP=torchdata, so processes the tests spawn see the same swap as the
test process."""
import os

if os.environ.get("TORCHFORGE_SWAP") == "1":
    import torch.utils.data
    import torch.utils.data.dataloader

    import torchforge.loader

    torch.utils.data.DataLoader = torchforge.loader.DataLoader
    torch.utils.data.dataloader.DataLoader = torchforge.loader.DataLoader

if os.environ.get("TORCHFORGE_SWAP") == "torchdata":
    import torchdata.stateful_dataloader as _sdl

    import torchforge.loader

    class StatefulDataLoader(torchforge.loader.DataLoader):
        """torchforge's loader under torchdata's name; ``snapshot_every_n_steps`` (how often torchdata
        snapshots its workers' states; its resume is exact at any value) has no counterpart and is dropped."""

        def __init__(self, *args, snapshot_every_n_steps=None, **kwargs):
            super().__init__(*args, **kwargs)

    _sdl.StatefulDataLoader = StatefulDataLoader
