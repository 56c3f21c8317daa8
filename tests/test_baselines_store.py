"""The YAML baseline store: files, safety, atomic writes, comparisons and the writer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from pytest_vram.baselines import progress
from pytest_vram.baselines.compare import FigureChange, compare_with_entry
from pytest_vram.baselines.errors import BaselineFileError
from pytest_vram.baselines.file import BaselineFile, read_careful, read_fast
from pytest_vram.baselines.layout import END_LINE
from pytest_vram.baselines.store import BaselineStore, file_name_for
from pytest_vram.baselines.writer import BaselineWriter
from pytest_vram.record.record import TestRecord as Record
from pytest_vram.units import parse_tolerance

H100 = "NVIDIA H100 80GB HBM3"
GiB = 1024**3


def sample(path: Path) -> BaselineFile:
    return BaselineFile(
        path=path,
        device=H100,
        environment={"torch": "2.13.0", "cuda": "12.8", "driver": "570.124.06"},
        entries={
            "tests/test_b.py::test_train[bf16]": {
                "peak_allocated": 19 * GiB,
                "peak_reserved": 20 * GiB,
                "idle": 0,
            },
            "tests/test_a.py::test_infer": {"peak_allocated": 5 * GiB},
            "tests/test_a.py::test_odd[a: b, #1]": {"peak_allocated": 1},
        },
    )


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# -- file names --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "name"),
    [
        (H100, "nvidia-h100-80gb-hbm3.yaml"),
        ("NVIDIA GeForce RTX 4090", "nvidia-geforce-rtx-4090.yaml"),
        ("NVIDIA A100-SXM4-80GB", "nvidia-a100-sxm4-80gb.yaml"),
        ("cpu", "cpu.yaml"),
        ("sim", "sim.yaml"),
        ("../../etc/passwd", "etc-passwd.yaml"),
        ("", "device.yaml"),
    ],
)
def test_file_name_for(device: str, name: str) -> None:
    assert file_name_for(device) == name


# -- dump and read -----------------------------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    original = sample(tmp_path / "h100.yaml")
    original.write()
    loaded = BaselineFile.read(tmp_path / "h100.yaml")
    assert loaded.path == original.path
    assert loaded.device == original.device
    assert loaded.environment == original.environment
    assert loaded.entries == original.entries


def test_dump_is_sorted_and_stable(tmp_path: Path) -> None:
    baseline = sample(tmp_path / "h100.yaml")
    text = baseline.dump()
    assert text == baseline.dump()

    data = yaml.safe_load(text)
    assert list(data) == ["device", "environment", "tests"]
    assert list(data["tests"]) == sorted(baseline.entries)
    assert list(data["environment"]) == sorted(baseline.environment)
    for figures in data["tests"].values():
        assert list(figures) == sorted(figures)


def test_dump_does_not_depend_on_insertion_order(tmp_path: Path) -> None:
    forward = sample(tmp_path / "h100.yaml")
    backward = BaselineFile(
        path=forward.path,
        device=forward.device,
        environment=dict(reversed(list(forward.environment.items()))),
        entries={
            nodeid: dict(reversed(list(figures.items())))
            for nodeid, figures in reversed(list(forward.entries.items()))
        },
    )
    assert backward.dump() == forward.dump()


def test_dump_reads_back_after_a_rewrite(tmp_path: Path) -> None:
    path = tmp_path / "h100.yaml"
    sample(path).write()
    first = path.read_text()
    BaselineFile.read(path).write()
    assert path.read_text() == first


def test_dump_leaves_out_unknown_environment_values(tmp_path: Path) -> None:
    baseline = BaselineFile(tmp_path / "cpu.yaml", "cpu", {"torch": "2.13.0", "cuda": None})
    assert yaml.safe_load(baseline.dump())["environment"] == {"torch": "2.13.0"}


def test_dump_starts_with_a_comment_on_updating(tmp_path: Path) -> None:
    text = sample(tmp_path / "h100.yaml").dump()
    assert text.startswith("#")
    assert "--vram-update-baselines" in text.splitlines()[1]


def test_read_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "cpu.yaml"
    path.write_text("")
    loaded = BaselineFile.read(path)
    assert loaded.device == "cpu"
    assert loaded.entries == {}
    assert loaded.environment == {}


def test_read_missing_file_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(BaselineFileError, match=r"missing\.yaml"):
        BaselineFile.read(tmp_path / "missing.yaml")


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "cpu.yaml"
    path.write_text(
        "device: cpu\n"
        "tests:\n"
        "  tests/test_a.py::test_x:\n"
        "    peak_allocated: 1024\n"
        "  tests/test_a.py::test_y: {peak_allocated: 2048\n"
        "  tests/test_a.py::test_z:\n"
        "    peak_allocated: 1\n"
    )
    with pytest.raises(BaselineFileError) as info:
        BaselineFile.read(path)
    message = str(info.value)
    assert f"{path}:" in message
    line = int(message.split(f"{path}:")[1].split(":")[0])
    assert line in (5, 6)


def test_not_utf8_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cpu.yaml"
    path.write_bytes(b"device: cpu\ntests:\n  \xff\xfe: 1\n")
    with pytest.raises(BaselineFileError, match=r"cpu\.yaml"):
        BaselineFile.read(path)


@pytest.mark.parametrize(
    "tag",
    [
        "!!python/object/apply:os.system",
        "!!python/object/new:os.system",
        "!!python/object/apply:subprocess.check_call",
    ],
)
def test_python_tags_never_execute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tag: str
) -> None:
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "pwned"
    command = (
        '["echo pwned > somefile"]'
        if tag.endswith("os.system")
        else f'[["sh", "-c", "echo pwned > {target}"]]'
    )
    path = tmp_path / "cpu.yaml"
    path.write_text(
        f"device: cpu\ntests:\n  tests/test_a.py::test_x:\n    peak_allocated: {tag} {command}\n"
    )
    with pytest.raises(BaselineFileError) as info:
        BaselineFile.read(path)
    assert str(path) in str(info.value)
    assert not (tmp_path / "somefile").exists()
    assert not target.exists()


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("- a\n- b\n", "mapping"),
        ("device: cpu\ntests:\n  - tests/test_a.py::test_x\n", "tests"),
        ("device: cpu\ntests: 12\n", "tests"),
        ("device: cpu\ntests:\n  tests/test_a.py::test_x: 1024\n", "test_x"),
        ("device: cpu\ntests:\n  t.py::test_x:\n    peak_allocated: 1.5\n", "1.5"),
        ("device: cpu\ntests:\n  t.py::test_x:\n    peak_allocated: true\n", "True"),
        ("device: cpu\ntests:\n  t.py::test_x:\n    peak_allocated: '1024'\n", "'1024'"),
        ("device: cpu\ntests:\n  t.py::test_x:\n    peak_allocated: 1GB\n", "'1GB'"),
        ("device: cpu\ntests:\n  t.py::test_x:\n    peak_allocated: null\n", "None"),
        ("device: cpu\nenvironment: [torch]\n", "environment"),
    ],
)
def test_wrong_shapes_are_errors_naming_the_file(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "cpu.yaml"
    path.write_text(text)
    with pytest.raises(BaselineFileError) as info:
        BaselineFile.read(path)
    assert str(path) in str(info.value)
    assert words in str(info.value)


def test_bad_figure_error_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "cpu.yaml"
    path.write_text(
        "device: cpu\n"
        "tests:\n"
        "  tests/test_a.py::test_x:\n"
        "    peak_allocated: 1024\n"
        "  tests/test_a.py::test_y:\n"
        "    peak_allocated: lots\n"
    )
    with pytest.raises(BaselineFileError) as info:
        BaselineFile.read(path)
    assert f"{path}:5:" in str(info.value) or f"{path}:6:" in str(info.value)


def test_bad_figure_error_names_its_line_when_another_id_contains_it(tmp_path: Path) -> None:
    path = tmp_path / "cpu.yaml"
    path.write_text(
        "device: cpu\n"
        "tests:\n"
        "  at.py::x:\n"
        "    peak_allocated: 1024\n"
        "  t.py::x:\n"
        "    peak_allocated: 1.5\n"
    )
    with pytest.raises(BaselineFileError) as info:
        BaselineFile.read(path)
    assert f"{path}:5:" in str(info.value) or f"{path}:6:" in str(info.value)


# -- atomic writes -----------------------------------------------------------------------


def test_write_creates_the_directory_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    path = tmp_path / "baselines" / "nvidia-h100-80gb-hbm3.yaml"
    sample(path).write()
    assert files_in(path.parent) == ["nvidia-h100-80gb-hbm3.yaml"]
    sample(path).write()
    assert files_in(path.parent) == ["nvidia-h100-80gb-hbm3.yaml"]


def test_failed_replace_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "h100.yaml"
    sample(path).write()
    old = path.read_text()

    def replace(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", replace)
    changed = sample(path)
    changed.entries["tests/test_c.py::test_new"] = {"peak_allocated": 1}
    with pytest.raises(OSError, match="disk full"):
        changed.write()
    monkeypatch.undo()
    assert path.read_text() == old
    assert files_in(tmp_path) == ["h100.yaml"]


def test_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "h100.yaml"
    sample(path).write()
    old = path.read_text()

    def fsync(fd: int) -> None:
        raise OSError("I/O error")

    monkeypatch.setattr(os, "fsync", fsync)
    changed = sample(path)
    changed.entries.clear()
    with pytest.raises(OSError, match="I/O error"):
        changed.write()
    monkeypatch.undo()
    assert path.read_text() == old
    assert files_in(tmp_path) == ["h100.yaml"]


def test_interrupted_dump_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "h100.yaml"
    sample(path).write()
    old = path.read_text()

    def dump(self: BaselineFile) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(BaselineFile, "dump", dump)
    with pytest.raises(KeyboardInterrupt):
        sample(path).write()
    monkeypatch.undo()
    assert path.read_text() == old
    assert files_in(tmp_path) == ["h100.yaml"]


def test_rewrite_keeps_the_file_mode(tmp_path: Path) -> None:
    path = tmp_path / "h100.yaml"
    sample(path).write()
    path.chmod(0o644)
    sample(path).write()
    assert os.stat(path).st_mode & 0o777 == 0o644


# -- the store ---------------------------------------------------------------------------


def test_store_loads_a_directory(tmp_path: Path) -> None:
    sample(tmp_path / file_name_for(H100)).write()
    cpu = BaselineFile(tmp_path / "cpu.yaml", "cpu", {"torch": "2.13.0"})
    cpu.entries["tests/test_a.py::test_infer"] = {"peak_allocated": 4096}
    cpu.write()
    (tmp_path / "README.md").write_text("not a baseline")

    store = BaselineStore.load(tmp_path)
    assert sorted(store.files) == sorted([H100, "cpu"])
    assert store.entry("cpu", "tests/test_a.py::test_infer") == {"peak_allocated": 4096}
    assert store.entry(H100, "tests/test_a.py::test_infer") == {"peak_allocated": 5 * GiB}
    assert store.entry("cpu", "tests/test_a.py::test_other") is None
    assert store.entry("sim", "tests/test_a.py::test_infer") is None


def test_store_of_a_missing_directory_is_empty(tmp_path: Path) -> None:
    store = BaselineStore.load(tmp_path / "nowhere")
    assert store.files == {}
    assert store.entry("cpu", "t.py::t") is None


def test_store_with_a_malformed_file_names_it(tmp_path: Path) -> None:
    (tmp_path / "cpu.yaml").write_text("device: cpu\ntests: [\n")
    with pytest.raises(BaselineFileError, match=r"cpu\.yaml"):
        BaselineStore.load(tmp_path)


def test_store_file_for_a_new_device(tmp_path: Path) -> None:
    store = BaselineStore.load(tmp_path)
    baseline = store.file_for(H100)
    assert baseline.path == tmp_path / "nvidia-h100-80gb-hbm3.yaml"
    assert baseline.device == H100
    assert baseline.entries == {}
    assert store.file_for(H100) is baseline


# -- comparisons -------------------------------------------------------------------------


def test_compare_takes_figures_on_both_sides_in_order() -> None:
    tolerance = parse_tolerance("5%")
    current = {"leak_growth": 0, "peak_allocated": 1100, "idle": 10, "peak_reserved": 4096}
    baseline = {"peak_allocated": 1000, "leak_growth": 0, "single_step_peak": 7, "peak_reserved": 1}
    changes = compare_with_entry(current, baseline, tolerance)
    assert [c.figure for c in changes] == ["peak_allocated", "leak_growth"]
    assert changes[0] == FigureChange("peak_allocated", 1000, 1100, tolerance)


def test_compare_nothing_in_common() -> None:
    assert compare_with_entry({"peak_allocated": 1}, {"idle": 1}, parse_tolerance("5%")) == []


@pytest.mark.parametrize(
    ("baseline", "current", "tolerance", "regressed", "improved"),
    [
        (1000, 1000, "5%", False, False),
        (1000, 1050, "5%", False, False),
        (1000, 1051, "5%", True, False),
        (1000, 950, "5%", False, False),
        (1000, 949, "5%", False, True),
        (10 * GiB, 10 * GiB + 64 * 1024**2, "64MiB", False, False),
        (10 * GiB, 10 * GiB + 64 * 1024**2 + 1, "64MiB", True, False),
        (1000, 1001, "0B", True, False),
        (1000, 999, "0B", False, True),
        (0, 1, "5%", True, False),
        (0, 0, "5%", False, False),
    ],
)
def test_change_regressed_and_improved(
    baseline: int, current: int, tolerance: str, regressed: bool, improved: bool
) -> None:
    change = FigureChange("peak_allocated", baseline, current, parse_tolerance(tolerance))
    assert change.delta == current - baseline
    assert change.regressed is regressed
    assert change.improved is improved


def test_change_percent() -> None:
    tolerance = parse_tolerance("5%")
    assert FigureChange("peak_allocated", 1000, 1100, tolerance).percent == pytest.approx(10.0)
    assert FigureChange("peak_allocated", 1000, 750, tolerance).percent == pytest.approx(-25.0)
    assert FigureChange("peak_allocated", 0, 10, tolerance).percent is None


def test_change_describe() -> None:
    change = FigureChange("peak_allocated", 16 * GiB, 18 * GiB, parse_tolerance("5%"))
    assert change.describe() == (
        "peak allocated 18.00 GiB against baseline 16.00 GiB (+2.00 GiB, +12.5%; tolerance 5%)"
    )


def test_change_describe_without_percent() -> None:
    change = FigureChange("leak_growth", 0, 512, parse_tolerance("0B"))
    assert change.describe() == (
        "leak-check growth 512 B against baseline 0 B (+512 B; tolerance 0B)"
    )


# -- the writer --------------------------------------------------------------------------


def record(nodeid: str, peak: int, **kwargs: Any) -> Record:
    fields: dict[str, Any] = {"backend": "cpu", "device": "cpu", "peak_allocated": peak}
    fields.update(kwargs)
    return Record(nodeid=nodeid, **fields)


CPU_ENV = {"cpu": {"backend": "cpu", "device": "cpu", "torch": "2.13.0"}}


def test_writer_stores_passed_tests_only(tmp_path: Path) -> None:
    store = BaselineStore.load(tmp_path)
    writer = BaselineWriter(store, CPU_ENV)
    writer.update(
        [
            record("t.py::test_ok", 1000),
            record("t.py::test_new", 2000, status="new"),
            record("t.py::test_regressed_but_updated", 3000, status="regression"),
            record("t.py::test_failed", 4000, outcome="failed", status="failed"),
            record("t.py::test_skipped", 0, outcome="skipped", status="skipped"),
            record("t.py::test_oom", 5000, status="oom"),
            record("t.py::test_over", 6000, status="over-budget"),
            record("t.py::test_leak", 7000, status="leak"),
        ]
    )
    writer.save()
    stored = BaselineFile.read(tmp_path / "cpu.yaml")
    assert stored.entries == {
        "t.py::test_ok": {"peak_allocated": 1000},
        "t.py::test_new": {"peak_allocated": 2000},
        "t.py::test_regressed_but_updated": {"peak_allocated": 3000},
    }
    assert stored.environment == CPU_ENV["cpu"]


def test_writer_stores_all_figures_of_a_record(tmp_path: Path) -> None:
    writer = BaselineWriter(BaselineStore.load(tmp_path), CPU_ENV)
    full = record(
        "t.py::test_full",
        1000,
        peak_reserved=2048,
        peak_device=4096,
        scenarios={
            "empty_cache": {"allocated": 10},
            "single_step": {"peak": 500, "delta": 1, "before": 1, "after": 1},
            "leak_check": {"growth": 0},
        },
    )
    writer.update([full])
    writer.save()
    assert BaselineFile.read(tmp_path / "cpu.yaml").entries["t.py::test_full"] == {
        "peak_allocated": 1000,
        "peak_reserved": 2048,
        "peak_device": 4096,
        "idle": 10,
        "single_step_peak": 500,
        "leak_growth": 0,
    }


def test_writer_keeps_entries_of_tests_that_did_not_run(tmp_path: Path) -> None:
    existing = BaselineFile(tmp_path / "cpu.yaml", "cpu", dict(CPU_ENV["cpu"]))
    existing.entries = {
        "t.py::test_a": {"peak_allocated": 1},
        "t.py::test_b": {"peak_allocated": 2},
    }
    existing.write()

    writer = BaselineWriter(BaselineStore.load(tmp_path), CPU_ENV)
    writer.update([record("t.py::test_b", 20), record("t.py::test_c", 30)])
    lines = writer.save().lines
    assert BaselineFile.read(tmp_path / "cpu.yaml").entries == {
        "t.py::test_a": {"peak_allocated": 1},
        "t.py::test_b": {"peak_allocated": 20},
        "t.py::test_c": {"peak_allocated": 30},
    }
    assert len(lines) == 1
    assert (
        lines[0]
        == f"baselines: 1 added, 1 updated, 0 removed in {tmp_path / 'cpu.yaml'} (3 entries)"
    )


def test_writer_prune_removes_entries(tmp_path: Path) -> None:
    existing = BaselineFile(tmp_path / "cpu.yaml", "cpu", dict(CPU_ENV["cpu"]))
    existing.entries = {"t.py::test_a": {"peak_allocated": 1}, "t.py::gone": {"peak_allocated": 2}}
    existing.write()
    other = sample(tmp_path / file_name_for(H100))
    other.entries["t.py::gone"] = {"peak_allocated": 3}
    other.write()

    writer = BaselineWriter(BaselineStore.load(tmp_path), CPU_ENV)
    writer.prune(["t.py::gone", "t.py::never_there"])
    lines = writer.save().lines
    assert BaselineFile.read(tmp_path / "cpu.yaml").entries == {
        "t.py::test_a": {"peak_allocated": 1}
    }
    assert "t.py::gone" not in BaselineFile.read(tmp_path / file_name_for(H100)).entries
    assert len(lines) == 2
    assert all("1 removed" in line for line in lines)


def test_writer_saves_only_changed_files(tmp_path: Path) -> None:
    # Hand-formatted files: any rewrite would change their bytes.
    cpu_text = (
        "device: cpu\nenvironment: {torch: 2.13.0}\ntests: {'t.py::a': {peak_allocated: 1}}\n"
    )
    (tmp_path / "cpu.yaml").write_text(cpu_text)
    sim_text = "device: sim\ntests: {'t.py::a': {peak_allocated: 2}}\n"
    (tmp_path / "sim.yaml").write_text(sim_text)

    environments = {"sim": {"torch": "2.13.0"}}
    writer = BaselineWriter(BaselineStore.load(tmp_path), environments)
    writer.update([record("t.py::b", 5, backend="sim", device="sim")])
    lines = writer.save().lines
    assert len(lines) == 1
    assert "sim.yaml" in lines[0]
    assert (tmp_path / "cpu.yaml").read_text() == cpu_text
    assert (tmp_path / "sim.yaml").read_text() != sim_text
    assert writer.save().lines == []


def test_writer_with_unchanged_figures_writes_nothing(tmp_path: Path) -> None:
    text = "device: cpu\nenvironment: {torch: 2.13.0}\ntests: {'t.py::a': {peak_allocated: 1}}\n"
    (tmp_path / "cpu.yaml").write_text(text)
    writer = BaselineWriter(BaselineStore.load(tmp_path), {"cpu": {"torch": "2.13.0"}})
    writer.update([record("t.py::a", 1)])
    assert writer.save().lines == []
    assert (tmp_path / "cpu.yaml").read_text() == text


def test_writer_records_a_new_environment(tmp_path: Path) -> None:
    text = "device: cpu\nenvironment: {torch: 2.12.0}\ntests: {'t.py::a': {peak_allocated: 1}}\n"
    (tmp_path / "cpu.yaml").write_text(text)
    writer = BaselineWriter(BaselineStore.load(tmp_path), {"cpu": {"torch": "2.13.0"}})
    writer.update([record("t.py::a", 1)])
    assert len(writer.save().lines) == 1
    assert BaselineFile.read(tmp_path / "cpu.yaml").environment == {"torch": "2.13.0"}


def test_writer_creates_a_file_for_a_new_device(tmp_path: Path) -> None:
    directory = tmp_path / "baselines"
    writer = BaselineWriter(BaselineStore.load(directory), {"cuda": {"gpu": H100}})
    writer.update([record("t.py::a", 10 * GiB, backend="cuda", device=H100)])
    writer.save()
    # Beside the file: its lock, and the .gitignore that keeps the lock out of commits.
    assert files_in(directory) == [
        ".gitignore",
        ".nvidia-h100-80gb-hbm3.yaml.lock",
        "nvidia-h100-80gb-hbm3.yaml",
    ]
    loaded = BaselineStore.load(directory)
    assert loaded.entry(H100, "t.py::a") == {"peak_allocated": 10 * GiB}


# -- a whole file, and one cut short ---------------------------------------------------------


def odd_ids_sample(path: Path) -> BaselineFile:
    """Node ids the writer quotes, escapes, folds or writes as `? KEY`, among plain ones."""
    nodeids = [
        "tests/test_a.py::test_plain",
        "tests/test_a.py::test_odd[a: b, #1]",
        "tests/test_a.py::test_hash[#1]",
        "tests/test_a.py::test_quotes['single']",
        'tests/test_a.py::test_quotes["double"]',
        "tests/test_a.py::test_quotes[it''s]",
        "tests/test_ü.py::test_unicode[中文]",
        "tests/test_a.py::test_escaped[\\u00fc]",
        "tests/test_a.py::test_space[a b]",
        "tests/test_a.py::test_colon[a:b]",
        "tests/test_a.py::test_colon_end:",
        "tests/test_a.py::test_long[" + "x" * 200 + "]",
        "tests/test_a.py::test_long_spaces[" + "a b " * 300 + "]",
        "tests/test_a.py::test_emoji[\U0001f600]",
        "tests/test_a.py::test_control[\t]",
        "-tests/test_a.py::dash",
        "/abs/test_a.py::test_slash",
        "yes",
        "1:20",
    ]
    return BaselineFile(
        path,
        "NVIDIA H100 80GB HBM3",
        {"torch": "2.13.0", "cuda": "12.8"},
        {
            nodeid: {"peak_allocated": 1000 + index, "idle": index, "peak_reserved": 2**62}
            for index, nodeid in enumerate(nodeids)
        },
    )


def test_dump_announces_and_ends_with_the_closing_line(tmp_path: Path) -> None:
    text = sample(tmp_path / "h100.yaml").dump()
    assert END_LINE in text.splitlines()[2]
    assert text.endswith(f"\n{END_LINE}\n")
    assert BaselineFile(tmp_path / "cpu.yaml", "cpu").dump().endswith(f"tests: {{}}\n{END_LINE}\n")


def test_dump_writes_what_libyaml_writes_for_the_document(tmp_path: Path) -> None:
    # Stable across versions: the same bytes as the whole document through libyaml, between
    # the header and the closing line.
    baseline = odd_ids_sample(tmp_path / "h100.yaml")
    document = {
        "device": baseline.device,
        "environment": dict(sorted(baseline.environment.items())),
        "tests": {k: dict(sorted(baseline.entries[k].items())) for k in sorted(baseline.entries)},
    }
    body = yaml.dump(
        document,
        Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper),
        sort_keys=False,
        default_flow_style=False,
        width=1000,
    )
    text = baseline.dump()
    header, rest = text.split("device:", 1)
    assert header.count("\n") == 3
    assert "device:" + rest == body + f"{END_LINE}\n"


def test_every_cut_point_of_a_file_is_an_error_or_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "nvidia-h100-80gb-hbm3.yaml"
    original = odd_ids_sample(path)
    whole = original.dump().encode("utf-8")
    loaded_whole = []
    for cut in range(1, len(whole)):
        path.write_bytes(whole[:cut])
        try:
            loaded = BaselineFile.read(path)
        except BaselineFileError as exc:
            message = str(exc)
            assert message.startswith(f"{path}:"), (cut, message)
            assert "cut short" in message, (cut, message)
            assert f"git checkout -- {path}" in message
            assert "--vram-update-baselines" in message
        else:
            assert loaded.entries == original.entries, cut
            loaded_whole.append(cut)
    # Only the final newline may go: the closing line itself is all there.
    assert loaded_whole == [len(whole) - 1]
    # An empty file (a cut at byte 0) is a file with no baselines yet, as it always was.
    path.write_bytes(b"")
    assert BaselineFile.read(path).entries == {}


def test_a_cut_short_error_names_the_last_line(tmp_path: Path) -> None:
    path = tmp_path / "h100.yaml"
    sample(path).write()
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:9]))
    with pytest.raises(BaselineFileError, match=rf"^{path}:9: baseline file cut short"):
        BaselineFile.read(path)
    with pytest.raises(BaselineFileError, match=rf"^{path}:9: baseline file cut short"):
        read_careful(path)


def test_a_file_with_windows_line_ends_is_whole_or_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "h100.yaml"
    text = sample(path).dump().replace("\n", "\r\n")
    path.write_bytes(text.encode())
    assert BaselineFile.read(path).entries == sample(path).entries
    path.write_bytes(text[: text.index("  tests/test_b.py")].encode())
    with pytest.raises(BaselineFileError, match="cut short"):
        BaselineFile.read(path)


OLD_FORMAT = """\
# pytest-vram baselines: peak memory per test, in bytes, for one device class.
# Update after an intended change with: pytest --vram-update-baselines
device: sim
environment:
  backend: sim
  pytest_vram: 0.1.0
  torch: 2.13.0+cpu
