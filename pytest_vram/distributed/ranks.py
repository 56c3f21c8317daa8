"""This process's place in a torchrun run, and the CUDA device it measures."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Ranks", "local_device_index"]


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


def local_device_index(
    environ: Mapping[str, str] | None = None, device_count: int | None = None
) -> int | None:
    """The CUDA device a rank measures; None outside torchrun.

    ``LOCAL_RANK``, or 0 where each rank sees one GPU only (``CUDA_VISIBLE_DEVICES`` set per
    rank). ``device_count`` defaults to ``torch.cuda.device_count()``, asked only under
    torchrun. Raises :class:`~pytest_vram.backends.BackendUnavailable` when LOCAL_RANK names
    no device this process sees.
    """
    ranks = Ranks.from_environ(environ)
    if ranks is None:
        return None
    if device_count is None:
        import torch  # the cuda backend is being made: torch is imported already

        device_count = torch.cuda.device_count()
    local = ranks.local_rank
    if local < device_count or device_count == 0:  # no GPU: the backend says so itself
        return local
    if device_count == 1:
        return 0
    from pytest_vram.backends.base import BackendUnavailable

    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    raise BackendUnavailable(
        f"under torchrun LOCAL_RANK={local} names CUDA device {local}, but this process sees "
        f"{device_count} devices (CUDA_VISIBLE_DEVICES="
        + (repr(visible) if visible is not None else "unset")
        + "): give each rank its own GPU, with as many visible GPUs as ranks per node "
        "(--nproc-per-node) or one visible GPU per rank"
    )
