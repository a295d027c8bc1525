"""torchforge.DataLoader: torch's DataLoader, with batches in shared memory, dead-worker recovery,
device staging and one owner of resume."""
from __future__ import annotations

import inspect
import logging
import multiprocessing
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.utils.data
from torch.utils.data.dataloader import _DatasetKind

from torchforge.loader.fetch import carried_part
from torchforge.loader.iterator import InProcessIter, WorkerIter
from torchforge.loader.slabs import SlabPool
from torchforge.loader.state import STATE_VERSION, Position, batch_samples, get_rng, sampler_of, set_rng

__all__ = ["DataLoader"]

log = logging.getLogger(__name__)
T_co = TypeVar("T_co", covariant=True)
_ON_ERROR = ("raise", "skip")
_TORCH_TAKES_IN_ORDER = "in_order" in inspect.signature(torch.utils.data.DataLoader.__init__).parameters


def _dataset_version(dataset: Any) -> str | None:
    """The version a dataset pins (a remote dataset's: its index's or objects' ETags and sizes, not its
    URL: a byte-identical copy elsewhere is the same version where the stores give the same ETags), through
    a FeatureStore join; None where it has none."""
    version = getattr(dataset, "content_version", None)
    if version is None:
        version = getattr(dataset, "version", None)
    return version if isinstance(version, str) else None


def _rebatched(state: dict[str, Any], batch_size: int | None) -> int | None:
    """The batches of ``batch_size`` samples (:func:`batch_samples`: 1 unbatched, None for a batch
    sampler's) a pass resumed from ``state`` skips: the state's own, unless it was saved with batches of
    another size and resumes by skipping batches (its sampler cannot say a sample position), where its
    samples are that many new batches; None if they are not a whole number of them. (Skipping the saved
    count of new batches repeated or lost samples.) Into a batch sampler's batches, the state's count."""
    saved = state.get("batch_size", batch_size)  # (a state saved before it was recorded: the same)
    if not state.get("skip_batches") or state.get("finished") or batch_size is None or saved == batch_size:
        return int(state["batches"])
    samples = int(state["samples"])
    return None if state.get("extra") or samples % batch_size else samples // batch_size


