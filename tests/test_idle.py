"""An installed plugin that no test uses: pytest's own commands work, and torch stays unloaded."""

from __future__ import annotations

import pytest

TORCH_FREE_CONFTEST = """
import sys

def pytest_sessionfinish(session):
    print("torch imported:", "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--help"], "*--vram-tolerance=TOL*growth over a baseline*"),
        (["-h"], "*--vram-report*"),
        (["--markers"], "@pytest.mark.max_vram(limit, *, metric='allocated')*"),
        (["--fixtures"], "vram -- *"),
        (["--version"], "pytest *"),
    ],
)
def test_pytests_own_commands_work_with_the_plugin_installed(
    pytester: pytest.Pytester, args: list[str], expected: str
) -> None:
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest_subprocess(*args)
    assert result.ret == 0, result.errlines
    # pytest prints its version on stderr in some releases and on stdout in others.
    output = pytest.LineMatcher(result.outlines + result.errlines)
    output.fnmatch_lines([expected])


def test_a_torch_free_project_never_imports_torch(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(TORCH_FREE_CONFTEST)
    pytester.makepyfile(
        """
        import pytest

        @pytest.fixture(scope="module")
        def data():
            return [1, 2, 3]

        @pytest.mark.parametrize("n", [1, 2])
        def test_sum(data, n):
            assert sum(data) * n == 6 * n

        def test_fails_and_is_reported():
            assert 1 + 1 == 3
        """
    )
    result = pytester.runpytest_subprocess("-s")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*torch imported: False*"])
    result.stdout.no_fnmatch_line("*pytest-vram:*")
    result.stdout.no_fnmatch_line("*vram report*")
    result.stdout.no_fnmatch_line("vram:*")


def test_torch_is_imported_once_a_test_is_measured(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(TORCH_FREE_CONFTEST)
    pytester.makepyfile("def test_plain(): pass")
    result = pytester.runpytest_subprocess("-s", "--vram-report", "--vram-backend=cpu")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*torch imported: True*", "*1 measured test*"])
