"""End-to-end runs of the plugin through pytester: markers, fixtures, the report, JUnit."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from pytest_vram.backends.cpu.build import find_compiler

CPU = "--vram-backend=cpu"


def junit_properties(path) -> dict[str, dict[str, str]]:
    root = ET.parse(path).getroot()
    found = {}
    for case in root.iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        found[case.get("name")] = props
    return found


def test_budget_failure_states_limit_peak_and_excess(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import torch
        from pytest_vram import max_vram

        @max_vram("4KiB")
        def test_over(vram):
            x = torch.ones(2048, device=vram.device)  # 8 KiB

        @max_vram("1MB")
        def test_under(vram):
            x = torch.ones(2048, device=vram.device)
        """
    )
    result = pytester.runpytest(CPU)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*peak allocated memory 8.00 KiB exceeds max_vram(4.00 KiB) by 4.00 KiB*"]
    )


def test_si_budget_prints_the_typed_value(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.mark.max_vram("1kB")
        def test_over(vram):
            x = torch.ones(1000, device=vram.device)
        """
    )
    result = pytester.runpytest(CPU)
    result.stdout.fnmatch_lines(["*3.91 KiB exceeds max_vram(1000 B (1kB)) by 2.93 KiB*"])


@pytest.mark.parametrize("bad", ["'72GBs'", "'-1GB'", "'GB'", "'1e3'", "None"])
def test_bad_size_is_a_usage_error_naming_test_and_value(pytester: pytest.Pytester, bad) -> None:
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.max_vram({bad})
        def test_marked():
            pass
        """
    )
    result = pytester.runpytest(CPU)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [f"*usage error in test_bad_size*::test_marked: max_vram: invalid size {bad}*KiB/MiB*"]
    )
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    result.stdout.no_fnmatch_line("*Traceback*")


def test_wrong_marker_arguments_are_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.max_vram("1GB", metric="vram")
        def test_metric(): pass

        @pytest.mark.max_vram()
        def test_missing(): pass

        @pytest.mark.vram_backend("tpu")
        def test_backend(): pass
        """
    )
    result = pytester.runpytest(CPU)
    result.assert_outcomes(errors=3)
    result.stdout.fnmatch_lines(
        [
            "*test_metric: max_vram: invalid metric 'vram': expected one of allocated, reserved*",
            "*test_missing: max_vram(limit, *, metric='allocated')*missing*limit*",
            "*test_backend: vram_backend: unknown backend 'tpu'*",
        ],
        consecutive=False,
    )


def test_bad_options_are_usage_errors(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("--vram-tolerance=5x")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--vram-tolerance*invalid tolerance '5x'*"])
    result = pytester.runpytest("--vram-sim-capacity=lots")
    result.stderr.fnmatch_lines(["*--vram-sim-capacity*invalid size 'lots'*"])
    pytester.makeini("[pytest]\nvram_cpu_counter = fast\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*vram_cpu_counter = 'fast' is not a cpu counter: expected one of auto, allocator*"]
    )


@pytest.mark.slow
def test_xdist_workers_build_the_counter_into_an_empty_cache_together(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    if find_compiler() is None:
        pytest.skip("no C++ compiler to build the counter")
    cache = pytester.path / "cache"
    monkeypatch.setenv("PYTEST_VRAM_CACHE_DIR", str(cache))
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.mark.parametrize("n", range(4))
        def test_counted(vram, n):
            x = torch.ones(256, device=vram.device)
        """
    )
    result = pytester.runpytest_subprocess(CPU, "-p", "xdist", "-n", "2", "--vram-report")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*test_counted?0?*cpu*1.00 KiB*"])
    assert "counts from Python" not in result.stdout.str()
    # One library, its build stamp and the build lock; no partial files.
    assert sorted(path.suffix for path in cache.iterdir()) == [".lock", ".so", ".stamp"]


