"""Start test processes (gloo ranks, a driver) from a fork server that imported torch once.

A spawned rank imports torch and torchforge afresh, seconds on 2 cores; a rank forked by the fork server
starts in a fraction of one, and still not as a fork of the test process (whose threads a child must not
inherit). The preload applies when this process starts its server: a later call only reuses it.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
from collections.abc import Callable
from typing import Any

import torch.multiprocessing

PRELOAD = ["torch", "torch.distributed", "torchforge"]


def fork_server(*modules: str) -> multiprocessing.context.BaseContext:
    """The forkserver context, its server preloading torch, torchforge and ``modules`` (the test module, so
    a rank's target is there without an import) if this call starts it."""
    ctx = multiprocessing.get_context("forkserver")
    if getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None) is None:
        ctx.set_forkserver_preload([*PRELOAD, *modules])
    return ctx


def start_ranks(fn: Callable[..., Any], args: tuple, nprocs: int, *, join: bool = True) -> Any:
    """``torch.multiprocessing.start_processes`` (``spawn``'s signature) with the ranks started by the fork
    server; ``fn(rank, *args)`` in each."""
    fork_server(fn.__module__)
    return torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, join=join,
                                                 start_method="forkserver")
