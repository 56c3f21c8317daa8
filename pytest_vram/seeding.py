"""Seeding the random generators before each measured test, so that a rerun draws the same
numbers and allocates the same memory (as pytest-randomly does for its own reasons)."""

from __future__ import annotations

import random
import sys
import zlib

__all__ = ["DEFAULT_SEED", "seed_for", "seed_generators"]

#: The seed every measured test starts from unless ``--vram-seed`` says otherwise.
DEFAULT_SEED = 0


def seed_for(seed: int, nodeid: str) -> int:
    """The seed of the test ``nodeid`` in a run seeded with ``seed``: the same in every run,
    process and order, and another for each test, so that tests do not all draw one stream."""
    return zlib.crc32(f"{seed}:{nodeid}".encode())


def seed_generators(seed: int) -> None:
    """Seed Python's, NumPy's (where imported) and torch's (where imported) generators."""
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    torch = sys.modules.get("torch")
    if torch is not None:
        # Not torch.manual_seed: before CUDA is initialised it queues a seeding call for each
        # accelerator with a formatted stack, which costs a millisecond per test.
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(seed)