@pytest.mark.slow
def test_without_a_compiler_the_cpu_backend_counts_from_python_and_says_so(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A machine with no C++ compiler and nothing cached: the counting allocator cannot be built.
    monkeypatch.setenv("PATH", str(pytester.mkdir("empty-bin")))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PYTEST_VRAM_CACHE_DIR", str(pytester.path / "cache"))
    pytester.makepyfile(
        """
        import torch

        def test_counted(vram):
            x = torch.ones(256, device=vram.device)
        """
    )
    result = pytester.runpytest_subprocess(CPU, "--vram-report", "--vram-json=out.json")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_counted*cpu*1.00 KiB*",
            "pytest-vram: cpu backend counts from Python*no C++ compiler found*",
        ]
    )
    document = json.loads((pytester.path / "out.json").read_text())
    assert document["environments"]["cpu"]["cpu_counter"] == "dispatch"

    # Under pytest-xdist the note comes from a worker and still reaches the summary.
    result = pytester.runpytest_subprocess(CPU, "-p", "xdist", "-n", "2", "--vram-report")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["pytest-vram: cpu backend counts from Python*no C++ compiler*"])

    result = pytester.runpytest_subprocess(CPU, "--vram-cpu-counter=allocator")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["*usage error in *test_counted: the cpu backend's allocator counter: no C++ compiler*"]
    )


def test_cuda_backend_without_a_gpu_is_a_clear_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("--vram-backend=cuda")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--vram-backend=cuda: the cuda backend needs a CUDA GPU*"])


def test_unmeasured_tests_run_as_without_the_plugin(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import torch

        def test_plain(request):
            x = torch.ones(10)
            assert not any(name.startswith("vram") for name, _ in request.node.user_properties)
        """
    )
    result = pytester.runpytest(CPU, "--junitxml=out.xml")
    result.assert_outcomes(passed=1)
    assert junit_properties(pytester.path / "out.xml")["test_plain"] == {}


def test_markers_added_by_a_conftest_hook_count(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import pytest

        def pytest_collection_modifyitems(items):
            for item in items:
                item.add_marker(pytest.mark.max_vram("4KiB"))
        """
    )
    pytester.makepyfile(
        """
        import torch

        def test_big():
            x = torch.ones(2048)  # 8 KiB

        def test_small():
            x = torch.ones(16)
        """
    )
    result = pytester.runpytest(CPU)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*peak allocated memory 8.00 KiB exceeds max_vram(4.00 KiB)*"])


@pytest.mark.parametrize("counter", ["allocator", "dispatch"])
def test_nothing_is_counted_outside_the_measured_tests(
    pytester: pytest.Pytester, counter: str
) -> None:
    # The cpu backend goes on counting from one measured test to the next; an unmeasured test
    # and the end of the session stop it (and pop the dispatch counter's mode).
    pytester.makeconftest(
        """
        import pytest, torch
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        def counts(config):
            backend = config.pluginmanager.get_plugin("vram-session").pool.backends["cpu"]
            return backend.allocated(), backend.peak_allocated()

        @pytest.fixture
        def uncounted(request):
            before = counts(request.config)
            yield torch.ones(4096)
            assert counts(request.config) == before
            assert len(_get_current_dispatch_mode_stack()) == 0

        @pytest.hookimpl(trylast=True)
        def pytest_sessionfinish(session):
            before = counts(session.config)
            x = torch.ones(4096)
            print("counted at session end:", counts(session.config) != before)
            print("modes at session end:", len(_get_current_dispatch_mode_stack()))
        """
    )
    pytester.makepyfile(
        """
        import pytest, torch

        def test_measured_first(vram):
            x = torch.ones(10)

        def test_measured_next(vram):
            x = torch.ones(10)

        def test_unmeasured(uncounted):
            pass

        def test_measured_again(vram):
            x = torch.ones(10)

        @pytest.mark.max_vram("lots")
        def test_usage_error():
            pass

        def test_unmeasured_after_the_error(uncounted):
            pass

        def test_measured_last(vram):
            x = torch.ones(10)
        """
    )
    result = pytester.runpytest(CPU, f"--vram-cpu-counter={counter}", "-s")
    result.assert_outcomes(passed=6, errors=1)
    result.stdout.fnmatch_lines(["*counted at session end: False*", "*modes at session end: 0*"])


