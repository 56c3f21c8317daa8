"""This process's place in a torchrun run."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Ranks"]


@dataclass(frozen=True)
class Ranks:
    """This process's place in a multi-process run, from the variables torchrun sets."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Ranks | None:
        """None outside a run of more than one rank."""
        environ = os.environ if environ is None else environ
        try:
            world_size = int(environ.get("WORLD_SIZE", "1"))
            rank = int(environ.get("RANK", "0"))
            local_rank = int(environ.get("LOCAL_RANK", str(rank)))
            local_world_size = int(environ.get("LOCAL_WORLD_SIZE", str(world_size)))
        except ValueError:
            return None
        if world_size <= 1 or not 0 <= rank < world_size:
            return None
        return cls(rank, world_size, local_rank, local_world_size)
