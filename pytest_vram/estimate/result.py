"""The result of an estimate and its two renderings: a table for people, a dict for JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pytest_vram.units import format_size

BREAKDOWN_KEYS = (
    "weights",
    "gradients",
    "optimizer",
    "activations",
    "logits",
    "kv_cache",
    "zero3_gathered",
)
HOST_KEYS = ("weights", "gradients", "optimizer")


@dataclass(frozen=True)
class Estimate:
    """Memory per GPU, in bytes. ``per_gpu_bytes`` is the sum of ``breakdown``.

    ``host_bytes`` is what CPU offload moves to host memory, per GPU (``host_breakdown`` by
    term). With pipeline parallelism, figures are those of ``pipeline_stage``, the stage with
    the largest footprint.
    """

    parameters: int
    per_gpu_bytes: int
    breakdown: dict[str, int]
    host_bytes: int = 0
    host_breakdown: dict[str, int] = field(default_factory=dict)
    active_parameters: int = 0
    pipeline_stage: int = 0
    inputs: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``pytest-vram estimate --json`` prints."""
        gpus = int(self.inputs.get("gpus", 1))
        return {
            "parameters": self.parameters,
            "active_parameters": self.active_parameters,
            "per_gpu_bytes": self.per_gpu_bytes,
            "breakdown": dict(self.breakdown),
            "host_bytes": self.host_bytes,
            "host_bytes_total": self.host_bytes * gpus,
            "host_breakdown": dict(self.host_breakdown),
            "pipeline_stage": self.pipeline_stage,
            "inputs": dict(self.inputs),
            "notes": list(self.notes),
        }

    def format(self) -> str:
        """A readable breakdown: IEC units, the SI value and the exact bytes."""
        i = self.inputs
        source = f"from {i['config']}" if i.get("config") else "from a parameter count"
        model = f"{i['model_type']}, " if i.get("model_type") else ""
        params = f"{self.parameters:,} parameters ({_short_count(self.parameters)})"
        if self.active_parameters and self.active_parameters != self.parameters:
            params += f", {self.active_parameters:,} active per token"
        if i["mode"] == "train":
            precision = "mixed precision" if i["dtype"] in ("fp16", "bf16") else "full precision"
            what = f"train, {i['dtype']} {precision}, {i['optimizer']}, recompute {i['recompute']}"
        else:
            what = f"inference, {i['dtype']} weights"
        layout = (
            f"{i['gpus']} GPU{'s' if i['gpus'] != 1 else ''} = dp {i['dp']} x tp {i['tp']} "
            f"x pp {i['pp']}, ZeRO-{i['zero']}, offload {i['offload']}"
        )
        # Rows are cells until every value is known: the columns widen to the longest.
        lines: list[str | tuple[str, str, str, str]] = [
            f"pytest-vram estimate: {model}{params}, {source}",
            f"  {what}; batch {i['batch']} x seq {i['seq']}, {i['attention']} attention",
            f"  {layout}",
            "",
            (f"per GPU{_stage(self.pipeline_stage, i['pp'])}", "IEC", "SI", "bytes"),
        ]
        for key in BREAKDOWN_KEYS:
            lines.append(_cells(f"  {key}", self.breakdown[key]))
        lines.append(_cells("  total", self.per_gpu_bytes))
        if self.host_bytes:
            lines += ["", ("host memory per GPU (offload)", "", "", "")]
            for key in HOST_KEYS:
                value = self.host_breakdown.get(key, 0)
                if value:
                    lines.append(_cells(f"  {key}", value))
            lines.append(_cells("  total", self.host_bytes))
        rendered = _render(lines)
        if self.notes:
            rendered += ["", "notes:"]
            rendered += [f"  - {note}" for note in self.notes]
        return "\n".join(rendered)

    def __str__(self) -> str:
        return self.format()


def _stage(stage: int, pp: int) -> str:
    return f" (pipeline stage {stage} of {pp})" if pp > 1 else ""


_WIDTHS = (34, 12, 12, 22)


def _cells(label: str, value: int) -> tuple[str, str, str, str]:
    return label, format_size(value), format_si(value), f"{value:,}"


def _render(lines: list[str | tuple[str, str, str, str]]) -> list[str]:
    """The lines with each row's cells in columns at least two spaces apart."""
    rows = [line for line in lines if isinstance(line, tuple)]
    label = max([_WIDTHS[0], *(len(row[0]) + 2 for row in rows)])
    widths = [
        max([width, *(len(row[column]) + 2 for row in rows)])
        for column, width in enumerate(_WIDTHS[1:], start=1)
    ]
    out = []
    for line in lines:
        if isinstance(line, str):
            out.append(line)
            continue
        head, *values = line
        cells = "".join(f"{value:>{width}}" for value, width in zip(values, widths, strict=True))
        out.append(f"{head:<{label}}{cells}".rstrip())
    return out


def _short_count(n: int) -> str:
    for suffix, factor in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= factor:
            return f"{n / factor:.2f}{suffix}"
    return str(n)


def format_si(nbytes: int) -> str:
    """``65.53 GB`` style (powers of 1000); below 1 kB as ``512 B``."""
    for unit, factor in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= factor:
            return f"{nbytes / factor:.2f} {unit}"
    return f"{nbytes} B"
