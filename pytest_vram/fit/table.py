"""The table ``pytest-vram fit`` prints: GPU sizes against layouts, and the cheapest that fits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pytest_vram.fit.layouts import Layout
from pytest_vram.fit.search import largest
from pytest_vram.fit.sweep import Fit
from pytest_vram.units import format_size

__all__ = ["FitTable", "Row", "cheapest", "estimated_batch", "row_from_dict"]

_RECOMPUTE_COST = {"none": 0, "selective": 1, "full": 2}


@dataclass(frozen=True)
class Row:
    """One layout: per capacity, what the simulated device found and what the estimator says."""

    layout: Layout
    fits: Sequence[Fit]
    #: The estimator's largest batch per capacity; None without a config to estimate from.
    estimated: Sequence[int | None]
    steps: int
    seconds: float


def row_from_dict(layout: Layout, data: dict[str, Any]) -> Row:
    """A row as :meth:`FitTable.to_dict` wrote it."""
    fits = [Fit(0, fit["max_batch"], fit["peak"], fit["next_peak"]) for fit in data["fits"]]
    estimated = [fit["estimated_max_batch"] for fit in data["fits"]]
    return Row(layout, fits, estimated, data["steps"], data["seconds"])


def estimated_batch(config: dict[str, Any], layout: Layout, capacity: int, hi: int) -> int:
    """The largest batch whose estimate (``pytest-vram estimate --mode train``) is within
    ``capacity``; 0 when not even one sequence is."""
    from pytest_vram.estimate import estimate

    def fits(batch: int) -> bool:
        result = estimate(
            config=config,
            mode="train",
            dtype=layout.dtype,
            batch=batch,
            seq=layout.seq,
            gpus=layout.gpus,
            zero=layout.zero,
            tp=layout.tp,
            recompute=layout.recompute,
        )
        return result.per_gpu_bytes <= capacity

    return largest(fits, 1, hi)


def cheapest(rows: Sequence[Row], column: int) -> Row | None:
    """The layout that fits one sequence at the least cost: no recompute before recompute
    (recomputing costs a forward), then the lowest ZeRO stage (the least communication), then
    the larger batch."""
    fitting = [row for row in rows if row.fits[column].value >= 1]
    if not fitting:
        return None
    return min(
        fitting,
        key=lambda row: (
            _RECOMPUTE_COST.get(row.layout.recompute, 3),
            row.layout.zero,
            -row.fits[column].value,
        ),
    )


@dataclass(frozen=True)
class FitTable:
    capacities: Sequence[str]
    limits: Sequence[int]
    rows: Sequence[Row]

    def to_dict(self) -> dict[str, Any]:
        return {
            "capacities": [
                {"capacity": text, "bytes": limit, "cheapest": _label(cheapest(self.rows, i))}
                for i, (text, limit) in enumerate(zip(self.capacities, self.limits, strict=True))
            ],
            "layouts": [
                {
                    **row.layout.to_dict(),
                    "label": row.layout.label,
                    "steps": row.steps,
                    "seconds": round(row.seconds, 3),
                    "fits": [
                        {
                            "capacity": text,
                            "max_batch": fit.value,
                            "peak": fit.peak,
                            "next_peak": fit.next_peak,
                            "estimated_max_batch": estimated,
                        }
                        for text, fit, estimated in zip(
                            self.capacities, row.fits, row.estimated, strict=True
                        )
                    ],
                }
                for row in self.rows
            ],
        }

    def format(self) -> str:
        """One line per GPU size: ``sim / estimate`` per layout, then the cheapest."""
        headers = ["GPU", *(row.layout.label for row in self.rows), "cheapest that fits"]
        lines = []
        for i, text in enumerate(self.capacities):
            cells = [text]
            for row in self.rows:
                fit, estimated = row.fits[i], row.estimated[i]
                cell = str(fit.value) if fit.value else "-"
                if estimated is not None:
                    cell += f" / {estimated if estimated else '-'}"
                cells.append(cell)
            best = cheapest(self.rows, i)
            cells.append(
                f"{best.layout.label}: batch {best.fits[i].value}" if best is not None else "none"
            )
            lines.append(cells)
        widths = [max(len(r[c]) for r in [headers, *lines]) for c in range(len(headers))]
        out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
        out += [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in lines
        ]
        estimate = any(e is not None for row in self.rows for e in row.estimated)
        out.append("")
        out.append(
            "largest micro-batch on the simulated device"
            + (" / the estimator's" if estimate else "")
            + "; - : not even one sequence fits"
        )
        for row in self.rows:
            peaks = ", ".join(
                f"{text} {format_size(fit.peak)}"
                for text, fit in zip(self.capacities, row.fits, strict=True)
                if fit.peak is not None
            )
            out.append(
                f"{row.layout.label}: {row.steps} steps in {row.seconds:.1f} s; reserved at the "
                f"largest batch: {peaks or 'none'}"
            )
        return "\n".join(out)


def _label(row: Row | None) -> str | None:
    return row.layout.label if row is not None else None
