"""torchforge.loader: a drop-in ``torch.utils.data.DataLoader`` whose workers hand batches over in
shared memory.

Layout (the data path, top to bottom):

- :mod:`~torchforge.loader.dataloader` -- :class:`DataLoader`: torch's arguments and checks, plus
  ``device``, ``on_error``, ``max_retries``, ``seed_per_batch``; ``state_dict``/``load_state_dict``.
- :mod:`~torchforge.loader.iterator` -- one pass: in process, or through the worker pool (round-robin
  tasks, in-order or as-ready batches, dead-worker restarts).
- :mod:`~torchforge.loader.worker` -- the worker process and the pool that supervises it;
  :mod:`~torchforge.loader.messages` -- what they say to each other (named fields).
- :mod:`~torchforge.loader.fetch` -- what one batch is made of (torch's fetcher semantics).
- :mod:`~torchforge.loader.collate` -- torch's default collate built in shared memory; ``empty`` for a
  user's collate to do the same; the opt-in ``padded_collate``.
- :mod:`~torchforge.loader.slabs` -- the shared-memory slabs batches travel in;
  :mod:`~torchforge.loader.transport` -- pickle protocol 5 with the buffers out of band in the slab.
- :mod:`~torchforge.loader.device` -- pinned slabs and side-stream copies to a device.
- :mod:`~torchforge.loader.state` -- what the resume state holds.

Interfaces other parts rely on: a worker's collate can allocate in the batch's slab through
:func:`~torchforge.loader.collate.empty` (a feature store gathers rows straight into it); a dataset
with ``state_dict()``/``load_state_dict()`` has its state saved and restored in the main process and in
every worker; ``torch.utils.data.get_worker_info()`` works inside workers as with torch.
"""
from torchforge.loader.collate import default_collate, empty, padded_collate
from torchforge.loader.dataloader import DataLoader

__all__ = ["DataLoader", "default_collate", "empty", "padded_collate"]
