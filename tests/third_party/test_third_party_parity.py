"""The suites of this folder, written in the style of third parties' suites, have the same
outcome under ``--vram-report`` as under plain pytest: on a first run and on a second, which
knows from pytest's cache which files compute their values."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def counts(result: pytest.RunResult) -> dict[str, int]:
    """The run's outcome counts, subtests included (counted under -q)."""
    return {k: v for k, v in result.parseoutcomes().items() if k not in ("warning", "warnings")}


@pytest.mark.slow
@pytest.mark.parametrize("suite", ["test_odeint_style.py", "test_optimizer_style.py"])
def test_the_outcome_is_plain_pytest_s(pytester: pytest.Pytester, suite: str) -> None:
    pytester.makepyfile(**{suite.removesuffix(".py"): (HERE / suite).read_text()})
    plain = counts(pytester.runpytest_subprocess("-p", "no:vram", "-q"))
    assert plain.get("failed", 0) == 0
    first = counts(pytester.runpytest_subprocess("--vram-report", "-q"))
    cached = counts(pytester.runpytest_subprocess("--vram-report", "-q"))
    assert first == plain
    assert cached == plain
