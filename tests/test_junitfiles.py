"""Reading memory figures back from JUnit XML: ``pytest-vram summary`` and ``compare``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pytest_vram.cli import main
from pytest_vram.report.junitfile import read_junit, read_memory_table
from pytest_vram.report.runcomparison import compare_runs
from pytest_vram.units import SizeError

DATA = Path(__file__).parent / "data" / "junit"
BASE = DATA / "base.xml"
HEAD = DATA / "head.xml"
GiB = 1024**3
MiB = 1024**2


def _case(
    classname: str, name: str, peak: int | str | None, status: str = "ok", **extra: int | str
) -> str:
    if peak is None:
        return f'<testcase classname="{classname}" name="{name}" time="0.1"/>'
    props = {
        "vram_backend": "sim",
        "vram_device": "sim",
        "vram_peak_allocated": peak,
        "vram_status": status,
        **extra,
    }
    body = "".join(f'<property name="{k}" value="{v}"/>' for k, v in props.items())
    return (
        f'<testcase classname="{classname}" name="{name}" time="0.1">'
        f"<properties>{body}</properties></testcase>"
    )


def _suite(*cases: str, name: str = "pytest") -> str:
    return f'<testsuite name="{name}" tests="{len(cases)}">' + "".join(cases) + "</testsuite>"


def _write(tmp_path: Path, name: str, text: str | bytes) -> str:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


# --- reading ------------------------------------------------------------------------------------


def test_rows_carry_names_outcomes_and_int_properties() -> None:
    rows = {row["name"]: row for row in read_memory_table(HEAD)}
    assert len(rows) == 5  # the test without vram properties is left out
    train = rows["suites.test_training::test_train_step[llama-1b-bf16]"]
    assert train["outcome"] == "failed"
    assert train["vram_peak_allocated"] == 19 * GiB
    assert train["vram_baseline"] == 17 * GiB
    assert train["vram_status"] == "regression"
    assert train["vram_backend"] == "cuda"
    assert train["vram_device"] == "NVIDIA H100 80GB HBM3"
    new = rows["suites.test_model::test_forward[fp8]"]
    assert new["outcome"] == "passed"
    assert "vram_baseline" not in new
    assert rows["suites.test_leaks::test_dataloader_loop"]["vram_leak_growth"] == 0


def test_environment_and_total_count() -> None:
    table = read_junit(BASE)
    assert table.total == 6
    assert len(table.rows) == 5
    assert table.environments == [
        {
            "backend": "cuda",
            "device": "NVIDIA H100 80GB HBM3",
            "torch": "2.13.0+cu128",
            "cuda": "12.8",
            "driver": "570.124.06",
            "total_memory": 85_045_231_616,
        }
    ]


def test_several_environments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    props = {
        "vram_env_cpu_backend": "cpu",
        "vram_env_cpu_device": "cpu",
        "vram_env_sim_backend": "sim",
        "vram_env_sim_device": "sim",
        "vram_env_sim_total_memory": 80 * GiB,
        "vram_env_sim_torch": "2.13.0+cpu",
    }
    body = "".join(f'<property name="{k}" value="{v}"/>' for k, v in props.items())
    text = _suite(f"<properties>{body}</properties>", _case("t", "a", 1))
    path = _write(tmp_path, "envs.xml", text)
    assert read_junit(path).environments == [
        {"backend": "cpu", "device": "cpu"},
        {"backend": "sim", "device": "sim", "total_memory": 80 * GiB, "torch": "2.13.0+cpu"},
    ]
    main(["summary", path])
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [
        "environment: cpu",
        "environment: sim, torch 2.13.0+cpu, 80.00 GiB total",
    ]


def test_summary_names_a_device_named_after_its_backend_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    props = {"vram_env_backend": "sim", "vram_env_device": "sim", "vram_env_torch": "2.13.0"}
    body = "".join(f'<property name="{k}" value="{v}"/>' for k, v in props.items())
    path = _write(
        tmp_path, "sim.xml", _suite(f"<properties>{body}</properties>", _case("t", "a", 1))
    )
    assert main(["summary", path]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "environment: sim, torch 2.13.0"


def test_bare_testsuite_root(tmp_path: Path) -> None:
    path = _write(tmp_path, "bare.xml", _suite(_case("tests.test_a", "test_x", 1024)))
    assert [row["name"] for row in read_memory_table(path)] == ["tests.test_a::test_x"]


def test_several_and_nested_suites(tmp_path: Path) -> None:
    text = (
        "<testsuites>"
        + _suite(_case("t.a", "test_1", 1), name="gw0")
        + _suite(_case("t.b", "test_2", 2), _suite(_case("t.c", "test_3", 3)), name="gw1")
        + "</testsuites>"
    )
    rows = read_memory_table(_write(tmp_path, "multi.xml", text))
    assert sorted(row["name"] for row in rows) == ["t.a::test_1", "t.b::test_2", "t.c::test_3"]


def test_outcomes(tmp_path: Path) -> None:
    def case(name: str, child: str) -> str:
        return (
            f'<testcase classname="t" name="{name}"><properties>'
            '<property name="vram_peak_allocated" value="1"/></properties>'
            f"{child}</testcase>"
        )

    text = _suite(
        case("ok", ""),
        case("bad", '<failure message="x"/>'),
        case("err", '<error message="x"/>'),
        case("skip", '<skipped message="x"/>'),
    )
    rows = {
        row["name"]: row["outcome"] for row in read_memory_table(_write(tmp_path, "o.xml", text))
    }
    assert rows == {"t::ok": "passed", "t::bad": "failed", "t::err": "error", "t::skip": "skipped"}


def test_reads_what_pytest_writes(tmp_path: Path) -> None:
    """A real --junitxml file, with user properties on tests and a suite property."""
    (tmp_path / "test_real.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.fixture(scope="session", autouse=True)
            def env(record_testsuite_property):
                record_testsuite_property("vram_env_backend", "cpu")

            class TestModel:
                @pytest.mark.parametrize("dtype", ["bf16", "a<b&c"])
                def test_forward(self, request, dtype):
                    request.node.user_properties.append(("vram_peak_allocated", 4096))
                    request.node.user_properties.append(("vram_status", "new"))

            def test_plain():
                pass
            """
        )
    )
    junit = tmp_path / "junit.xml"
    subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:vram", "-p", "no:cacheprovider"),
            f"--junitxml={junit}",
            str(tmp_path / "test_real.py"),
        ],
        cwd=tmp_path,
        check=True,
        capture_output=True,
    )
    table = read_junit(junit)
    assert table.total == 3
    assert sorted(row["name"] for row in table.rows) == [
        "test_real.TestModel::test_forward[a<b&c]",
        "test_real.TestModel::test_forward[bf16]",
    ]
    assert {row["vram_peak_allocated"] for row in table.rows} == {4096}
    assert table.environments == [{"backend": "cpu"}]


