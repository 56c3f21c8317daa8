"""Seeding the random generators before each measured test, so that a rerun draws the same
numbers and allocates the same memory (as pytest-randomly does for its own reasons)."""

from __future__ import annotations

import random
import sys
import zlib
from _random import Random as _CRandom

_seed_python = _CRandom.seed

__all__ = ["DEFAULT_SEED", "seed_for", "seed_generators"]

#: The seed every measured test starts from unless ``--vram-seed`` says otherwise.
DEFAULT_SEED = 0


def seed_for(seed: int, nodeid: str) -> int:
    """The seed of the test ``nodeid`` in a run seeded with ``seed``: the same in every run,
    process and order, and another for each test, so that tests do not all draw one stream."""
    return zlib.crc32(f"{seed}:{nodeid}".encode())


def seed_generators(seed: int) -> None:
    """Seed Python's, NumPy's (where imported) and torch's (where imported) generators."""
    # What random.seed(int) does, without its checks of the argument's type.
    _seed_python(random._inst, seed)  # type: ignore[attr-defined]
    random._inst.gauss_next = None  # type: ignore[attr-defined]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    torch = sys.modules.get("torch")
    if torch is not None:
        # Not torch.manual_seed: before CUDA is initialised it queues a seeding call for each
        # accelerator with a formatted stack, which costs a millisecond per test. Where CUDA
        # is not initialised, nothing on it has drawn a number yet.
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(seed)