def test_measured_tests_carry_junit_properties_only_into_junitxml(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        import torch

        def test_measured(vram):
            x = torch.ones(10)

        def test_last(request):
            previous = request.session.items[0]
            print("properties:", [name for name, _ in previous.user_properties])
        """
    )
    result = pytester.runpytest(CPU, "-s")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*properties: []*"])
    result = pytester.runpytest(CPU, "-s", "--junitxml=out.xml")
    result.stdout.fnmatch_lines(["*properties: ['vram_backend', 'vram_device', *"])


def test_disabled_with_p_no_vram(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("-p", "no:vram", "--vram-report")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unrecognized arguments: --vram-report*"])


def test_report_lists_measured_tests_worst_first(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import torch
        from pytest_vram import max_vram

        def test_small(vram):
            x = torch.ones(256)

        def test_big(vram):
            x = torch.ones(1024 * 1024)

        @max_vram("1KiB")
        def test_over(vram):
            x = torch.ones(1024)

        def test_unmeasured():
            pass
        """
    )
    result = pytester.runpytest(CPU, "--vram-report")
    result.stdout.fnmatch_lines(
        [
            "*= vram report =*",
            "test * backend * peak * increment * leftover * baseline * change * status",
            "test_report_lists*::test_over * cpu * 4.00 KiB * 4.00 KiB * 0 B * - * - * over-budget",
            "test_report_lists*::test_big * cpu * 4.00 MiB * 4.00 MiB * 0 B * new",
            "test_report_lists*::test_small * cpu * 1.00 KiB * 1.00 KiB * 0 B * new",
            "test_report_lists*::test_unmeasured * cpu * 0 B * ungated",
            "4 measured tests: 1 over-budget, 2 new, 1 ungated",
        ]
    )


def test_leak_of_512_bytes_a_step_fails_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import torch

        def test_leaky(vram_leak_check):
            kept = []
            vram_leak_check(lambda: kept.append(torch.ones(128)), steps=100, tolerance="0B")
        """
    )
    result = pytester.runpytest(CPU, "--vram-report")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*LeakError: leak check failed: memory grew by +50.00 KiB over 100 steps*"
            "about +512 B every step*",
            "*::test_leaky * cpu * leak",
        ]
    )


def test_scenario_fixtures_record_their_results(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import json
        import torch

        def test_scenarios(vram, vram_empty_cache, vram_single_step, vram_leak_check):
            weights = torch.ones(1024)
            assert vram_empty_cache() == 4096
            step = vram_single_step(lambda: torch.ones(2048).sum())
            # step.value, the 4-byte sum, is still held after the step
            assert (step.before, step.peak, step.delta, step.after) == (4096, 12292, 8196, 4100)
            assert vram_leak_check(lambda: torch.ones(64) * 2, steps=10).growth == 0
        """
    )
    result = pytester.runpytest(CPU, "--vram-json=out.json")
    result.assert_outcomes(passed=1)
    test = json.loads((pytester.path / "out.json").read_text())["tests"][0]
    assert test["scenarios"]["empty_cache"] == {"allocated": 4096}
    assert test["scenarios"]["single_step"]["peak"] == 4096 + 8192 + 4
    assert test["scenarios"]["leak_check"]["per_step"] == [4100] * 10


