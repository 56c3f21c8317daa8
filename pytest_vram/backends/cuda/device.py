"""The CUDA device this process measures: under torchrun, its rank's."""

from __future__ import annotations

import os
from collections.abc import Mapping

from pytest_vram.backends.base import BackendUnavailable
from pytest_vram.distributed.ranks import Ranks

__all__ = ["local_device_index"]


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
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    raise BackendUnavailable(
        f"under torchrun LOCAL_RANK={local} names CUDA device {local}, but this process sees "
        f"{device_count} devices (CUDA_VISIBLE_DEVICES="
        + (repr(visible) if visible is not None else "unset")
        + "): give each rank its own GPU, with as many visible GPUs as ranks per node "
        "(--nproc-per-node) or one visible GPU per rank"
    )
