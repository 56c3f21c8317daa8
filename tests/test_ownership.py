"""The compared figures are a test's own: its fixtures of any scope and what it allocates, not
what other tests' fixtures hold or earlier tests left, whatever the order, alone or under xdist."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

KiB = 1024

CONFTEST = """
import pytest, torch

DEV = {device!r}

@pytest.fixture(scope="session")
def session_weights():
    return torch.ones(8 * 1024, device=DEV)  # 32 KiB

@pytest.fixture(scope="package")
def package_weights():
    return torch.ones(4 * 1024, device=DEV)  # 16 KiB
"""

TESTS = """
import pytest, torch

DEV = {device!r}

@pytest.fixture(scope="module")
def module_weights(session_weights):
    # Making it costs a temporary as large as what it keeps.
    scratch = torch.ones(2 * 1024, device=DEV)
    return scratch * 2  # 8 KiB

@pytest.fixture(scope="module")
def unused_by_most():
    return {{"big": torch.ones(64 * 1024, device=DEV)}}  # 256 KiB, held in a dict

@pytest.fixture(scope="module", params=[1, 2])
def per_param(request):
    return torch.ones(request.param * 1024, device=DEV)  # 4 or 8 KiB

@pytest.fixture
def own():
    return torch.ones(256, device=DEV)  # 1 KiB

class TestGrouped:
    @pytest.fixture(scope="class")
    def class_weights(self):
        return [torch.ones(512, device=DEV)]  # 2 KiB

    def test_class_a(self, vram, class_weights, module_weights):
        x = torch.ones(128, device=DEV)

    def test_class_b(self, vram, class_weights):
        x = torch.ones(64, device=DEV)

def test_uses_big(vram, unused_by_most):
    x = torch.ones(32, device=DEV)

def test_target(vram):
    x = torch.ones(1000, device=DEV)

def test_session_and_package(vram, session_weights, package_weights, own):
    x = torch.ones(100, device=DEV)

def test_module(vram, module_weights, own):
    x = torch.ones(300, device=DEV)

def test_param(vram, per_param):
    x = torch.ones(50, device=DEV)

def test_leaves_a_cycle(vram):
    cycle = [torch.ones(4096, device=DEV)]
    cycle.append(cycle)
"""


@pytest.fixture(params=["cpu", "sim"])
def suite(request: pytest.FixtureRequest, pytester: pytest.Pytester) -> tuple[str, list[str]]:
    backend = request.param
    device = "cpu" if backend == "cpu" else "cuda"
    package = pytester.mkpydir("pkg")
    (package / "conftest.py").write_text(CONFTEST.format(device=device))
    (package / "test_scopes.py").write_text(TESTS.format(device=device))
    result = pytester.runpytest("--collect-only", "-q", "-p", "no:randomly")
    nodeids = [line for line in result.outlines if "::" in line]
    assert len(nodeids) == 9, result.outlines
    return backend, nodeids


def peaks(pytester: pytest.Pytester, backend: str, *args: str) -> dict[str, int]:
    out = pytester.path / "out.json"
    result = pytester.runpytest(
        f"--vram-backend={backend}",
        "--vram-report",
        f"--vram-json={out}",
        "-p",
        "no:randomly",
        *args,
    )
    assert result.ret == 0, result.outlines
    return {test["nodeid"]: test["peak_allocated"] for test in json.loads(out.read_text())["tests"]}


@pytest.mark.slow
def leftovers(pytester: pytest.Pytester, passed: int) -> dict[str, int]:
    """Each test's leftover, by test name, from a cpu-backend run whose tests all pass."""
    out = pytester.path / "out.json"
    result = pytester.runpytest(
        "--vram-backend=cpu", "--vram-report", f"--vram-json={out}", "-p", "no:randomly"
    )
    result.assert_outcomes(passed=passed)
    return {
        test["nodeid"].split("::")[-1]: test["leftover"]
        for test in json.loads(out.read_text())["tests"]
    }


def test_every_test_peaks_alike_alone_in_the_suite_and_reversed(
    pytester: pytest.Pytester, suite: tuple[str, list[str]]
) -> None:
    backend, nodeids = suite
    in_suite = peaks(pytester, backend)
    reversed_order = peaks(pytester, backend, *reversed(nodeids))
    assert reversed_order == in_suite
    for nodeid in nodeids:
        if "per_param" in nodeid or "test_param" in nodeid:
            continue  # a parametrized node id runs alone below, by its own id
        assert peaks(pytester, backend, nodeid) == {nodeid: in_suite[nodeid]}, nodeid
    for nodeid in (n for n in nodeids if "test_param" in n):
        assert peaks(pytester, backend, nodeid) == {nodeid: in_suite[nodeid]}, nodeid