# --- compare ------------------------------------------------------------------------------------


def test_compare_kinds() -> None:
    result = compare_runs(read_memory_table(BASE), read_memory_table(HEAD), "5%")
    kinds = {change.name: change.kind for change in result.changes}
    assert kinds == {
        "suites.test_training::test_train_step[llama-1b-bf16]": "grown",
        "suites.test_inference::test_generate[kv4096]": "within-tolerance",
        "suites.test_model::test_forward[bf16]": "shrunk",
        "suites.test_model::test_forward[fp8]": "new",
        "suites.test_model::test_backward[fp32]": "removed",
        "suites.test_leaks::test_dataloader_loop": "unchanged",
    }
    assert result.failed
    (grown,) = result.grown
    assert grown.delta == 2 * GiB
    assert grown.percent == pytest.approx(100 * 2 / 17)
    # Grown first, so the failure is the first line a reader sees.
    assert result.changes[0] is grown


def test_compare_size_tolerance_and_edges() -> None:
    base = [{"name": "t", "vram_peak_allocated": 100 * MiB}]
    assert not compare_runs(base, [{"name": "t", "vram_peak_allocated": 164 * MiB}], "64MiB").failed
    assert compare_runs(base, [{"name": "t", "vram_peak_allocated": 164 * MiB + 1}], "64MiB").failed
    # A zero base peak: any growth beyond a percentage fails, and no percentage is claimed.
    (change,) = compare_runs(
        [{"name": "z", "vram_peak_allocated": 0}], [{"name": "z", "vram_peak_allocated": 1}]
    ).changes
    assert change.kind == "grown" and change.percent is None
    # A duplicated name counts with its largest peak.
    dup = [{"name": "d", "vram_peak_allocated": 10}, {"name": "d", "vram_peak_allocated": 30}]
    assert (
        compare_runs(dup, [{"name": "d", "vram_peak_allocated": 30}]).changes[0].kind == "unchanged"
    )
    with pytest.raises(SizeError):
        compare_runs(base, base, "five percent")


