"""Seeding the random generators before each measured test, so that a rerun draws the same
numbers and allocates the same memory (as pytest-randomly does for its own reasons).

pytest-randomly reseeds the same generators at each test's setup, call and teardown, after
this plugin has seeded them, from a seed it draws anew for every run: a measured test's draws,
and so its figures, would change from run to run. While a measured test runs, its reseeding is
paused (:func:`pause_randomly`): the test's own seed holds, the same in every run, order and
process, and the other tests are reseeded by pytest-randomly as before.
"""

from __future__ import annotations

import random
import sys
import zlib
from _random import Random as _CRandom
from collections.abc import Callable
from typing import Any

from pytest_vram.importhook import PatchOnImport

_seed_python = _CRandom.seed
# NumPy's global generator is made when numpy.random is first imported (importing numpy or
# torch does not import it), and seeded there from the operating system's entropy.
_NUMPY_RANDOM = "numpy.random"

__all__ = ["Seeder", "pause_randomly", "seed_for", "seed_generators"]


def seed_for(seed: int, nodeid: str) -> int:
    """The seed of the test ``nodeid`` in a run seeded with ``seed``: the same in every run,
    process and order, and another for each test, so that tests do not all draw one stream."""
    return zlib.crc32(f"{seed}:{nodeid}".encode())


def seed_generators(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators, those of them imported."""
    # What random.seed(int) does, without its checks of the argument's type.
    _seed_python(random._inst, seed)  # type: ignore[attr-defined]
    random._inst.gauss_next = None  # type: ignore[attr-defined]
    numpy_random = sys.modules.get(_NUMPY_RANDOM)
    if numpy_random is not None:
        _seed_numpy(numpy_random, seed)
    torch = sys.modules.get("torch")
    if torch is not None:
        # Not torch.manual_seed: before CUDA is initialised it queues a seeding call for each
        # accelerator with a formatted stack, which costs a millisecond per test. Where CUDA
        # is not initialised, nothing on it has drawn a number yet.
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(seed)


def _seed_numpy(numpy_random: Any, seed: int) -> None:
    numpy_random.seed(seed % 2**32)


class Seeder:
    """Seeds the generators before each measured test of a session, each test with its own
    seed (:func:`seed_for`).

    NumPy's global generator does not exist until ``numpy.random`` is imported. Until then it is
    seeded as it is made: a test that first imports it draws from its own seed, as it would had
    the generator existed when the test started, and the other tests pay nothing for it.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._current = seed
        self._hook: PatchOnImport | None = None
        # seed_for's CRC-32 of "seed:nodeid", continued from that of "seed:": the same number
        # without formatting the text for every test.
        self._prefix = zlib.crc32(f"{seed}:".encode())

    def start(self, nodeid: str) -> None:
        """Seed the generators for the test ``nodeid``, which is about to run."""
        self._current = current = zlib.crc32(nodeid.encode(), self._prefix)
        seed_generators(current)
        if self._hook is None and _NUMPY_RANDOM not in sys.modules:
            self._hook = PatchOnImport(_NUMPY_RANDOM, self._numpy_made)
            self._hook.install()

    def _numpy_made(self, numpy_random: Any) -> None:
        _seed_numpy(numpy_random, self._current)
        self.close()  # from now on, seed_generators finds it

    def close(self) -> None:
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()


def pause_randomly(option: Any) -> Callable[[], None] | None:
    """Pause pytest-randomly's reseeding of each test (``option``: the config's options); what
    resumes it, or None where it does not reseed (not installed, ``-p no:randomly``,
    ``--randomly-dont-reset-seed``)."""
    if getattr(option, "randomly_reset_seed", False) is not True:
        return None
    option.randomly_reset_seed = False

    def resume() -> None:
        option.randomly_reset_seed = True

    return resume