def test_measure_block_gives_peak_start_end_delta(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import torch

        def test_blocks(vram):
            base = torch.ones(256)
            with vram.measure() as outer:
                a = torch.ones(1024)
                with vram.measure() as inner:
                    b = torch.ones(512)
                    del b
                del a
            assert (inner.start, inner.peak, inner.end, inner.delta) == (5120, 7168, 5120, 2048)
            assert (outer.start, outer.peak, outer.end, outer.delta) == (1024, 7168, 1024, 6144)
        """
    )
    pytester.runpytest(CPU).assert_outcomes(passed=1)


def test_requires_vram_skips_on_a_small_device(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.requires_vram("1000TB")
        def test_huge():
            pass

        @pytest.mark.requires_vram("1KiB")
        def test_tiny():
            pass
        """
    )
    result = pytester.runpytest(CPU, "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    # Reported at the test, as a skip marker's reason is.
    result.stdout.fnmatch_lines(
        ["SKIPPED [[]1] test_requires_vram_skips_on_a_small_device.py:*: requires_vram(909.49 TiB "
         "(1000TB)): the cpu device has *"]
    )  # fmt: skip


def test_out_of_memory_is_reported_and_the_next_test_starts_clean(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        import torch

        def test_oom(vram):
            held = torch.ones(1024 * 1024)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

        def test_after(vram):
            assert vram.allocated() == 0
            x = torch.ones(1024)
        """
    )
    result = pytester.runpytest(CPU, "--vram-report", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*::test_oom * cpu * 4.00 MiB * 4.00 MiB * 0 B * oom",
            "*::test_after * cpu * 4.00 KiB * 4.00 KiB * 0 B * new",
        ]
    )


def test_junit_properties_are_integer_bytes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import torch

        def test_measured(vram):
            x = torch.ones(1024, device=vram.device)
        """
    )
    pytester.runpytest(CPU, "--junitxml=out.xml").assert_outcomes(passed=1)
    props = junit_properties(pytester.path / "out.xml")["test_measured"]
    assert props["vram_backend"] == "cpu"
    assert props["vram_device"] == "cpu"
    assert props["vram_peak_allocated"] == "4096"
    assert props["vram_status"] == "new"
    assert props["vram_leftover"] == "0"
    root = ET.parse(pytester.path / "out.xml").getroot()
    suite_props = {p.get("name"): p.get("value") for p in root.find("testsuite/properties")}
    assert suite_props["vram_env_backend"] == "cpu"
    assert suite_props["vram_env_torch"].startswith("2.")


def test_junit_properties_can_be_turned_off(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_measured(vram): pass")
    result = pytester.runpytest(CPU, "--junitxml=out.xml", "--vram-junit-properties=no")
    result.assert_outcomes(passed=1)
    assert junit_properties(pytester.path / "out.xml")["test_measured"] == {}


MODULE_FIXTURES = """
import pytest
import torch

@pytest.fixture(scope="module")
def shared():
    return torch.ones(4096)  # 16 KiB, made by whichever test of the module runs first

@pytest.fixture
def own():
    return torch.ones(1024)

def test_first(vram, shared, own):
    x = torch.ones(256)

def test_second(vram, shared, own):
    y = torch.ones(512)

def test_leaves_garbage(vram):
    cycle = [torch.ones(8192)]
    cycle.append(cycle)  # collectable, but only by the cycle collector
"""


def read_peaks(path) -> dict[str, int]:
    tests = json.loads(path.read_text())["tests"]
    return {test["nodeid"]: test["peak_allocated"] for test in tests}


def test_compared_peak_does_not_depend_on_test_order(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_order=MODULE_FIXTURES)
    first = "test_order.py::test_first"
    second = "test_order.py::test_second"
    garbage = "test_order.py::test_leaves_garbage"
    expected = {first: 16384 + 4096 + 1024, second: 16384 + 4096 + 2048}
    for order in ([first], [second], [first, second, garbage], [garbage, second, first]):
        result = pytester.runpytest(CPU, "--vram-json=out.json", *order)
        result.assert_outcomes(passed=len(order))
        peaks = read_peaks(pytester.path / "out.json")
        assert {nodeid: peaks[nodeid] for nodeid in order if nodeid in expected} == {
            nodeid: expected[nodeid] for nodeid in order if nodeid in expected
        }, order


def test_a_finished_test_lets_go_of_what_measured_it(pytester: pytest.Pytester) -> None:
    # Items live as long as the session: what each keeps is walked by every garbage
    # collection of the run, so a long suite's measured tests must not pile up measurements.
    pytester.makeconftest(
        """
        import gc
        from pytest_vram.measure.measurement import TestMeasurement
        from pytest_vram.measure.ownership import OwnView
        from pytest_vram.verdict import Verdict

        def pytest_sessionfinish(session):
            kinds = (TestMeasurement, OwnView, Verdict)
            alive = {kind.__name__: 0 for kind in kinds}
            for obj in gc.get_objects():
                if type(obj) in kinds:
                    alive[type(obj).__name__] += 1
            print("\\nALIVE", sorted(alive.items()))
        """
    )
    pytester.makepyfile(
        """
        import pytest, torch
        from pytest_vram import max_vram

        @pytest.mark.parametrize("n", range(30))
        def test_small(n):
            x = torch.ones(64 * (n + 1))

        @max_vram("1MiB")
        def test_under():
            x = torch.ones(1024)
        """
    )
    result = pytester.runpytest_subprocess(CPU, "--vram-report", "-s", "-p", "no:randomly")
    result.assert_outcomes(passed=31)
    # Left: one view for all the tests without broader-scoped fixtures; no passed test's
    # verdict.
    result.stdout.fnmatch_lines(
        ["ALIVE [[]('OwnView', 1), ('TestMeasurement', 0), ('Verdict', 0)[]]"]
    )
    # Each test's figures are still its own.
    result.stdout.fnmatch_lines(["*::test_small[[]29[]] * cpu * 7.50 KiB * 7.50 KiB *0 B*ungated"])
    result.stdout.fnmatch_lines(["*::test_small[[]10[]] * cpu * 2.75 KiB * 2.75 KiB *0 B*ungated"])
    result.stdout.fnmatch_lines(["*::test_under * cpu * 4.00 KiB * 4.00 KiB *0 B*new"])
