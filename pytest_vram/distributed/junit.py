"""Under torchrun, one JUnit file: rank 0's, which holds every rank's figures."""

from __future__ import annotations

import pytest

from pytest_vram.distributed.ranks import Ranks

__all__ = ["RankPlugin"]


class RankPlugin:
    """On ranks other than 0: leave the JUnit file to rank 0, which writes every rank's
    figures into it; all ranks writing one path would leave whichever finished last."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if self.ranks.rank == 0:
            return
        try:
            from _pytest.junitxml import xml_key
        except ImportError:  # pragma: no cover - pytest moved it
            return
        xml = session.config.stash.get(xml_key, None)
        if xml is not None:
            del session.config.stash[xml_key]
            session.config.pluginmanager.unregister(xml)
