"""The baseline workflow end to end: record, compare, regress, improve, update, prune."""

from __future__ import annotations

import pytest
import yaml

CPU = "--vram-backend=cpu"

TESTS = """
import pytest
import torch

SIZE = {size}

def test_alpha(vram):
    x = torch.ones(SIZE)

def test_beta(vram):
    x = torch.ones(1024)

@pytest.mark.vram_tolerance("{marker_tolerance}")
def test_gamma(vram):
    x = torch.ones(SIZE)

def test_step(vram):
    vram.single_step(lambda: torch.ones(SIZE).sum())
"""


def write_tests(pytester: pytest.Pytester, size: int = 4096, marker_tolerance: str = "5%") -> None:
    pytester.makepyfile(test_mem=TESTS.format(size=size, marker_tolerance=marker_tolerance))


def baseline(pytester: pytest.Pytester) -> dict:
    return yaml.safe_load((pytester.path / "baselines" / "cpu.yaml").read_text())


def test_update_writes_a_sorted_file_per_device_class(pytester: pytest.Pytester) -> None:
    write_tests(pytester)
    result = pytester.runpytest(CPU, "--vram-update-baselines")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        ["pytest-vram: baselines: 4 added, 0 updated, 0 removed in baselines/cpu.yaml (4 entries)"]
    )
    text = (pytester.path / "baselines" / "cpu.yaml").read_text()
    assert text.startswith("# pytest-vram baselines")
    data = yaml.safe_load(text)
    assert data["device"] == "cpu"
    assert data["environment"]["torch"].startswith("2.")
    assert data["environment"]["pytest_vram"]
    assert list(data["tests"]) == sorted(data["tests"])
    # With what the peak held, by category: here a test's own tensors, temporaries.
    assert data["tests"]["test_mem.py::test_alpha"] == {
        "peak_allocated": 16384,
        "peak_temporaries": 16384,
    }
    assert data["tests"]["test_mem.py::test_step"] == {
        "peak_allocated": 16388,
        "peak_temporaries": 16388,
        "single_step_peak": 16388,
    }
    # A second update with the same figures changes nothing, byte for byte.
    pytester.runpytest(CPU, "--vram-update-baselines").assert_outcomes(passed=4)
    assert (pytester.path / "baselines" / "cpu.yaml").read_text() == text


def test_regression_fails_with_baseline_new_figure_change_and_update_command(
    pytester: pytest.Pytester,
) -> None:
    write_tests(pytester)
    pytester.runpytest(CPU, "--vram-update-baselines").assert_outcomes(passed=4)
    result = pytester.runpytest(CPU, "--vram-report")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*::test_alpha * 16.00 KiB * 16.00 KiB * +0 B (+0.0%) * ok"])

    write_tests(pytester, size=8192)
    result = pytester.runpytest(CPU, "--vram-report")
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines(
        [
            "*memory regression: peak allocated 32.00 KiB against baseline 16.00 KiB "
            "(+16.00 KiB, +100.0%; tolerance 5%)",
            "*if this is intended, update the baseline: "
            "pytest --vram-update-baselines test_mem.py::test_alpha",
        ]
    )
    result.stdout.fnmatch_lines(
        ["*memory regression: single-step peak 32.00 KiB against baseline 16.00 KiB*"]
    )
    result.stdout.fnmatch_lines(
        ["*::test_alpha * cpu * 32.00 KiB * 16.00 KiB * +16.00 KiB (+100.0%) * regression"]
    )


def test_improvement_passes_and_is_reported(pytester: pytest.Pytester) -> None:
    write_tests(pytester, size=8192)
    pytester.runpytest(CPU, "--vram-update-baselines")
    write_tests(pytester, size=4096)
    result = pytester.runpytest(CPU, "--vram-report")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        ["*::test_alpha * 16.00 KiB * 32.00 KiB * -16.00 KiB (-50.0%) * improved"]
    )


def test_tolerance_most_specific_wins(pytester: pytest.Pytester) -> None:
    write_tests(pytester, size=4096, marker_tolerance="100%")
    pytester.runpytest(CPU, "--vram-update-baselines")
    write_tests(pytester, size=6144, marker_tolerance="100%")  # +50%
    # The default 5%: alpha and step regress; gamma's marker allows 100%.
    result = pytester.runpytest(CPU)
    result.assert_outcomes(passed=2, failed=2)
    # The option beats the ini file; the marker beats both.
    pytester.makeini("[pytest]\nvram_tolerance = 60%\n")
    pytester.runpytest(CPU).assert_outcomes(passed=4)
    result = pytester.runpytest(CPU, "--vram-tolerance=10%")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*tolerance 10%)*"])
    # A size works as a tolerance too.
    pytester.runpytest(CPU, "--vram-tolerance=8KiB").assert_outcomes(passed=4)


