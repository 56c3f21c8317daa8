"""The fast reader of a baseline file's ``tests:`` section, in the layout pytest-vram writes.

A YAML parser builds several Python objects per line, so a file of two million entries took
minutes and gigabytes. The layout the writer uses is strict: an entry is a key line at two
spaces (``  NODEID:``, or ``  ? NODEID`` then ``  : FIGURE: N`` for an id of more than 128
characters) and one ``    FIGURE: N`` line per figure. That text is turned into JSON with a few
``str.replace`` calls and read by the json module's C decoder, a few megabytes at a time.

Every check runs over a whole chunk at C speed, and anything this reader does not take exactly
as YAML would (a comment, another quoting or indentation, flow style, an odd value) raises
:class:`NotCanonical`: the caller then reads the file with its careful YAML reader, which
names the line of any error. Entries whose node id is quoted (``': '`` or non-ASCII in it) or
starts with a character other than a letter, ``_`` or ``/`` are handed to ``other``, the careful
reader of a few lines.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from operator import itemgetter
from typing import TextIO

import yaml
from yaml.nodes import ScalarNode

from pytest_vram.record.figures import FigureError, check_figure, check_figure_name

__all__ = ["NotCanonical", "is_plain_key", "read_tests"]

# Text read at a time: the transient copies (the chunk, its JSON) stay a few tens of megabytes.
CHUNK_CHARS = 8 << 20

_STR_TAG = "tag:yaml.org,2002:str"
_RESOLVER = yaml.resolver.Resolver()
# A plain key may start with these: no YAML indicator, digit, sign, dot or space.
_SAFE_FIRST = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_/")
# Characters JSON takes as whitespace or text and YAML does not (DEL is not printable).
_REFUSED = ("\t", "\r", "\x7f")
# The start of a line that is neither an entry's nor a figure's: at column 0 (a comment, another
# top-level key), or indented by one or three spaces (a value moved to its own line, which JSON
# would read as the figure and YAML refuses). Or, in group `other`, the start of an entry whose
# node id is quoted, starts with anything but a letter, `_` or `/` (`-x`, `1:20`), or is a long
# one folded over lines: those are read by the careful reader.
# (No possessive quantifiers: Python 3.10 has none. A key line's `? ` is taken whole: a `?` may
# start an entry alone only where no space follows it.)
_LINE_START = re.compile(
    r"\n(?:  (?P<other>\? [^\n]*\n(?!  : )|\? [^ :A-Za-z_/]|(?!\? )[^ :A-Za-z_/])"
    r"|[^ \n]| [^ ]|   [^ ])"
)
# A figure that is not a whole number >= 0 in decimal: true, null, -1, 0x10, [1], ...
_NOT_DECIMAL = re.compile(r": [^0-9]")
# YAML reads a plain key of more than 1024 characters as an error, not as a key.
_MAX_SIMPLE_KEY = 1000


class NotCanonical(Exception):
    """The text is not in the layout this reader takes exactly; read it with the YAML reader."""


def _refuse(value: str) -> float:
    raise NotCanonical(value)


# Floats, NaN and Infinity are not figures: the careful reader names their line.
_DECODER = json.JSONDecoder(parse_float=_refuse, parse_constant=_refuse)


def is_plain_key(text: str) -> bool:
    """Whether YAML reads ``text``, written unquoted as a block mapping key, as this string."""
    if not text or text[0] not in _SAFE_FIRST or not text.isascii() or not text.isprintable():
        return False
    if ": " in text or " #" in text or text.endswith((" ", ":")) or "\x7f" in text:
        return False
    # Starting with a letter, only true/false/null and their kin resolve to another type.
    return not text.isalpha() or _RESOLVER.resolve(ScalarNode, text, (True, False)) == _STR_TAG


def read_tests(
    handle: TextIO,
    ends_with: str | None,
    other: Callable[[str], dict[str, dict[str, int]]],
) -> dict[str, dict[str, int]]:
    """The entries of the rest of ``handle``, which is positioned after the ``tests:`` line.

    ``ends_with`` is the closing line the file must end with, if any (it has been checked).
    ``other(text)`` reads the entries of ``text`` (lines of the section) with the careful
    reader: those whose node id is quoted or starts with an odd character.
    """
    entries: dict[str, dict[str, int]] = {}
    names: set[str] = set()
    pending = "\n"
    while True:
        chunk = handle.read(CHUNK_CHARS)
        if not chunk:
            break
        pending += chunk
        cut = _last_entry_start(pending)
        if cut > 0:
            _read_entries(pending[:cut], entries, names, other)
            pending = pending[cut:]
    if ends_with is not None:
        end = pending.rstrip(" \t\r\n")
        if not end.endswith("\n" + ends_with):
            raise NotCanonical("no closing line")
        pending = end[: -len(ends_with) - 1]
    if pending.strip("\n"):
        _read_entries(pending, entries, names, other)
    return entries


def _last_entry_start(text: str) -> int:
    """Where the last entry of ``text`` that may be incomplete begins (its line's newline)."""
    at = len(text)
    while True:
        at = text.rfind("\n  ", 0, at)
        if at < 0:
            return 0
        if text[at + 3 : at + 4] not in (" ", ":", ""):
            return at


def _next_entry_start(text: str, start: int) -> int:
    at = start
    while True:
        at = text.find("\n  ", at)
        if at < 0:
            return len(text)
        if text[at + 3 : at + 4] not in (" ", ":"):
            return at
        at += 3


def _read_entries(
    text: str,
    entries: dict[str, dict[str, int]],
    names: set[str],
    other: Callable[[str], dict[str, dict[str, int]]],
) -> None:
    """Add the entries of ``text`` (whole entries, from the newline before the first) to
    ``entries``; ``names`` holds the figure names already checked."""
    if not text.isascii():
        raise NotCanonical("not ASCII")
    done = 0
    for match in _LINE_START.finditer(text):
        if match.group("other") is None:
            raise NotCanonical("a line of another indentation")
        start = match.start()
        if start < done:
            continue
        end = _next_entry_start(text, start + 1)
        if start > done:
            _read_plain(text[done:start], entries, names)
        _merge(entries, other(text[start + 1 : end] + "\n"))
        done = end
    if done < len(text):
        _read_plain(text[done:] if done else text, entries, names)


def _read_plain(text: str, entries: dict[str, dict[str, int]], names: set[str]) -> None:
    if "\n  ? " in text:  # a long node id: the same entry as a one-line key
        text = text.replace("\n  ? ", "\n  ").replace("\n  : ", ":\n    ")
    if any(refused in text for refused in _REFUSED) or _NOT_DECIMAL.search(text):
        raise NotCanonical("refused text")
    keys = text.count(":\n    ")
    figures = text.count(": ")
    if "\\" in text:
        text = text.replace("\\", "\\\\")
    if '"' in text:
        text = text.replace('"', '\\"')
    text = (
        text.replace(":\n    ", '":{"')
        .replace("\n    ", ',"')
        .replace(": ", '":')
        .replace("\n  ", '},"')
    )
    if not text.startswith('},"'):
        raise NotCanonical("not an entry")
    try:
        found = _DECODER.decode("{" + text[2:] + "}}")
        # Each key line opened one entry and each figure line gave one figure: nothing was
        # nested, merged or dropped as a duplicate.
        if len(found) != keys or sum(map(len, found.values())) != figures:
            raise NotCanonical("structure")
        largest = max(map(max, map(dict.values, found.values())))
    except (ValueError, TypeError, RecursionError):
        raise NotCanonical("not JSON") from None
    _check_keys(found)
    new = set().union(*found.values()) - names
    for name in new:
        if not is_plain_key(name):
            raise NotCanonical("figure name")
    try:
        for name in new:
            check_figure_name(name)
        # No figure is negative (refused above), so the largest is the one that can be refused.
        check_figure("figure", largest)
    except FigureError:
        raise NotCanonical("figure") from None
    names |= new
    _merge(entries, found)


def _check_keys(found: dict[str, dict[str, int]]) -> None:
    """Node ids JSON took as they are and YAML would not: empty, too long, starting with an
    indicator, ending with a space (trimmed) or holding a comment (` #`)."""
    keys = "\n".join(found)
    if "" in found or " \n" in keys or keys.endswith(" ") or " #" in keys:
        raise NotCanonical("key")
    if max(map(len, found)) > _MAX_SIMPLE_KEY:
        raise NotCanonical("key length")
    if not set(map(itemgetter(0), found)) <= _SAFE_FIRST:
        raise NotCanonical("key start")
    for key in filter(str.isalpha, found):
        if not is_plain_key(key):
            raise NotCanonical("key resolves to another type")


def _merge(entries: dict[str, dict[str, int]], found: dict[str, dict[str, int]]) -> None:
    before = len(entries)
    entries.update(found)
    if len(entries) != before + len(found):
        raise NotCanonical("duplicate node id")  # the careful reader names both lines
