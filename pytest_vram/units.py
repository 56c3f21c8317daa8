"""Parse and format memory sizes and tolerances.

Sizes are ints (bytes) or strings such as ``"72GB"`` (SI, powers of 1000) or ``"72 GiB"``
(IEC, powers of 1024). Messages always print IEC units with two decimals.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from fractions import Fraction

__all__ = [
    "ACCEPTED_SIZE_FORMS",
    "SizeError",
    "Tolerance",
    "describe_size",
    "format_delta",
    "format_percent",
    "format_size",
    "parse_size",
    "parse_tolerance",
]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SI_UNITS = frozenset({"kb", "mb", "gb", "tb"})
# ASCII digits only: ``\d`` would also take full-width and other scripts' digits ("７２GB").
_SIZE_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?) ?([A-Za-z]*)$")
_PERCENT_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?) ?%$")
# Below this an int converts to a float exactly; above it (a corrupt figure read back, say)
# float arithmetic rounds, and past about 10**308 it overflows.
_EXACT_IN_FLOAT = 2**53

ACCEPTED_SIZE_FORMS = (
    "an int of bytes, or a number with an optional unit: B, kB/KB/MB/GB/TB (powers of 1000) "
    "or KiB/MiB/GiB/TiB (powers of 1024), e.g. 72GB, 1.5 GiB, 512"
)
ACCEPTED_TOLERANCE_FORMS = f"a percentage such as 5% or a size ({ACCEPTED_SIZE_FORMS})"


class SizeError(ValueError):
    """A size or tolerance that is not in one of the accepted forms."""


class _Invalid(Exception):
    """Why a value is not a size, for the public functions to put in their own message."""


def _bytes(value: object) -> int:
    """``value`` in bytes; raise :class:`_Invalid` with the reason (or none) otherwise."""
    if isinstance(value, bool):  # an int subclass, but never meant as a number of bytes
        raise _Invalid("")
    if isinstance(value, int):
        if value < 0:
            raise _Invalid("sizes cannot be negative")
        return value
    if not isinstance(value, str) or not value.isascii():
        # str.strip() and the unit letters would otherwise let in non-ASCII look-alikes.
        raise _Invalid("")
    match = _SIZE_RE.match(value.strip())
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise _Invalid("")
    try:
        # Exact: a Decimal would round a long fraction to its context's precision.
        nbytes = Fraction(match.group(1)) * _UNITS[unit]
    except ValueError:  # more digits than Python converts to an int
        raise _Invalid("too many digits") from None
    if nbytes.denominator != 1:
        raise _Invalid(_not_whole(nbytes, len(match.group(1).partition(".")[2])))
    return int(nbytes)


def _not_whole(nbytes: Fraction, decimals: int) -> str:
    """The reason a fractional byte count is refused, with the count written out exactly (a
    number with ``decimals`` decimals times a unit has at most that many)."""
    try:
        digits = str(int(nbytes * 10**decimals)).rjust(decimals + 1, "0")
    except ValueError:  # more digits than Python writes out; the message names the value anyway
        return "not a whole number of bytes"
    exact = f"{digits[:-decimals]}.{digits[-decimals:].rstrip('0')}"
    return f"that is {exact} bytes, not a whole number of bytes"


def _problem(kind: str, value: object, reason: str, expected: str) -> SizeError:
    because = f"{reason}; " if reason else ""
    return SizeError(f"invalid {kind} {value!r}: {because}expected {expected}")


def parse_size(value: object) -> int:
    """Return ``value`` in bytes; raise :class:`SizeError` naming the value otherwise.

    A string must come to a whole number of bytes once its unit is applied: ``"0.5KiB"`` is
    512 bytes, ``"0.5B"`` is an error rather than a budget of 0 bytes.
    """
    try:
        return _bytes(value)
    except _Invalid as exc:
        raise _problem("size", value, str(exc), ACCEPTED_SIZE_FORMS) from None


def is_si(value: object) -> bool:
    """Whether ``value`` was typed with an SI unit (kB, MB, GB, TB)."""
    if not isinstance(value, str):
        return False
    match = _SIZE_RE.match(value.strip())
    return bool(match) and match.group(2).lower() in _SI_UNITS


# Reports format the same few sizes for thousands of tests.
@functools.lru_cache(maxsize=4096)
def format_size(nbytes: int) -> str:
    """``1.50 GiB`` style; below 1 KiB as ``512 B``. Negative values keep their sign."""
    sign = "-" if nbytes < 0 else ""
    n = abs(nbytes)
    if n < 1024:
        return f"{sign}{n} B"
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2)):
        if n >= factor:
            return f"{sign}{_hundredths(n, factor)} {unit}"
    return f"{sign}{_hundredths(n, 1024)} KiB"


def _hundredths(n: int, factor: int) -> str:
    """``n / factor`` with two decimals, rounded half to even as float formatting rounds."""
    if n < _EXACT_IN_FLOAT:
        return f"{n / factor:.2f}"
    whole, part = divmod(round(Fraction(n * 100, factor)), 100)
    return f"{whole}.{part:02d}"


def format_delta(nbytes: int) -> str:
    """A signed size: ``+1.50 GiB``, ``-512 B``, ``+0 B``."""
    return format_size(nbytes) if nbytes < 0 else "+" + format_size(nbytes)


def format_percent(percent: float) -> str:
    """A signed percentage with one decimal: ``+11.8%``, ``-50.0%``, ``+0.0%``."""
    return f"{percent:+.1f}%"


def describe_size(value: object) -> str:
    """A size as messages print it: IEC, plus the value as typed when it used SI units."""
    text = format_size(parse_size(value))
    return f"{text} ({value.strip()})" if is_si(value) else text  # type: ignore[union-attr]


@dataclass(frozen=True)
class Tolerance:
    """How much a figure may grow: a fraction of a reference, or a fixed number of bytes."""

    percent: float | None = None
    nbytes: int | None = None
    text: str = ""

    def allowance(self, reference: int) -> int:
        """The bytes of growth allowed on top of ``reference``."""
        if self.percent is not None:
            if abs(reference) < _EXACT_IN_FLOAT:
                return int(reference * self.percent / 100)
            return int(Fraction(reference) * Fraction(self.percent) / 100)
        return self.nbytes or 0

    def __str__(self) -> str:
        if self.text:
            return self.text
        if self.percent is not None:
            return f"{self.percent:g}%"
        return format_size(self.nbytes or 0)


def parse_tolerance(value: object) -> Tolerance:
    """``"5%"`` or a size; raise :class:`SizeError` naming the value otherwise."""
    if isinstance(value, Tolerance):
        return value
    if isinstance(value, str) and value.isascii():
        match = _PERCENT_RE.match(value.strip())
        if match:
            return Tolerance(percent=float(match.group(1)), text=value.strip())
    try:
        nbytes = _bytes(value)
    except _Invalid as exc:
        raise _problem("tolerance", value, str(exc), ACCEPTED_TOLERANCE_FORMS) from None
    text = value.strip() if isinstance(value, str) else format_size(nbytes)
    return Tolerance(nbytes=nbytes, text=text)
