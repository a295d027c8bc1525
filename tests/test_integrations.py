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


_RESUME = """
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch
import lightning as L
import torchforge

CKPT = sys.argv[1]


class Stop(Exception):
    pass


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.tensor([float(i)])


class Model(L.LightningModule):
    def __init__(self, stop_at=None):
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)
        self.seen, self.stop_at = [], stop_at

    def train_dataloader(self):
        return torchforge.DataLoader(Data(), batch_size=4, sampler=torchforge.GlobalSampler(Data(), seed=0))

    def training_step(self, batch, i):
        self.seen.append([self.current_epoch, batch.flatten().int().tolist()])
        return self.lin(batch).sum()

    def on_train_batch_end(self, out, batch, i):
        if self.stop_at is not None and self.global_step == self.stop_at:
            self.trainer.save_checkpoint(CKPT)  # a mid-epoch checkpoint, then the job dies
            raise Stop()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def trainer():
    return L.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False)


full = Model()
trainer().fit(full)
cut = Model(stop_at=4)
try:
    trainer().fit(cut)
except Stop:
    pass
rest = Model()
trainer().fit(rest, ckpt_path=CKPT)
print(json.dumps({"full": full.seen, "resumed": cut.seen + rest.seen}))
"""


def test_lightning_resume_with_a_global_sampler_trains_every_later_epoch_whole(tmp_path):
    """Lightning reads len(loader) once, after loading the loader's state and calling iter(); a sampler
    whose len() was the resumed pass's remainder cut every later epoch to it (2 of 6 batches)."""
    run = subprocess.run([sys.executable, "-c", _RESUME, str(tmp_path / "mid.ckpt")], capture_output=True,
                         text=True, timeout=240, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert [sum(e == k for e, _ in got["full"]) for k in range(3)] == [6, 6, 6]
    assert got["resumed"] == got["full"]
