"""A fast reader of what ``pytest-vram history`` needs from a ``--vram-json`` document: its
``run`` section, when it was written, and each test's node id, peak and status.

A history reads hundreds of documents of thousands of tests each; parsing each whole with
:mod:`json` builds every figure of every test only to drop it. The plugin writes its documents
in one layout (``json.dumps(document, indent=2)``, the run section last, each test's own fields
six spaces in), so those three fields are found by their lines, each by one regular expression
over the whole text. Anything that is not that
layout (another tool's rewrite, a compact dump) gets ``None``, and the caller parses the
document whole.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["scan_document"]

_START = '{\n  "pytest_vram": '
_TESTS = '\n  "tests": ['
_CREATED = '\n  "created": '
_RUN = '\n  "run": '
# A test's own fields, six spaces in; what a test holds (its baseline, its ranks) is deeper.
# One pass of each over the document: C's loop, not Python's, walks its lines.
_NODEID = re.compile(r'\n    \{\n      "nodeid": ("[^\n]*"),\n')
_PEAK = re.compile(r'\n      "peak_allocated": ([^\n,]*)')
_STATUS = re.compile(r'\n      "status": ([^\n,]*)')


def scan_document(text: str) -> tuple[dict[str, Any], str, dict[str, tuple[int, str]]] | None:
    """``(run, created, {nodeid: (peak, status)})``, or None where the layout is not the
    writer's. A test listed more than once (several backends) keeps its largest peak."""
    if not text.startswith(_START):
        return None
    start = text.find(_TESTS)
    if start < 0:
        return None
    try:
        run, created = _run(text), _created(text)
        names = _NODEID.findall(text, start)
        peaks = _PEAK.findall(text, start)
        statuses = _STATUS.findall(text, start)
        # Each test has each field once: the n-th of each is the n-th test's.
        if not len(names) == len(peaks) == len(statuses):
            return None
        found: dict[str, tuple[int, str]] = {}
        for name_token, peak_token, status_token in zip(names, peaks, statuses, strict=True):
            nodeid = _string(name_token)
            peak = int(peak_token) if peak_token.isdigit() else json.loads(peak_token)
            if type(nodeid) is not str or type(peak) is not int:
                continue  # no figure to draw, as the whole-document reader skips it
            status = _string(status_token)
            old = found.get(nodeid)
            if old is None or peak > old[0]:
                found[nodeid] = (peak, status if type(status) is str else "")
    except ValueError:
        return None
    return run, created, found


def _string(token: str) -> Any:
    """A JSON value from its token; a plain string without escapes is cut out directly."""
    if token.startswith('"') and token.endswith('"') and "\\" not in token:
        return token[1:-1]
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
    token = text[at + len(_CREATED) : text.find("\n", at + len(_CREATED))].rstrip(",")
    value = _string(token)
    return value if isinstance(value, str) else ""
