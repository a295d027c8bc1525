"""The synthetic multimodal chat dataset the benchmarks share.

``synth_samples(n, seed)`` yields ``n`` samples, deterministic in ``seed``:
``{"id": int, "messages": [{"role": "user"|"assistant", "content": str}, ...1-4 turns],
"image": bytes}`` where the "image" is 10-90 KiB of incompressible random bytes and the messages are
English-like text (a few words to a few hundred characters). Used by the JINX, MDS and loader
benchmarks so that they all measure the same data.
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["N_DEFAULT", "synth_samples"]

N_DEFAULT = 20_000
_WORDS = (  # noqa: SIM905 - a paragraph reads better than 200 quoted words
    "the a of to and in is it you that he was for on are with as I his they be at one have this from or "
    "had by not word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make thing "
    "see him two has look more day could go come did number sound no most people my over know water than "
    "call first who may down side been now find any new work part take get place made live where after "
    "back little only round man year came show every good me give our under name very through just form "
    "sentence great think say help low line differ turn cause much mean before move right boy old too "
    "same tell does set three want air well also play small end put home read hand port large spell add "
    "even land here must big high such follow act why ask men change went light kind off need house "
    "picture try us again animal point mother world near build self earth father image model token data"
).split()


def _text(rng: random.Random, lo: int, hi: int) -> str:
    target = rng.randint(lo, hi)
    words: list[str] = []
    size = 0
    while size < target:
        w = rng.choice(_WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)


def synth_samples(n: int = N_DEFAULT, seed: int = 0) -> Iterator[dict[str, Any]]:
    """Yield ``n`` chat samples with an incompressible 10-90 KiB "image" each (deterministic in ``seed``)."""
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    for i in range(n):
        turns = rng.randint(1, 4)
        messages = [{"role": "user" if t % 2 == 0 else "assistant", "content": _text(rng, 8, 400)}
                    for t in range(turns)]
        image = nrng.integers(0, 256, size=rng.randint(10 * 1024, 90 * 1024), dtype=np.uint8).tobytes()
        yield {"id": i, "messages": messages, "image": image}