def test_new_tests_pass_unless_strict(pytester: pytest.Pytester) -> None:
    write_tests(pytester)
    result = pytester.runpytest(CPU, "--vram-report")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["4 measured tests: 4 new"])
    result = pytester.runpytest(CPU, "--vram-strict", "-k", "alpha")
    result.assert_outcomes(failed=1, deselected=3)
    result.stdout.fnmatch_lines(
        ["*no baseline for test_mem.py::test_alpha on device 'cpu'*--vram-strict*"]
    )
    pytester.makeini("[pytest]\nvram_strict = true\n")
    pytester.runpytest(CPU, "-k", "alpha").assert_outcomes(failed=1, deselected=3)


def test_partial_update_keeps_entries_of_tests_that_did_not_run(
    pytester: pytest.Pytester,
) -> None:
    write_tests(pytester)
    pytester.runpytest(CPU, "--vram-update-baselines")
    before = baseline(pytester)["tests"]
    write_tests(pytester, size=8192)
    result = pytester.runpytest(CPU, "--vram-update-baselines", "-k", "alpha")
    result.assert_outcomes(passed=1, deselected=3)
    result.stdout.fnmatch_lines(
        ["pytest-vram: baselines: 0 added, 1 updated, 0 removed in baselines/cpu.yaml (4 entries)"]
    )
    after = baseline(pytester)["tests"]
    assert after["test_mem.py::test_alpha"] == {"peak_allocated": 32768, "peak_temporaries": 32768}
    for nodeid in ("test_mem.py::test_beta", "test_mem.py::test_gamma", "test_mem.py::test_step"):
        assert after[nodeid] == before[nodeid]


def test_failing_tests_do_not_update_their_entry(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_fail="""
        import torch
        from pytest_vram import max_vram

        @max_vram("1KiB")
        def test_over(vram):
            x = torch.ones(1024)

        def test_broken(vram):
            x = torch.ones(1024)
            assert False
        """
    )
    result = pytester.runpytest(CPU, "--vram-update-baselines")
    result.assert_outcomes(failed=2)
    assert not (pytester.path / "baselines" / "cpu.yaml").exists()


def test_stale_entries_are_listed_and_pruned_only_where_the_run_knows(
    pytester: pytest.Pytester,
) -> None:
    write_tests(pytester)
    pytester.makepyfile(test_other="def test_other(vram): pass")
    pytester.runpytest(CPU, "--vram-update-baselines").assert_outcomes(passed=5)
    # test_beta disappears; test_other.py still exists but this run does not collect it.
    pytester.makepyfile(
        test_mem=TESTS.format(size=4096, marker_tolerance="5%").replace(
            "def test_beta", "def _gone"
        )
    )
    result = pytester.runpytest(CPU, "--vram-report", "test_mem.py")
    result.stdout.fnmatch_lines(
        [
            "1 baseline entry has no test any more (remove it with --vram-prune-baselines):",
            "  test_mem.py::test_beta",
        ]
    )
    result = pytester.runpytest(CPU, "--vram-prune-baselines", "test_mem.py", "-k", "alpha")
    result.stdout.fnmatch_lines(
        ["*baselines: 0 added, 0 updated, 1 removed in baselines/cpu.yaml (4 entries)"]
    )
    entries = baseline(pytester)["tests"]
    assert "test_mem.py::test_beta" not in entries
    # Deselected with -k, and uncollected files, are not stale.
    assert {"test_mem.py::test_gamma", "test_other.py::test_other"} <= set(entries)
    # A run of single tests by node id says nothing of the file's other tests.
    result = pytester.runpytest(CPU, "--vram-report", "test_mem.py::test_alpha")
    result.stdout.no_fnmatch_line("*no test any more*")
    # A deleted file's entries are stale wherever the run starts.
    (pytester.path / "test_other.py").unlink()
    pytester.runpytest(CPU, "--vram-prune-baselines", "test_mem.py")
    assert "test_other.py::test_other" not in baseline(pytester)["tests"]


@pytest.mark.parametrize(
    ("content", "where", "problem"),
    [
        # The parser stops past the last line; the error names the line of the open brace.
        ("tests:\n  a: {peak_allocated: 1\n", ":2:", "malformed baseline file"),
        ("tests:\n  a:\n    peak_allocated: lots\n", ":3:", "must be an integer number of bytes"),
        ("- just\n- a list\n", "cpu.yaml:", "expected a mapping"),
        ("\x00\x01binary", "cpu.yaml", "malformed baseline file"),
    ],
)
def test_malformed_file_stops_the_run_naming_file_and_line(
    pytester: pytest.Pytester, content: str, where: str, problem: str
) -> None:
    write_tests(pytester)
    path = pytester.path / "baselines" / "cpu.yaml"
    path.parent.mkdir()
    path.write_text(content)
    result = pytester.runpytest(CPU, "--vram-update-baselines")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*cpu.yaml{where.split('cpu.yaml')[-1]}*{problem}*"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    # Nothing that was stored is lost: the broken file is left for the user to fix.
    assert path.read_text() == content


