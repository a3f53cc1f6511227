"""The seed of a test's random inputs: fixed by default, so every run draws the same inputs and a
failure replays; ``BIGBATCH_TEST_SEED=<n>`` uses n everywhere; ``BIGBATCH_TEST_SEED=random`` draws
a fresh one each time (printed, to replay a failure)."""

from __future__ import annotations

import os
import zlib


def seed_for(name: str) -> int:
    """The seed for the test (or module-scoped fixture) called ``name``; printed."""
    chosen = os.environ.get("BIGBATCH_TEST_SEED")
    if chosen == "random":
        seed = int.from_bytes(os.urandom(4), "little")
    elif chosen:
        seed = int(chosen)
    else:
        seed = zlib.crc32(name.encode())
    print(f"BIGBATCH_TEST_SEED={seed}")
    return seed