# --- the commands -------------------------------------------------------------------------------


def test_summary_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summary", str(HEAD)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == (
        "environment: cuda, NVIDIA H100 80GB HBM3, torch 2.13.0+cu128, CUDA 12.8, "
        "driver 570.124.06, 79.20 GiB total"
    )
    header = next(line for line in lines if line.startswith("test"))
    assert header.split() == ["test", "backend", "peak", "baseline", "status"]
    rows = [line for line in lines if line.startswith("suites.")]
    # Regressions first, then the other statuses in their order.
    assert rows[0].startswith("suites.test_training::test_train_step[llama-1b-bf16]")
    assert rows[0].split()[-5:] == ["19.00", "GiB", "17.00", "GiB", "regression"]
    assert "suites.test_model::test_forward[fp8]" in rows[1] and rows[1].endswith("new")
    assert "1 test without vram properties not shown" in out


def test_summary_without_vram_properties(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, "plain.xml", _suite(_case("t", "a", None), _case("t", "b", None)))
    assert main(["summary", path]) == 0
    out = capsys.readouterr().out
    assert "none of its 2 tests carries vram properties" in out
    assert "--junitxml" in out


def test_compare_command_fails_on_growth(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(BASE), str(HEAD)]) == 1
    out = capsys.readouterr().out
    assert "tolerance: 5%" in out
    assert "+2.00 GiB (+11.8%)  grown" in out
    assert "removed" in out and "new" in out and "shrunk" in out
    assert "1 grown beyond 5%, 1 grown within the tolerance, 1 shrunk, 1 new, 1 removed" in out
    assert out.rstrip().endswith("FAILED: 1 test grew beyond the tolerance (5%).")


def test_compare_command_within_tolerance(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(BASE), str(HEAD), "--tolerance", "12%"]) == 0
    assert "FAILED" not in capsys.readouterr().out
    assert main(["compare", str(BASE), str(HEAD), "--tolerance", "2GiB"]) == 0
    assert main(["compare", str(HEAD), str(HEAD)]) == 0
    assert "5 unchanged." in capsys.readouterr().out.splitlines()[-1]


@pytest.mark.parametrize("tolerance", ["five", "-5%", "5 %%", "GB", ""])
def test_compare_bad_tolerance(tolerance: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(BASE), str(HEAD), f"--tolerance={tolerance}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pytest-vram: error: --tolerance: invalid tolerance")
    assert "Traceback" not in err


