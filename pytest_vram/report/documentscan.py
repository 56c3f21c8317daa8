"""A fast reader of what ``pytest-vram history`` needs from a ``--vram-json`` document: its
``run`` section, when it was written, and each test's node id, peak and status.

A history reads hundreds of documents of thousands of tests each; parsing each whole with
:mod:`json` builds every figure of every test only to drop it. The plugin writes its documents
in one layout (``json.dumps(document, indent=2)``, the run section last, each test's own fields
six spaces in), so those three fields are found by their lines. Anything that is not that
layout (another tool's rewrite, a compact dump) gets ``None``, and the caller parses the
document whole.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["scan_document"]

_START = '{\n  "pytest_vram": '
_TESTS = '\n  "tests": ['
_TEST = '\n    {\n      "nodeid": '
_PEAK = '\n      "peak_allocated": '
_STATUS = '\n      "status": '
_CREATED = '\n  "created": '
_RUN = '\n  "run": '


def scan_document(text: str) -> tuple[dict[str, Any], str, dict[str, tuple[int, str]]] | None:
    """``(run, created, {nodeid: (peak, status)})``, or None where the layout is not the
    writer's. A test listed more than once (several backends) keeps its largest peak."""
    if not text.startswith(_START):
        return None
    try:
        run, created = _run(text), _created(text)
    except ValueError:
        return None
    start = text.find(_TESTS)
    if start < 0:
        return None
    peaks: dict[str, tuple[int, str]] = {}
    find = text.find
    at = find(_TEST, start)
    while at >= 0:
        following = find(_TEST, at + len(_TEST))
        end = following if following >= 0 else len(text)
        name_at = at + len(_TEST)
        name_end = find("\n", name_at)
        peak_at = find(_PEAK, name_end, end)
        status_at = find(_STATUS, name_end, end)
        if peak_at < 0 or status_at < 0:
            return None  # a test without them is no record the plugin wrote
        try:
            nodeid = _value(text, name_at, name_end)
            peak = _value(text, peak_at + len(_PEAK), find("\n", peak_at + len(_PEAK)))
            status = _value(text, status_at + len(_STATUS), find("\n", status_at + len(_STATUS)))
        except ValueError:
            return None
        if type(nodeid) is str and type(peak) is int:
            old = peaks.get(nodeid)
            if old is None or peak > old[0]:
                peaks[nodeid] = (peak, status if type(status) is str else "")
        at = following
    return run, created, peaks


def _value(text: str, start: int, end: int) -> Any:
    """The JSON value on one line, without the comma that may follow it."""
    token = text[start:end].rstrip().removesuffix(",")
    if token.startswith('"') and "\\" not in token:
        return token[1:-1]  # the common case: a plain string, no escapes to decode
    if token.isdigit():
        return int(token)
    return json.loads(token)


def _run(text: str) -> dict[str, Any]:
    """The run section: the document's last field, so read from it to the end."""
    at = text.rfind(_RUN)
    if at < 0:
        return {}
    run = json.loads("{" + text[at:])["run"]
    if not isinstance(run, dict):
        raise ValueError("run is no object")
    return run


def _created(text: str) -> str:
    at = text.find(_CREATED)
    if at < 0:
        return ""
    value = _value(text, at + len(_CREATED), text.find("\n", at + len(_CREATED)))
    return value if isinstance(value, str) else ""
