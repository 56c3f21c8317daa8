"""Real ranks: ``torchrun --nproc-per-node=N -m pytest ...``.

Each rank measures its own device (:mod:`.ranks`) and judges its own figures against its own
baseline figures. After each measured test every other rank hands its record to rank 0
(:mod:`.exchange`), which merges them (:mod:`.merge`): the test's figures become the maximum
over ranks, each rank's figures ride along in ``TestRecord.ranks``, and rank 0 alone reports,
writes the JUnit file (:mod:`.junit`) and writes baselines, which store the maximum and every
rank's figures (named in :mod:`pytest_vram.record.figures`).

Nothing here imports torch.
"""

from __future__ import annotations

from pytest_vram.distributed.exchange import RankExchange, exchange_directory
from pytest_vram.distributed.junit import RankPlugin
from pytest_vram.distributed.merge import merge_ranks
from pytest_vram.distributed.ranks import Ranks

# Handed on for the session, which compares each rank with its own figures.
from pytest_vram.record.figures import entry_for_rank

__all__ = [
    "RankExchange",
    "RankPlugin",
    "Ranks",
    "entry_for_rank",
    "exchange_directory",
    "merge_ranks",
]
