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
        lines = [
            f"pytest-vram estimate: {model}{params}, {source}",
            f"  {what}; batch {i['batch']} x seq {i['seq']}, {i['attention']} attention",
            f"  {layout}",
            "",
            _row(f"per GPU{_stage(self.pipeline_stage, i['pp'])}", "IEC", "SI", "bytes"),
        ]
        for key in BREAKDOWN_KEYS:
            value = self.breakdown[key]
            lines.append(_row(f"  {key}", format_size(value), format_si(value), f"{value:,}"))
        total = self.per_gpu_bytes
        lines.append(_row("  total", format_size(total), format_si(total), f"{total:,}"))
        if self.host_bytes:
            lines += ["", _row("host memory per GPU (offload)", "", "", "")]
            for key in HOST_KEYS:
                value = self.host_breakdown.get(key, 0)
                if value:
                    lines.append(
                        _row(f"  {key}", format_size(value), format_si(value), f"{value:,}")
                    )
            host = self.host_bytes
            lines.append(_row("  total", format_size(host), format_si(host), f"{host:,}"))
        if self.notes:
            lines += ["", "notes:"]
            lines += [f"  - {note}" for note in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _stage(stage: int, pp: int) -> str:
    return f" (pipeline stage {stage} of {pp})" if pp > 1 else ""


def _row(label: str, iec: str, si: str, exact: str) -> str:
    return f"{label:<34}{iec:>12}{si:>12}{exact:>22}".rstrip()


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