tests:
  suites/test_inference.py::test_decoding_does_not_leak:
    leak_growth: 0
    peak_allocated: 14441472
    peak_reserved: 16777216
  suites/test_sim_32b.py::test_32b_training_step_fits_its_budget:
    peak_allocated: 327638768640
    peak_reserved: 335106015232
    single_step_peak: 327638768640
"""


def test_a_file_of_the_previous_version_loads_and_gets_the_closing_line(tmp_path: Path) -> None:
    path = tmp_path / "sim.yaml"
    path.write_text(OLD_FORMAT)
    loaded = BaselineFile.read(path)
    assert read_fast(path) == loaded == read_careful(path)
    assert loaded.entries["suites/test_inference.py::test_decoding_does_not_leak"] == {
        "leak_growth": 0,
        "peak_allocated": 14441472,
        "peak_reserved": 16777216,
    }
    writer = BaselineWriter(BaselineStore.load(tmp_path), {"sim": {"torch": "2.13.0+cpu"}})
    writer.update([record("t.py::new", 5, backend="sim", device="sim")])
    assert writer.save().errors == []
    text = path.read_text()
    assert text.endswith(f"\n{END_LINE}\n")
    assert BaselineFile.read(path).entries == {**loaded.entries, "t.py::new": {"peak_allocated": 5}}
    # Cut short now, it is an error.
    path.write_text(text[: text.index("  t.py::new")])
    with pytest.raises(BaselineFileError, match="cut short"):
        BaselineFile.read(path)


# -- the fast reader and the careful one -----------------------------------------------------


def test_the_fast_reader_reads_odd_node_ids_as_the_careful_one(tmp_path: Path) -> None:
    path = tmp_path / "nvidia-h100-80gb-hbm3.yaml"
    original = odd_ids_sample(path)
    original.write()
    fast = read_fast(path)
    assert fast is not None  # read fast, quoted ids and all
    assert fast == read_careful(path) == BaselineFile.read(path)
    assert fast.entries == original.entries


def test_the_fast_reader_reads_20000_entries_as_the_careful_one(tmp_path: Path) -> None:
    path = tmp_path / "cpu.yaml"
    baseline = BaselineFile(path, "cpu", {"torch": "2.13.0"})
    for index in range(20_000):
        nodeid = f"tests/test_m{index % 97}.py::test_case[{index}-{'x' * (index % 150)}]"
        figures = {"peak_allocated": index * 4099, "leak_growth": 0}
        if index % 3:
            figures["peak_reserved"] = 2_097_152 * (index % 11)
        if index % 500 == 0:
            figures["peak_allocated_rank1"] = 10**17 + index
        baseline.entries[nodeid] = figures
    baseline.entries["tests/test_q.py::test_quoted[a: b]"] = {"idle": 7}
    baseline.write()
    fast = read_fast(path)
    assert fast is not None
    assert fast == read_careful(path)
    assert fast.entries == baseline.entries


@pytest.mark.parametrize("seed", range(4))
def test_the_fast_reader_errs_or_agrees_with_the_careful_one_on_damaged_files(
    tmp_path: Path, seed: int
) -> None:
    """Any damage (a character inserted or dropped, a line repeated) reads the same through
    BaselineFile.read as through the careful reader alone: the same entries or the same
    error, with its line."""
    import random

    path = tmp_path / "nvidia-h100-80gb-hbm3.yaml"
    whole = odd_ids_sample(path).dump()
    rng = random.Random(seed)

    def outcome(read: Any) -> Any:
        try:
            loaded = read(path)
        except BaselineFileError as exc:
            return str(exc)
        return None if loaded is None else (loaded.device, loaded.environment, loaded.entries)

    for _ in range(150):
        text = whole
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(text))
            choice = rng.random()
            if choice < 0.4:
                text = text[:at] + text[at + 1 :]
            elif choice < 0.8:
                text = text[:at] + rng.choice(" :#'\"\n-{}[]0a1\t?,&*!|>%@`~\\.ü\r") + text[at:]
            else:
                lines = text.splitlines(keepends=True)
                lines.insert(rng.randrange(len(lines)), rng.choice(lines))
                text = "".join(lines)
        path.write_text(text, encoding="utf-8")
        careful = outcome(read_careful)
        assert outcome(BaselineFile.read) == careful, text
        assert outcome(read_fast) in (None, careful), text


@pytest.mark.parametrize(
    ("figure", "words"),
    [
        ("    peak_allocated: 1\n    peak_alocated: 2\n", "unknown figure 'peak_alocated'"),
        ("    peak_allocated: 99999999999999999999\n", "peak_allocated has 20 digits"),
    ],
)
def test_figures_are_checked_as_every_reader_checks_them(
    tmp_path: Path, figure: str, words: str
) -> None:
    path = tmp_path / "cpu.yaml"
    text = BaselineFile(path, "cpu", {}, {"t.py::a": {"idle": 1}}).dump()
    path.write_text(text.replace("    idle: 1\n", figure))
    with pytest.raises(BaselineFileError) as info:
        BaselineFile.read(path)
    assert str(info.value).startswith(f"{path}:")
    assert f"'t.py::a': {words}" in str(info.value)


def test_a_slow_load_says_so_on_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "h100.yaml"
    sample(path).write()
    BaselineFile.read(path)
    assert capsys.readouterr().err == ""  # quick: not a word
    monkeypatch.setattr(progress, "PROGRESS_AFTER_S", 0.0)
    BaselineFile.read(path)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"pytest-vram: loading the baselines in {path} (")
    assert err[1].startswith(f"pytest-vram: loaded 3 entries from {path} in ")
    # Hand-written in flow style: read by the careful reader, which the last line says.
    path.write_text(path.read_text().replace("tests:\n", "tests:\n  t.py::hand: {idle: 1}\n"))
    assert BaselineFile.read(path).entries["t.py::hand"] == {"idle": 1}
    assert "with the careful YAML reader" in capsys.readouterr().err
