"""Atomic, versioned, verified, optionally asynchronous checkpoints in safetensors shards. No pickle.

Modules: ``checkpointer`` (:class:`Checkpointer`), ``writer`` (shard planning and the parallel
checksummed writer), ``digest`` (block checksums and verification), ``staging`` (the snapshot buffer and
tensor copies), ``state`` (model/optimizer/extra state to tensors + JSON and back), ``distributed``
(saves and resharding restores under torch.distributed) and ``export`` (Hugging Face output).

Layout of ``root``::

    step-00000100/
        model-00001-of-00002.safetensors ...   model.safetensors.index.json   (Hugging Face format)
        optimizer-00001-of-00001.safetensors   optimizer.safetensors.index.json
        extra-00001-of-00001.safetensors       extra.safetensors.index.json   (only if extra has tensors)
        state.json       non-tensor state as JSON: optimizer param groups, step counters, ``extra``, aliases
        manifest.json    every other file's size and a digest per 64 MiB block (written last; see checkpoint.digest)

A step is written into ``.tmp-step-…`` with every file fsynced, then the folder is fsynced and renamed to
``step-…`` and the root fsynced: a step folder is either complete or absent, whatever moment a crash
hits. Older steps beyond ``keep_last`` are removed only after the new step is committed.

>>> ckpt = Checkpointer("runs/a/ckpt", keep_last=3)  # doctest: +SKIP
>>> ckpt.save(step, model=model, optimizer=opt, extra={"epoch": 2}, blocking=False)  # doctest: +SKIP
>>> extra = ckpt.restore(model=model, optimizer=opt)  # latest step  # doctest: +SKIP
"""
from torchforge.checkpoint.checkpointer import MANIFEST, STATE, Checkpointer

__all__ = ["MANIFEST", "STATE", "Checkpointer"]
