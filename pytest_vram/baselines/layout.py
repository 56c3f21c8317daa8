"""The text of a baseline file, as the writer writes it.

A file the writer wrote ends with the line ``# end of baselines``, which its header announces:
a file that starts with that header and lacks the line was cut short (a full disk, an
interrupted copy or checkout), and is an error rather than a file with fewer entries. Files of
earlier versions, without the announcement, are read as they are and get it when next written.
Entries are written as libyaml would write the whole document, one at a time, in the layout
that :mod:`pytest_vram.baselines.scan` reads at C speed.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import yaml

from pytest_vram.baselines.scan import is_plain_key

__all__ = ["END_LINE", "HEADER", "dump_file", "stored_environment"]


# libyaml's safe dumper where PyYAML was built with it: ten times faster.
SafeDumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

#: The last line of a file the writer wrote; a file whose header announces it and that does
#: not end with it was cut short.
END_LINE = "# end of baselines"
HEADER = (
    "# pytest-vram baselines: peak memory per test, in bytes, for one device class.\n"
    "# Update after an intended change with: pytest --vram-update-baselines\n"
    f"# A whole file ends with the line: {END_LINE}\n"
)
_DUMP_STYLE: dict[str, Any] = {"sort_keys": False, "default_flow_style": False, "width": 1000}
# libyaml writes a key of more than 128 characters as `? KEY` then `: VALUE`; the writer too.
_SIMPLE_KEY_CHARS = 128


def dump_file(
    device: str, environment: Mapping[str, Any], entries: Mapping[str, Mapping[str, int]]
) -> str:
    """A file's text: sorted and stable, as libyaml would write the same document, with the
    header and closing line that tell a whole file from one cut short."""
    head = {
        "device": device,
        "environment": dict(sorted(stored_environment(environment).items())),
    }
    parts = [HEADER, yaml.dump(head, Dumper=SafeDumper, **_DUMP_STYLE)]
    parts.append("tests:\n" if entries else "tests: {}\n")
    parts.extend(_dump_entry(nodeid, entries[nodeid]) for nodeid in sorted(entries))
    parts.append(f"{END_LINE}\n")
    return "".join(parts)


def stored_environment(environment: Mapping[str, Any]) -> dict[str, Any]:
    """An environment as a baseline file stores and reads it back: no empty fields, every
    value an int or text. Compared in this form, a rewrite of the same run changes nothing."""
    return {
        str(k): v if isinstance(v, int) else str(v) for k, v in environment.items() if v is not None
    }


def _dump_entry(nodeid: str, figures: Mapping[str, int]) -> str:
    names = sorted(figures)
    if (
        names
        and is_plain_key(nodeid)
        and (len(nodeid) <= _SIMPLE_KEY_CHARS or " " not in nodeid)  # libyaml folds at spaces
        and all(_plain_name(name) and type(figures[name]) is int for name in names)
    ):
        lines = [f"    {name}: {figures[name]}\n" for name in names]
        if len(nodeid) <= _SIMPLE_KEY_CHARS:
            return f"  {nodeid}:\n" + "".join(lines)
        return f"  ? {nodeid}\n  : {lines[0][4:]}" + "".join(lines[1:])
    # Quoted, escaped or otherwise odd: as libyaml writes it under `tests:`, where it folds
    # a long key at the same columns as in the whole document.
    text = yaml.dump(
        {"tests": {nodeid: {name: figures[name] for name in names}}},
        Dumper=SafeDumper,
        **_DUMP_STYLE,
    )
    return text[len("tests:\n") :]


@functools.lru_cache(maxsize=256)
def _plain_name(name: str) -> bool:
    return is_plain_key(name)
