"""torchforge.DataLoader inside training frameworks written by others that rebuild loaders (Lightning
re-instantiates a loader from the constructor arguments it recorded, with its own sampler)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("lightning")

_SCRIPT = """
import json, sys
if sys.argv[1] == "torchforge-first":
    import torchforge
import torch
import lightning as L
import torchforge


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)

    def predict_dataloader(self):  # the loader is made inside the hook, as Lightning's examples do
        ds = torch.utils.data.TensorDataset(torch.arange(10).float().unsqueeze(1))
        return torchforge.DataLoader(ds, batch_size=4, num_workers=int(sys.argv[2]), on_error="skip")

    def predict_step(self, batch, i):
        return batch[0]


trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False)
out = trainer.predict(Model())  # predict rebuilds the loader around its own batch sampler
loader = trainer.predict_dataloaders
print(json.dumps({"out": [o.flatten().tolist() for o in out], "type": type(loader).__module__,
                  "on_error": loader.on_error}))
"""


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("order", ["torch-first", "torchforge-first"])
def test_lightning_rebuilds_a_loader_made_inside_its_hook(order, workers):
    run = subprocess.run([sys.executable, "-c", _SCRIPT, order, str(workers)], capture_output=True, text=True,
                         timeout=240, check=False)
    assert run.returncode == 0, run.stderr[-3000:]  # was: TypeError: got multiple values for argument 'sampler'
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["out"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] and got["type"].startswith("torchforge.")
    if order == "torch-first":  # torch loaded before torchforge (any script importing torch or lightning
        assert got["on_error"] == "skip"  # first): the class exists before Lightning watches, all kept
