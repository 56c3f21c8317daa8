"""The vram markers. Each is a plain function whose signature is the marker's API.

``@max_vram("72GB")`` is ``@pytest.mark.max_vram("72GB")``; the plugin binds a marker's arguments
against the same signature, so both spellings are checked alike.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from pytest_vram.backends import BACKENDS
from pytest_vram.units import (
    SizeError,
    Tolerance,
    parse_size,
    parse_tolerance,
)

__all__ = [
    "MARKER_HELP",
    "METRICS",
    "Budget",
    "MarkerError",
    "VramMarks",
    "max_vram",
    "read_marks",
    "requires_vram",
    "vram_backend",
    "vram_tolerance",
    "vram_world_size",
]

METRICS = ("allocated", "reserved", "device")


def max_vram(limit: int | str, *, metric: str = "allocated") -> pytest.MarkDecorator:
    """Fail the test when its peak ``metric`` exceeds ``limit``."""
    if metric == "allocated":  # the same mark as @pytest.mark.max_vram(limit)
        return pytest.mark.max_vram(limit)
    return pytest.mark.max_vram(limit, metric=metric)


def vram_tolerance(tolerance: str | int) -> pytest.MarkDecorator:
    """Allow this much growth over the test's baseline: ``"5%"`` or a size."""
    return pytest.mark.vram_tolerance(tolerance)


def vram_backend(name: str) -> pytest.MarkDecorator:
    """Measure this test on backend ``name`` (auto, cuda, cpu or sim)."""
    return pytest.mark.vram_backend(name)


def requires_vram(size: int | str) -> pytest.MarkDecorator:
    """Skip the test when the device has less total memory than ``size``."""
    return pytest.mark.requires_vram(size)


def vram_world_size(n: int) -> pytest.MarkDecorator:
    """Run the test as rank 0 of ``n`` ranks: a fake process group on the sim backend, the
    real ranks under ``torchrun --nproc-per-node=n``; skipped elsewhere."""
    return pytest.mark.vram_world_size(n)


MARKERS: dict[str, Callable[..., Any]] = {
    "max_vram": max_vram,
    "vram_tolerance": vram_tolerance,
    "vram_backend": vram_backend,
    "requires_vram": requires_vram,
    "vram_world_size": vram_world_size,
}

MARKER_HELP = {
    "max_vram": "max_vram(limit, *, metric='allocated'): fail when the test's peak exceeds limit "
    "(metric: allocated, reserved or device)",
    "vram_tolerance": "vram_tolerance(tolerance): this test's tolerance against its baseline "
    "('5%' or a size)",
    "vram_backend": "vram_backend(name): measure this test on backend auto, cuda, cpu or sim",
    "requires_vram": "requires_vram(size): skip when the device has less total memory than size",
    "vram_world_size": "vram_world_size(n): run as rank 0 of n ranks: a fake process group on "
    "the sim backend, the real ranks under torchrun --nproc-per-node=n; skipped elsewhere",
}


class MarkerError(Exception):
    """A vram marker with arguments that do not fit its signature or its accepted forms."""


@dataclass(frozen=True)
class Budget:
    limit: int
    metric: str
    as_written: int | str


@dataclass(frozen=True)
class VramMarks:
    """A test's vram markers, checked and parsed."""

    budgets: tuple[Budget, ...] = ()
    tolerance: Tolerance | None = None
    backend: str | None = None
    required: int | None = None
    required_as_written: int | str | None = None
    world_size: int | None = None

    @property
    def any(self) -> bool:
        return (
            bool(self.budgets)
            or self.tolerance is not None
            or self.backend is not None
            or (self.required is not None)
            or self.world_size is not None
        )


def _signature(function: Callable[..., Any]) -> inspect.Signature:
    # Made once per marker function: collection binds the markers of every test.
    signature = _SIGNATURES.get(function)
    if signature is None:
        signature = _SIGNATURES[function] = inspect.signature(function)
    return signature


_SIGNATURES: dict[Callable[..., Any], inspect.Signature] = {}


def _bind(name: str, mark: pytest.Mark) -> inspect.BoundArguments:
    signature = _signature(MARKERS[name])
    try:
        bound = signature.bind(*mark.args, **mark.kwargs)
    except TypeError as exc:
        plain = signature.replace(
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        given = ", ".join(
            [repr(arg) for arg in mark.args] + [f"{k}={v!r}" for k, v in mark.kwargs.items()]
        )
        raise MarkerError(f"{name}{plain}: {exc}; got {name}({given})") from None
    bound.apply_defaults()
    return bound


def read_marks(marks: list[pytest.Mark]) -> VramMarks:
    """Parse the vram markers among ``marks`` (closest first, as ``iter_markers`` yields)."""
    budgets: list[Budget] = []
    tolerance: Tolerance | None = None
    backend: str | None = None
    required: int | None = None
    required_as_written: int | str | None = None
    world_size: int | None = None
    seen: set[str] = set()
    for mark in marks:
        if mark.name not in MARKERS:
            continue
        # Every marker is checked, also one that a closer marker of its name overrides.
        args = _bind(mark.name, mark).arguments
        closest = mark.name not in seen
        seen.add(mark.name)
        if mark.name == "max_vram":
            metric = args["metric"]
            if metric not in METRICS:
                raise MarkerError(
                    f"max_vram: invalid metric {metric!r}: expected one of {', '.join(METRICS)}"
                )
            budgets.append(Budget(_size(mark.name, args["limit"]), metric, args["limit"]))
        elif mark.name == "vram_tolerance":
            try:
                parsed = parse_tolerance(args["tolerance"])
            except SizeError as exc:
                raise MarkerError(f"vram_tolerance: {exc}") from None
            tolerance = parsed if closest else tolerance
        elif mark.name == "vram_backend":
            if args["name"] not in BACKENDS:
                raise MarkerError(
                    f"vram_backend: unknown backend {args['name']!r}: "
                    f"expected one of {', '.join(BACKENDS)}"
                )
            backend = args["name"] if closest else backend
        elif mark.name == "requires_vram":
            size = _size(mark.name, args["size"])
            if closest:
                required, required_as_written = size, args["size"]
        elif mark.name == "vram_world_size":
            n = args["n"]
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise MarkerError(f"vram_world_size: n must be an int >= 1, got {n!r}")
            world_size = n if closest else world_size
    return VramMarks(tuple(budgets), tolerance, backend, required, required_as_written, world_size)


def _size(marker: str, value: object) -> int:
    try:
        return parse_size(value)
    except SizeError as exc:
        raise MarkerError(f"{marker}: {exc}") from None
