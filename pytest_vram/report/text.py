"""Plain text shared by every report: sizes, changes, plurals, aligned tables, environments.

Values may come from a document another tool wrote, so every helper takes ``object`` and treats
anything that is not an int (a bool included) as missing rather than failing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from pytest_vram.units import format_delta, format_percent, format_size

__all__ = [
    "ENVIRONMENT_FIELDS",
    "as_int",
    "change_text",
    "counts_text",
    "environment_line",
    "percent_text",
    "plural",
    "plural_noun",
    "size_text",
    "table",
]

#: The environment facts a report names after the device, in order, with their labels.
ENVIRONMENT_FIELDS = (("torch", "torch"), ("cuda", "CUDA"), ("driver", "driver"))


def as_int(value: object) -> int | None:
    """``value`` when it is an int, else None: ``True`` is not one byte."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _as_number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def size_text(value: object, missing: str = "-") -> str:
    """``1.50 GiB`` for a size in bytes; ``missing`` for anything else."""
    if type(value) is int:  # the common case, without as_int's two checks
        return format_size(value)
    nbytes = as_int(value)
    return missing if nbytes is None else format_size(nbytes)


def percent_text(percent: float) -> str:
    """A signed percentage with one decimal: ``+11.8%``, ``-50.0%``, ``+0.0%``."""
    return format_percent(percent)


def change_text(change: object, percent: object = None, missing: str = "-") -> str:
    """``+2.00 GiB (+11.8%)``; without a percentage (a zero baseline) only the bytes."""
    delta = as_int(change)
    if delta is None:
        return missing
    number = _as_number(percent)
    return format_delta(delta) + ("" if number is None else f" ({percent_text(number)})")


def plural_noun(count: int, noun: str, many: str | None = None) -> str:
    """``noun`` for one, else ``many`` (``noun`` + ``s`` unless given)."""
    return noun if count == 1 else (many or noun + "s")


def plural(count: int, noun: str, many: str | None = None) -> str:
    """``1 test``, ``2 tests``; ``plural(2, "entry", "entries")`` for other plurals."""
    return f"{count} {plural_noun(count, noun, many)}"


def counts_text(counts: Mapping[str, int], label: Callable[[str], str] = str) -> str:
    """``1 regression, 2 ok``: each count before its (escaped, by ``label``) key."""
    return ", ".join(f"{count} {label(key)}" for key, count in counts.items())


def table(
    header: Sequence[str], rows: Sequence[Sequence[str]], right: Collection[int] = ()
) -> list[str]:
    """Lines of columns two spaces apart, each as wide as its widest cell; the columns whose
    index is in ``right`` are right-aligned (numbers), the others left-aligned. Trailing
    spaces are stripped, so the last column is never padded."""
    every = [header, *rows]
    if any(len(row) != len(header) for row in rows):
        raise ValueError(f"every row needs {len(header)} cells, one per column")
    widths = [max(map(len, column)) for column in zip(*every, strict=True)]
    # Each column's alignment and width decided once, not for every cell.
    aligned = [(str.rjust if i in right else str.ljust, width) for i, width in enumerate(widths)]
    return [
        "  ".join(
            [justify(cell, width) for cell, (justify, width) in zip(row, aligned, strict=True)]
        ).rstrip()
        for row in every
    ]


def environment_line(environment: Mapping[str, object], device: str = "") -> str:
    """``NVIDIA H100 80GB HBM3, torch 2.13.0+cu128, CUDA 12.8, driver 570.124.06, 79.20 GiB
    total``: the device (``device`` when the environment names none), then each known fact."""
    facts = [str(environment.get("device") or device)]
    for key, label in ENVIRONMENT_FIELDS:
        if environment.get(key):
            facts.append(f"{label} {environment[key]}")
    total = as_int(environment.get("total_memory"))
    if total is not None:
        facts.append(f"{format_size(total)} total")
    return ", ".join(fact for fact in facts if fact)