def test_the_figures_count_the_tests_own_fixtures_and_nothing_else(
    pytester: pytest.Pytester, suite: tuple[str, list[str]]
) -> None:
    backend, _ = suite
    measured = peaks(pytester, backend)
    by_name = {nodeid.split("::")[-1]: peak for nodeid, peak in measured.items()}

    def size(nbytes: int) -> int:  # what the backend counts for one tensor
        return nbytes if backend == "cpu" else (nbytes + 511) // 512 * 512

    # Neither the 256 KiB module fixture of another test nor any other fixture counts.
    assert by_name["test_target"] == size(4000)
    assert by_name["test_uses_big"] == 256 * KiB + size(128)
    assert by_name["test_session_and_package"] == 32 * KiB + 16 * KiB + KiB + size(400)
    # The module fixture counts with what it keeps (8 KiB) and the session fixture it uses,
    # not with the temporary of making it, whichever test made it.
    assert by_name["test_module"] == 32 * KiB + 8 * KiB + KiB + size(1200)
    assert by_name["test_class_a"] == 2 * KiB + 32 * KiB + 8 * KiB + size(512)
    assert by_name["test_class_b"] == 2 * KiB + size(256)
    assert by_name["test_param[1]"] == 4 * KiB + size(200)
    assert by_name["test_param[2]"] == 8 * KiB + size(200)


@pytest.mark.slow
def test_xdist_and_serial_write_the_same_baselines(
    pytester: pytest.Pytester, suite: tuple[str, list[str]]
) -> None:
    pytest.importorskip("xdist")
    backend, _ = suite
    files = {}
    for name, extra in {"serial": [], "xdist": ["-n", "2"]}.items():
        directory = pytester.path / f"baselines-{name}"
        result = pytester.runpytest(
            f"--vram-backend={backend}",
            "--vram-update-baselines",
            f"--vram-baseline-dir={directory}",
            "-p",
            "no:randomly",
            *extra,
        )
        assert result.ret == 0, result.outlines
        (path,) = directory.glob("*.yaml")
        files[name] = yaml.safe_load(path.read_text())["tests"]
    assert files["xdist"] == files["serial"]


def test_a_baseline_recorded_alone_holds_in_the_full_suite(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_order="""
        import pytest, torch

        @pytest.fixture(scope="module")
        def weights():
            return torch.ones(2 * 1024 * 1024)  # 8 MiB

        def test_uses_weights(vram, weights):
            weights.sum()

        def test_target(vram):
            torch.ones(1000)
        """
    )
    cpu = "--vram-backend=cpu"
    pytester.runpytest(cpu, "--vram-update-baselines", "test_order.py::test_target")
    result = pytester.runpytest(cpu, "--vram-report", "-p", "no:randomly")
    result.assert_outcomes(passed=2)
    stored = yaml.safe_load(Path(pytester.path / "baselines" / "cpu.yaml").read_text())
    assert stored["tests"]["test_order.py::test_target"]["peak_allocated"] == 4000


def test_leftover_is_what_the_test_left_not_what_its_fixtures_hold(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_left="""
        import pytest, torch

        KEPT = []

        @pytest.fixture(scope="module")
        def weights():
            return torch.ones(4096)  # 16 KiB, alive until the module ends

        def test_makes_the_fixture(vram, weights):
            pass

        def test_leaks(vram, weights):
            KEPT.append(torch.ones(1024))  # 4 KiB that outlive the test

        def test_last(vram):
            pass
        """
    )
    leftover = leftovers(pytester, passed=3)
    assert leftover == {"test_makes_the_fixture": 0, "test_leaks": 4 * KiB, "test_last": 0}


def test_broader_scoped_names_are_worked_out_once_for_the_items_that_share_them(
    pytester: pytest.Pytester,
) -> None:
    from pytest_vram.measure.ownership import broader_scoped

    pytester.makepyfile(
        """
        import pytest

        @pytest.fixture(scope="module")
        def weights():
            return 1

        @pytest.fixture
        def own():
            return 2

        @pytest.mark.parametrize("n", [1, 2, 3])
        def test_param(n, weights, own):
            pass

        def test_plain(own):
            pass
        """
    )
    items, _ = pytester.inline_genitems()
    known: dict[int, object] = {}
    assert [broader_scoped(item, known) for item in items] == [("weights",)] * 3 + [()]
    assert len(known) == 2  # the three parametrized items share one answer
    assert [broader_scoped(item) for item in items] == [("weights",)] * 3 + [()]


def test_a_fixture_that_held_a_reference_cycle_is_collected_when_it_ends(
    pytester: pytest.Pytester,
) -> None:
    # No automatic collection: only the plugin's own decide what is collected.
    pytester.makeconftest(
        """
        import gc

        def pytest_sessionstart(session):
            gc.disable()

        def pytest_sessionfinish(session):
            gc.enable()
        """
    )
    pytester.makepyfile(
        """
        import pytest
        import torch

        KEPT = []

        class Cycle:
            def __init__(self, value):
                self.me = self
                self.value = value

        @pytest.fixture(scope="module")
        def model():
            return Cycle(torch.ones(4096))  # 16 KiB that only the cycle collector frees

        def test_keeps(vram, model):
            KEPT.append(torch.ones(1024))  # 4 KiB: a full collection finds it alive

        def test_last(vram, model):
            KEPT.append(torch.ones(1024))  # 4 KiB again, and the module ends
        """
    )
    leftover = leftovers(pytester, passed=2)
    # The fixture, in the oldest generation since the first test's end, is garbage once its
    # module ends: a full collection frees it, though the one before found nothing to free.
    assert leftover == {"test_keeps": 4 * KiB, "test_last": 4 * KiB}