def test_compare_base_without_properties(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _write(tmp_path, "base.xml", _suite(_case("t", "a", None)))
    assert main(["compare", base, str(HEAD)]) == 0
    out = capsys.readouterr().out
    assert "carries no vram properties; every test counts as new" in out
    assert "5 new." in out


def test_compare_head_without_properties(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    head = _write(tmp_path, "head.xml", _suite(_case("t", "a", None)))
    assert main(["compare", str(BASE), head]) == 2
    err = capsys.readouterr().err
    assert "none of its 1 test carries vram properties, so there is nothing to compare" in err


def test_compare_notes_different_devices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    head = _write(tmp_path, "sim.xml", _suite(_case("suites.test_model", "test_forward[bf16]", 1)))
    main(["compare", str(BASE), head])
    assert "note: measured on different devices: base NVIDIA H100 80GB HBM3, head sim" in (
        capsys.readouterr().out
    )


GARBAGE: dict[str, str | bytes] = {
    "empty": b"",
    "blank": b"  \n\t\n",
    "binary": bytes(range(256)) * 4,
    "gzip": b"\x1f\x8b\x08\x00" + b"\x00" * 64,
    "nul": b"<testsuites>\x00</testsuites>",
    "truncated": BASE.read_bytes()[:700],
    "html": (
        "<!DOCTYPE html>\n<html><head><title>502 Bad Gateway</title></head>"
        "<body><h1>502 Bad Gateway</h1><br></body></html>"
    ),
    "xhtml": '<html xmlns="http://www.w3.org/1999/xhtml"><body><p>hi</p></body></html>',
    "json": '{"tests": []}',
    "text": "pytest: 3 passed in 0.12s\n",
    "other_xml": '<?xml version="1.0"?><project><target name="x"/></project>',
    "utf16_mislabelled": '<?xml version="1.0" encoding="utf-8"?><testsuites/>'.encode("utf-16"),
    "unknown_encoding": '<?xml version="1.0" encoding="klingon"?><testsuites/>',
    "entity_bomb": (
        '<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY a "aaaaaaaaaa">'
        '<!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;"><!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;">'
        '<!ENTITY d "&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;"><!ENTITY e "&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;">'
        '<!ENTITY f "&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;"><!ENTITY g "&f;&f;&f;&f;&f;&f;&f;&f;&f;&f;">'
        '<!ENTITY h "&g;&g;&g;&g;&g;&g;&g;&g;&g;&g;"><!ENTITY i "&h;&h;&h;&h;&h;&h;&h;&h;&h;&h;">'
        ']><testsuites><testsuite name="&i;"/></testsuites>'
    ),
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
@pytest.mark.parametrize("command", ["summary", "compare-base", "compare-head"])
def test_garbage_files_are_clear_errors(
    kind: str, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, f"{kind}.xml", GARBAGE[kind])
    argv = {
        "summary": ["summary", path],
        "compare-base": ["compare", path, str(HEAD)],
        "compare-head": ["compare", str(BASE), path],
    }[command]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith(f"pytest-vram: error: {path}: ")
    assert "Traceback" not in captured.err
    assert captured.err.count("\n") == 1


def test_missing_file_and_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope.xml")
    assert main(["summary", missing]) == 2
    assert capsys.readouterr().err == f"pytest-vram: error: {missing}: no such file\n"
    assert main(["compare", str(tmp_path), str(HEAD)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_error_messages_say_what_was_expected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["summary", _write(tmp_path, "empty.xml", b"")])
    assert "the file is empty; expected a JUnit XML report" in capsys.readouterr().err
    main(["summary", _write(tmp_path, "page.xml", GARBAGE["xhtml"])])
    assert "root element is <{http://www.w3.org/1999/xhtml}html>" in capsys.readouterr().err
    main(["summary", _write(tmp_path, "cut.xml", GARBAGE["truncated"])])
    assert "cannot parse it as XML (" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("[1, 2]", "it holds a JSON list, not an object"),
        ('  [{"tests": []}]', "it holds a JSON list, not an object"),
        ('{"tests": []}', "no 'pytest_vram' version"),
    ],
)
@pytest.mark.parametrize("side", ["base", "head"])
def test_compare_names_a_json_file_that_is_no_vram_json_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, what: str, side: str
) -> None:
    other = _write(tmp_path, "other.json", text.encode())
    argv = ["compare", other, str(HEAD)] if side == "base" else ["compare", str(BASE), other]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"pytest-vram: error: {other}: not a pytest-vram --vram-json document ({what}); "
        "expected a JUnit XML file or a --vram-json document\n"
    )


# --- figures that cannot be read ----------------------------------------------------------------

# A value of a property in bytes that is no number of bytes, and what the error says of it.
UNREADABLE = [
    ("lots", "must be an integer number of bytes, got 'lots'"),
    ("-5", "is -5: a number of bytes is never negative"),
    ("1.5", "must be an integer number of bytes, got '1.5'"),
    ("true", "must be an integer number of bytes, got 'true'"),
    ("4 KiB", "must be an integer number of bytes, got '4 KiB'"),
    ("", "must be an integer number of bytes, got ''"),
    ("9" * 400, "has 400 digits: more bytes than any device holds (at most 9223372036854775807)"),
    ("9" * 5000, "has 5000 digits: more bytes than any device holds (at most 9223372036854775807)"),
]


@pytest.mark.parametrize(
    ("value", "problem"),
    [pytest.param(*case, id=f"{case[0][:8]}({len(case[0])})") for case in UNREADABLE],
)
@pytest.mark.parametrize("side", ["base", "head"])
def test_compare_fails_on_a_peak_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], side: str, value: str, problem: str
) -> None:
    good = _write(tmp_path, "good.xml", _suite(_case("t", "a", 100), _case("t", "b", 100)))
    bad = _write(tmp_path, "bad.xml", _suite(_case("t", "a", value), _case("t", "b", 100)))

    code = main(["compare", good, bad] if side == "head" else ["compare", bad, good])

    captured = capsys.readouterr()
    assert captured.err == (
        f"pytest-vram: error: {bad}: test t::a: property vram_peak_allocated {problem}\n"
    )
    assert captured.out == ""
    assert code == 2


