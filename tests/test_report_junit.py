"""The vram_* JUnit XML properties."""

from __future__ import annotations

from report_records import record, records

from pytest_vram.report.document import build_document
from pytest_vram.report.junit import junit_properties, row_properties, suite_properties

GiB = 1024**3
MiB = 1024**2


# -- JUnit -------------------------------------------------------------------------------


def test_junit_properties_names_and_integer_sizes() -> None:
    props = dict(
        junit_properties(
            record(
                "t.py::test_a",
                3 * GiB,
                "regression",
                start_allocated=1 * GiB,
                end_allocated=1 * GiB + 512,
                peak_reserved=4 * GiB,
                peak_device=5 * GiB,
                baseline={"peak_allocated": 2 * GiB},
                scenarios={"leak_check": {"growth": 4096}},
            )
        )
    )
    assert props == {
        "vram_backend": "cuda",
        "vram_device": "NVIDIA H100 80GB HBM3",
        "vram_peak_allocated": 3 * GiB,
        "vram_baseline": 2 * GiB,
        "vram_status": "regression",
        "vram_start_allocated": 1 * GiB,
        "vram_peak_increment": 2 * GiB,
        "vram_leftover": 512,
        "vram_peak_reserved": 4 * GiB,
        "vram_peak_device": 5 * GiB,
        "vram_leak_growth": 4096,
    }
    for name, value in props.items():
        assert name.startswith("vram_")
        if name not in ("vram_backend", "vram_device", "vram_status"):
            assert type(value) is int, name


def test_junit_properties_without_optional_figures() -> None:
    props = junit_properties(record("t.py::test_a", 1024, "new", backend="cpu", device="cpu"))
    names = [name for name, _ in props]
    assert names[:3] == ["vram_backend", "vram_device", "vram_peak_allocated"]
    assert "vram_status" in names
    for absent in ("vram_baseline", "vram_peak_reserved", "vram_peak_device", "vram_leak_growth"):
        assert absent not in names
    assert dict(props)["vram_status"] == "new"


def test_junit_property_names_are_unique() -> None:
    names = [name for name, _ in junit_properties(records()[3])]
    assert len(names) == len(set(names))


def test_junit_properties_are_those_of_the_document_row() -> None:
    document = build_document(records(), {})
    by_id = {test["nodeid"]: test for test in document["tests"]}
    for rec in records():
        assert row_properties(by_id[rec.nodeid]) == junit_properties(rec)


def test_sim_reports_peak_reserved() -> None:
    props = dict(junit_properties(record("t.py::a", 10, backend="sim", peak_reserved=2 * MiB)))
    assert props["vram_peak_reserved"] == 2 * MiB
    assert "vram_peak_device" not in props


def test_suite_properties_of_one_environment() -> None:
    environment = {
        "backend": "cpu",
        "device": "cpu",
        "cpu_counter": "allocator",
        "torch": "2.13.0",
        "cuda": None,
        "total_memory": 64 * GiB,
        "hostname": "not a suite property",
    }
    assert suite_properties({"cpu": environment}) == [
        ("vram_env_backend", "cpu"),
        ("vram_env_device", "cpu"),
        ("vram_env_cpu_counter", "allocator"),
        ("vram_env_torch", "2.13.0"),
        ("vram_env_total_memory", str(64 * GiB)),
    ]


def test_suite_properties_of_several_environments_name_the_backend() -> None:
    props = suite_properties({"sim": {"device": "sim"}, "cpu": {"device": "cpu"}})
    assert props == [("vram_env_cpu_device", "cpu"), ("vram_env_sim_device", "sim")]
    assert suite_properties({}) == []