class DataLoader(torch.utils.data.DataLoader[T_co]):
    """A drop-in ``torch.utils.data.DataLoader``: the same arguments, defaults, checks, warnings and
    batches, loaded by worker processes that hand batches over in shared memory.

    >>> from torchforge import DataLoader
    >>> [b.tolist() for b in DataLoader(list(range(10)), batch_size=4)]
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]

    Every argument up to ``in_order`` is torch's, with torch's meaning and default. What differs:

    - with workers, each batch is collated straight into a shared-memory slab (torch's
      ``default_collate`` rules, see :mod:`torchforge.loader.collate`) and arrives without a copy; any
      picklable batch travels, its tensors and arrays out of band through the slab;
    - a worker that dies is restarted and its batches re-issued (torch ends the epoch with an error);
    - ``state_dict()`` / ``load_state_dict()`` resume exactly at the next batch (see
      :mod:`torchforge.loader.state`), with the sampler's and the dataset's own states included.

    Args:
        device: move every batch there (CUDA: page-locked slabs, copies on a side stream one batch
            ahead of the training step). Default None: batches stay on the host.
        on_error: ``"raise"`` (torch's behaviour) or ``"skip"``: a map-style sample whose
            ``__getitem__`` raises is left out of its batch, counted in :attr:`skipped` and logged.
        max_retries: how many times one batch may be re-issued after its worker died.
        seed_per_batch: seed ``random``, torch and numpy from (base seed, batch number, pass number)
            before each batch, so a seeded run's data does not depend on ``num_workers`` or on which worker
            served a batch, and a batch re-issued after a worker died is identical to the lost one.
    """

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler: torch.utils.data.Sampler | Iterable | None = None,
                 batch_sampler: torch.utils.data.Sampler[list] | Iterable[list] | None = None,
                 num_workers: int = 0, collate_fn: Callable[[list], Any] | None = None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: Any = None, generator: torch.Generator | None = None, *,
                 prefetch_factor: int | None = None, persistent_workers: bool = False, pin_memory_device: str = "",
                 in_order: bool = True, device: Any = None, on_error: str = "raise", max_retries: int = 3,
                 seed_per_batch: bool = False):
        if on_error not in _ON_ERROR:
            raise ValueError(f"on_error={on_error!r} is not one of {list(_ON_ERROR)}")
        if isinstance(max_retries, bool) or int(max_retries) < 0:
            raise ValueError(f"max_retries={max_retries!r} must be an int >= 0")
        extra = {"in_order": in_order} if _TORCH_TAKES_IN_ORDER else {}
        # by name: a framework that records the arguments of torch's __init__ (Lightning, for a subclass it
        # does not watch) rebuilds this class from them, and torch's positions are not this signature's
        super().__init__(dataset=dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                         batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate_fn,
                         pin_memory=pin_memory, drop_last=drop_last, timeout=timeout,
                         worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
                         generator=generator, prefetch_factor=prefetch_factor,
                         persistent_workers=persistent_workers, pin_memory_device=pin_memory_device, **extra)
        self.in_order = bool(in_order)
        self._custom_batch_sampler = batch_sampler is not None
        self.device = device
        self.on_error = on_error
        self.max_retries = int(max_retries)
        self.seed_per_batch = bool(seed_per_batch)
        self.skipped = 0  #: samples left out under on_error="skip", over the loader's lifetime
        self._resume: dict[str, Any] | None = None
        self._loaded_end: dict[str, Any] | None = None  # a loaded state saved at a pass's end
        self._carried_states: list[Any] | None = None  # its persistent workers' dataset states
        self._epoch_at_load: int | None = None  # the sampler's epoch when a pending state was loaded
        self._carried_seed: tuple[int, int] | None = None  # persistent workers resumed at a pass boundary:
        # (base seed, passes made under it)
        self._slabs: Any = None  # see _slab_pool
        self._pos: Any = None  # the Position of the latest pass (it outlives its iterator)

    # --- iteration ----------------------------------------------------------------------------------------
    def _get_iterator(self) -> Any:
        if self.num_workers == 0:
            it: Any = InProcessIter(self)
        else:
            self.check_worker_number_rationality()
            it = WorkerIter(self)
        return it

    def __iter__(self) -> Any:
        kept = self._iterator
        if kept is not None and not kept._alive():
            self._iterator = None  # closed, or stopped by an error: start new workers
        return super().__iter__()  # torch's: persistent workers reuse one iterator through _reset

    def _slab_pool(self) -> Any:
        """The loader's slab pool (created with the first workers; closed when the loader is collected)."""
        if self._slabs is None:
            self._slabs = SlabPool(keep=self.prefetch_factor * self.num_workers + 4)
        return self._slabs

    def _context(self) -> Any:
        ctx = self.multiprocessing_context
        return ctx if ctx is not None else multiprocessing.get_context()

    def _count_skipped(self, skipped: list) -> None:
        if skipped:
            self.skipped += len(skipped)
            for index, why in skipped:
                log.warning("skipped sample %s: %s", index, why)

    def slab_stats(self) -> dict[str, int]:
        """The shared-memory slabs batches travel in: ``{"slabs": open, "free": not in use}``, over the
        loader's pool and, with ``pin_memory`` and persistent workers, their page-locked pool."""
        pools = [self._slabs] if self._slabs is not None else []
        res = getattr(self._iterator, "_res", None)
        if res is not None and res.finalizer.alive and res.pool is not self._slabs:
            pools.append(res.pool)
        return {"slabs": sum(len(p) for p in pools), "free": sum(p.free_count for p in pools)}

    def close(self) -> None:
        """Stop the persistent workers now (they also stop when the loader is garbage collected)."""
        it, self._iterator = self._iterator, None
        if it is not None:
            it._shutdown_workers()

    # --- resume -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a fresh loader needs to yield exactly the batches that would have come next: the
        position in the pass, the sampler's and dataset's states, the worker seeds and per-worker
        dataset states (see :mod:`torchforge.loader.state`). Plain data."""
        if self._resume is not None or self._loaded_end is not None:  # loaded, not begun: what was loaded
            state = dict(self._resume if self._resume is not None else self._loaded_end)
            if self.generator is None and "global_rng" in state:  # as it is now (seeded since, or drawn from)
                state["global_rng"] = get_rng({"loader": None})["loader"]
            return state
        pos = self._pos
        if pos is None:  # no pass yet: a position at the end of a pass that never began
            pos = Position(max(self.num_workers, 1))
            pos.finished, pos.began = True, False
        state = pos.state_dict(self, self._dataset_kind == _DatasetKind.Iterable)
        if state["finished"] and self.generator is not None:
            state["generator"] = self.generator.get_state().numpy().tobytes().hex()
        if self.generator is None:  # the loader's next draws (seeds, a RandomSampler's order) come from it
            state["global_rng"] = get_rng({"loader": None})["loader"]
        version = _dataset_version(self.dataset)
        if version is not None:  # a remote dataset's pinned version: the state resumes over that one only
            state["dataset_version"] = version
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next ``iter()`` yields exactly the batches the saved run
        would have yielded next (at any world size, with a ``GlobalSampler``).

        A loader without ``generator=`` draws its seeds (and a ``RandomSampler`` its order) from torch's
        global generator, as torch's does: loading a state puts that generator back where the saved run's
        was at ``state_dict()``, so that later epochs are the saved run's too (a script that seeds
        itself the same way at every start drew the epoch after a resume in its first epoch's order).
        Seed torch after loading to draw otherwise; pass ``generator=`` to keep the loader off the global
        generator.

        Raises:
            ValueError: what :meth:`check_state_dict` raises, before anything changed.
        """
        _, finished = self.check_state_dict(state)
        self._load_state(state, finished)

    def check_state_dict(self, state: dict[str, Any]) -> tuple[int, bool]:
        """Raise what :meth:`load_state_dict` would raise for ``state``, changing nothing (a checkpoint
        restore checks the loader's state before it changes the model). Returns its version and whether its
        pass had finished.

        Raises:
            ValueError: not a DataLoader state or another version; a sampler state this loader's sampler cannot
                load (a ``GlobalSampler``'s ``SamplerError``: another seed, dataset or order); batches yielded
                out of order at another world size.
        """
        try:
            version, finished = int(state["version"]), bool(state["finished"])
            for key in ("batches", "samples", "base_seed", "sampler", "dataset", "workers"):
                state[key]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"not a DataLoader state (saved by torchforge.DataLoader.state_dict): "
                             f"{str(state)[:200]}") from None
        if version not in (1, STATE_VERSION):
            raise ValueError(f"DataLoader state version {version} is not 1 or {STATE_VERSION}")
        rng = state.get("global_rng")
        if rng is not None and not (isinstance(rng, str) and len(rng) == 2 * torch.get_rng_state().numel()
                                    and all(c in "0123456789abcdef" for c in rng)):
            raise ValueError(f"the state's global_rng is not a hex-encoded state of torch's generator: {str(rng)[:60]}")
        saved_version, version = state.get("dataset_version"), _dataset_version(self.dataset)
        if saved_version is not None and version is not None and saved_version != version:
            raise ValueError(f"the dataset is not the one the state was saved over (version {saved_version}, now "
                             f"{version}: overwritten at its URL since, or another copy): resuming its pass would mix "
                             "the two; resume over the dataset the state was saved with, or begin the epoch anew "
                             "(over a copy known to hold the same samples in the same order, drop the state's "
                             "'dataset_version')")
        target = sampler_of(self)
        saved = state["sampler"]
        if saved is not None and self._dataset_kind != _DatasetKind.Iterable and not callable(
                getattr(target, "load_state_dict", None)):
            raise ValueError(f"the state holds a sampler state ({str(saved)[:120]}), but this loader's "
                             f"{type(target).__name__} cannot load one: build the loader with the sampler the "
                             "state was saved with (a GlobalSampler's, say)")
        if state.get("extra") and isinstance(saved, dict) and "world_size" in saved and \
                saved["world_size"] != getattr(target, "world_size", saved["world_size"]):
            raise ValueError(f"the state was saved at world size {saved['world_size']} with batches yielded out "
                             f"of order (in_order=False: batches {state['extra'][:8]} ahead of batch "
                             f"{state['batches']}); it resumes at that world size only, not at "
                             f"{target.world_size}")
        if _rebatched(state, batch_samples(self)) is None:
            raise ValueError(f"the state was saved after {state['samples']} samples in batches of "
                             f"{state['batch_size']}, and this loader's batches of {batch_samples(self)} do not end "
                             "there" + (f" (batches {state['extra'][:8]} were yielded ahead, in_order=False)"
                                        if state.get("extra") else "") +
                             ": resume with a batch size that divides it, or with a GlobalSampler (it resumes "
                             "at any sample)")
        check = getattr(target, "check_state", None)
        if saved is not None and self._dataset_kind != _DatasetKind.Iterable and callable(check):
            check(saved)  # a state the sampler cannot load (another seed, dataset): refused now, changing nothing
        return version, finished

    def _load_state(self, state: dict[str, Any], finished: bool) -> None:
        target = sampler_of(self)
        if self.generator is None and state.get("global_rng") is not None:
            set_rng({"loader": None}, {"loader": state["global_rng"]})
        if self._iterator is not None:
            # persistent workers hold their dataset copies and random streams as this loader's last pass
            # left them: the state resumes on new ones, as in a fresh loader
            self.close()
        if state["dataset"] is not None:
            self.dataset.load_state_dict(state["dataset"])
        if not finished:
            self._resume = dict(state, batches=_rebatched(state, batch_samples(self)))
            self._epoch_at_load = getattr(target, "epoch", None)
            return
        self._resume = None
        self._loaded_end = dict(state)  # until the next pass begins, state_dict() says this, not a live pass's
        if self.persistent_workers and self.num_workers > 0 and state["base_seed"] is not None:
            # the saved run's workers went on into the next pass with their base seed (torch's _reset), and
            # with their dataset copies as they were: this loader's new workers start from those states (a
            # Stateful iterator's, the ended pass's, is loaded into an iterator the new pass then drops)
            self._carried_seed = (int(state["base_seed"]), int(state.get("pass", 0)))
            states = [carried_part(w.get("state")) for w in state["workers"] or []]
            if len(states) == self.num_workers and any(s is not None for s in states):
                self._carried_states = states
        if state["sampler"] is not None:
            sampler_of(self).load_state_dict(state["sampler"])
        if state.get("generator") and self.generator is not None:
            set_rng({"loader": self.generator}, {"loader": state["generator"]})

    def _take_carried_states(self) -> list[Any] | None:
        states, self._carried_states = self._carried_states, None
        return states

    def _take_carried_seed(self) -> tuple[int, int] | None:
        seed, self._carried_seed = self._carried_seed, None
        return seed

    def _take_resume(self) -> dict[str, Any] | None:
        state, self._resume = self._resume, None
        self._loaded_end = None
        return state