def test_a_head_whose_peaks_are_words_fails_the_gate(tmp_path: Path) -> None:
    base = _write(tmp_path, "base.xml", _suite(_case("t", "a", 100), _case("t", "b", 200)))
    head = _write(tmp_path, "head.xml", _suite(_case("t", "a", "lots"), _case("t", "b", "lots")))

    done = subprocess.run(
        [sys.executable, "-m", "pytest_vram", "compare", base, head],
        capture_output=True,
        text=True,
    )

    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        f"pytest-vram: error: {head}: test t::a: property vram_peak_allocated must be an "
        "integer number of bytes, got 'lots'\n"
    )


# A property in bytes, a value that is no number of bytes, and what the error says of it.
UNREADABLE_SIZES = [
    ("vram_baseline", "lots", "must be an integer number of bytes, got 'lots'"),
    ("vram_peak_reserved", "-1", "is -1: a number of bytes is never negative"),
    ("vram_peak_device", "1e9", "must be an integer number of bytes, got '1e9'"),
    ("vram_leftover", "-4096", "is -4096: a number of bytes is never negative"),
    ("vram_start_allocated", "0x10", "must be an integer number of bytes, got '0x10'"),
    ("vram_leak_growth", "0.5", "must be an integer number of bytes, got '0.5'"),
    (
        "vram_peak_increment",
        "-" + "9" * 400,
        "has 400 digits: more bytes than any device holds (at most 9223372036854775807)",
    ),
    ("vram_peak_allocated_rank1", "lots", "must be an integer number of bytes, got 'lots'"),
]


@pytest.mark.parametrize(
    ("name", "value", "problem"), [pytest.param(*case, id=case[0]) for case in UNREADABLE_SIZES]
)
def test_summary_fails_on_any_size_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, value: str, problem: str
) -> None:
    # Read first and kept: differences, negative when memory fell, and text properties.
    kept = {"vram_leak_growth": -4096, "vram_peak_increment": -1, "vram_status_rank1": "7"}
    kept.pop(name, None)
    path = _write(tmp_path, "bad.xml", _suite(_case("t", "a", 100, **kept, **{name: value})))

    assert main(["summary", path]) == 2
    assert (
        capsys.readouterr().err
        == f"pytest-vram: error: {path}: test t::a: property {name} {problem}\n"
    )


def test_summary_fails_on_a_total_memory_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    props = {"vram_env_backend": "sim", "vram_env_total_memory": "9" * 400}
    body = "".join(f'<property name="{k}" value="{v}"/>' for k, v in props.items())
    path = _write(
        tmp_path, "env.xml", _suite(f"<properties>{body}</properties>", _case("t", "a", 1))
    )

    assert main(["summary", path]) == 2
    assert capsys.readouterr().err == (
        f"pytest-vram: error: {path}: suite pytest: property vram_env_total_memory has 400 "
        "digits: more bytes than any device holds (at most 9223372036854775807)\n"
    )


def test_a_test_that_did_not_opt_in_is_never_compared() -> None:
    base = [
        {"name": "plain", "vram_peak_allocated": 1 * MiB, "vram_status": "ungated"},
        {"name": "gated", "vram_peak_allocated": 1 * MiB, "vram_status": "ok"},
    ]
    head = [
        {"name": "plain", "vram_peak_allocated": 100 * MiB, "vram_status": "ungated"},
        {"name": "gated", "vram_peak_allocated": 1 * MiB, "vram_status": "ok"},
    ]
    result = compare_runs(base, head, "5%")
    assert not result.failed
    assert [(c.name, c.kind) for c in result.changes] == [("gated", "unchanged")]


def test_summary_reads_a_vram_json_document_and_names_one_that_is_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pytest_vram.record.record import TestRecord
    from pytest_vram.report.document import build_document

    records = [TestRecord("t.py::test_a", "cpu", "cpu", peak_allocated=4096, status="ok")]
    document = tmp_path / "run.json"
    document.write_text(json.dumps(build_document(records, {}, {"measured": "all"})))
    assert main(["summary", str(document)]) == 0
    out = capsys.readouterr().out
    assert "t.py::test_a" in out and "4.00 KiB" in out
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    assert main(["summary", str(listed)]) == 2
    assert "not a pytest-vram --vram-json document" in capsys.readouterr().err