def test_unsafe_yaml_tag_never_executes(pytester: pytest.Pytester) -> None:
    write_tests(pytester)
    marker = pytester.path / "pwned"
    path = pytester.path / "baselines" / "cpu.yaml"
    path.parent.mkdir()
    path.write_text(f"tests: !!python/object/apply:os.system ['touch {marker}']\n")
    result = pytester.runpytest(CPU)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*cpu.yaml:1: malformed baseline file*python/object/apply*"])
    assert not marker.exists()


def test_baseline_dir_option_and_ini(pytester: pytest.Pytester) -> None:
    write_tests(pytester)
    pytester.runpytest(CPU, "--vram-update-baselines", "--vram-baseline-dir=custom/dir")
    assert (pytester.path / "custom" / "dir" / "cpu.yaml").exists()
    pytester.makeini("[pytest]\nvram_baseline_dir = from_ini\n")
    pytester.runpytest(CPU, "--vram-update-baselines")
    assert (pytester.path / "from_ini" / "cpu.yaml").exists()


@pytest.mark.slow
def test_xdist_writes_the_file_a_serial_run_writes(pytester: pytest.Pytester) -> None:
    write_tests(pytester)
    pytester.makepyfile(
        test_more="""
        import pytest, torch

        @pytest.mark.parametrize("n", range(8))
        def test_param(vram, n):
            x = torch.ones(256 * (n + 1))
        """
    )
    serial = pytester.runpytest_subprocess(CPU, "--vram-update-baselines")
    serial.assert_outcomes(passed=12)
    path = pytester.path / "baselines" / "cpu.yaml"
    expected = path.read_text()
    path.unlink()
    parallel = pytester.runpytest_subprocess(
        CPU, "--vram-update-baselines", "-n", "2", "-p", "xdist", "--vram-report"
    )
    parallel.assert_outcomes(passed=12)
    assert path.read_text() == expected
    parallel.stdout.fnmatch_lines(["12 measured tests: 12 ok"])
    # Comparison on workers, reports on the controller.
    write_tests(pytester, size=8192)
    regressed = pytester.runpytest_subprocess(CPU, "-n", "2", "-p", "xdist", "--vram-report")
    regressed.assert_outcomes(passed=9, failed=3)
    regressed.stdout.fnmatch_lines(["12 measured tests: 3 regression, 9 ok"])


def test_skipped_tests_are_reported_skipped_and_never_stored(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_skips="""
        import pytest, torch

        @pytest.mark.skip(reason="not today")
        def test_marked(vram):
            pass

        def test_skips_itself(vram):
            x = torch.ones(256)
            pytest.skip("after allocating")

        @pytest.fixture
        def skipping_fixture():
            pytest.skip("from a fixture")

        def test_fixture_skips(vram, skipping_fixture):
            pass

        def test_runs(vram):
            x = torch.ones(256)
        """
    )
    result = pytester.runpytest(CPU, "--vram-report", "--vram-update-baselines")
    result.assert_outcomes(passed=1, skipped=3)
    result.stdout.fnmatch_lines(["*4 measured tests: 1 ok, 3 skipped*"])
    result.stdout.no_fnmatch_line("*failed*")
    # The frames of a test that skipped itself are released: nothing is left over, and the
    # next tests start from nothing.
    result.stdout.fnmatch_lines(["test_skips.py::test_skips_itself * 1.00 KiB * 0 B * skipped"])
    result.stdout.fnmatch_lines(["test_skips.py::test_runs * 1.00 KiB * 1.00 KiB * 0 B * ok"])
    entries = baseline(pytester)["tests"]
    assert list(entries) == ["test_skips.py::test_runs"]


def test_baselines_of_the_other_cpu_counter_are_named_in_the_summary(
    pytester: pytest.Pytester,
) -> None:
    write_tests(pytester)
    pytester.runpytest(CPU, "--vram-update-baselines", "--vram-cpu-counter=allocator")
    assert baseline(pytester)["environment"]["cpu_counter"] == "allocator"
    result = pytester.runpytest(CPU, "--vram-cpu-counter=dispatch")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        [
            "pytest-vram: the baselines in cpu.yaml were measured with the allocator cpu counter "
            "and this run counts with the dispatch counter*"
        ]
    )
    same = pytester.runpytest(CPU, "--vram-cpu-counter=allocator")
    assert "cpu counter" not in same.stdout.str()
