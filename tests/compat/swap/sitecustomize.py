"""Loaded at start-up by every Python process the torch test-suite run starts (PYTHONPATH points here):
puts torchforge.DataLoader in place of torch.utils.data.DataLoader when TORCHFORGE_SWAP=1, so processes
the tests spawn see the same swap as the test process."""
import os

if os.environ.get("TORCHFORGE_SWAP") == "1":
    import torch.utils.data
    import torch.utils.data.dataloader

    import torchforge.loader

    torch.utils.data.DataLoader = torchforge.loader.DataLoader
    torch.utils.data.dataloader.DataLoader = torchforge.loader.DataLoader
