"""The schema of a baseline entry, from its one owner: which figures a record stores, how a
rank's copy and a category total are named, and which figures count something other than
bytes."""

from __future__ import annotations

import subprocess
import sys

from pytest_vram.record.figures import (
    CATEGORY_FIGURES,
    COMPARED_FIGURES,
    LARGER_IS_BETTER,
    MEASURED_FIGURES,
    SCENARIO_FIGURES,
    category_figures,
    category_label,
    entry_categories,
    entry_for_rank,
    figure_unit,
    is_known_figure,
    rank_figure_name,
    rank_figures,
    stored_figures,
)
from pytest_vram.record.record import TestRecord

SCENARIOS = {
    "empty_cache": {"allocated": 18944},
    "single_step": {"peak": 36864, "delta": 17920},
    "leak_check": {"growth": -512, "steps": 2},
    "max_size": {"value": 48, "knob": "batch"},
}
BREAKDOWN = {"total": 300, "categories": {"parameters": 100, "activations": 200}, "modules": []}


def test_a_measurement_stores_its_peaks_scenarios_and_categories_by_name() -> None:
    figures = stored_figures(1000, 2048, None, SCENARIOS, BREAKDOWN)
    assert figures == {
        "peak_allocated": 1000,
        "peak_reserved": 2048,
        "idle": 18944,
        "single_step_peak": 36864,
        "leak_growth": 0,  # memory fell over the steps: no growth is stored
        "max_size": 48,
        "peak_parameters": 100,
        "peak_activations": 200,
    }
    assert all(is_known_figure(name) for name in figures)
    # A record stores exactly these, less what its backend cannot store.
    record = TestRecord(
        "t.py::a",
        "cuda",
        "gpu",
        peak_allocated=1000,
        peak_reserved=2048,
        scenarios=SCENARIOS,
        breakdown=BREAKDOWN,
        unstored=["peak_reserved"],
    )
    assert record.figures() == {k: v for k, v in figures.items() if k != "peak_reserved"}


def test_every_named_figure_is_a_measured_or_category_figure() -> None:
    assert set(COMPARED_FIGURES) <= set(MEASURED_FIGURES)
    assert {name for name, _key in SCENARIO_FIGURES.values()} <= set(MEASURED_FIGURES)
    assert LARGER_IS_BETTER.issubset(MEASURED_FIGURES)
    # The categories that held memory, each under its figure's name.
    assert tuple(category_figures(BREAKDOWN)) == ("peak_parameters", "peak_activations")
    assert set(category_figures(BREAKDOWN)) <= set(CATEGORY_FIGURES)
    assert category_figures(None) == {}


def test_an_entrys_category_totals_read_back_by_category() -> None:
    entry = {"peak_allocated": 300, **category_figures(BREAKDOWN)}
    assert entry_categories(entry) == {
        "parameters": 100,
        "gradients": 0,
        "optimizer": 0,
        "activations": 200,
        "temporaries": 0,
        "cublas_workspaces": 0,
        "other": 0,
    }
    assert entry_categories({"peak_allocated": 300}) is None
    assert entry_categories(None) is None


def test_the_cublas_workspaces_are_a_category_of_their_own() -> None:
    assert is_known_figure("peak_cublas_workspaces")
    assert category_label("cublas_workspaces") == "cuBLAS workspaces"
    assert category_label("activations") == "activations"
    # An entry stored before the category existed (the workspaces in peak_other) still reads.
    old = {"peak_allocated": 96, "peak_other": 64, "peak_parameters": 32}
    categories = entry_categories(old)
    assert categories is not None
    assert (categories["other"], categories["cublas_workspaces"]) == (64, 0)


def test_a_rank_copy_is_named_for_its_figure_and_counts_as_it_does() -> None:
    assert rank_figure_name("peak_allocated", 3) == "peak_allocated_rank3"
    assert is_known_figure(rank_figure_name("peak_activations", 999_999))
    assert not is_known_figure(rank_figure_name("peak", 1))
    assert figure_unit("max_size") == figure_unit(rank_figure_name("max_size", 2)) == "count"
    assert figure_unit("peak_allocated") == figure_unit("peak_other_rank1") == "bytes"


def test_a_multi_rank_entry_holds_the_worst_of_each_figure_and_each_ranks_own() -> None:
    ranks = [
        {"rank": 0, "figures": {"peak_allocated": 100, "max_size": 12}},
        {"rank": 1, "figures": {"peak_allocated": 300, "max_size": 9}},
    ]
    entry = rank_figures(ranks)
    assert entry == {
        "peak_allocated": 300,
        "max_size": 9,
        "peak_allocated_rank0": 100,
        "max_size_rank0": 12,
        "peak_allocated_rank1": 300,
        "max_size_rank1": 9,
    }
    # Each rank is compared with its own copy; an entry stored before the test ran on ranks
    # compares every rank with the one figure.
    assert entry_for_rank(entry, 0) == {"peak_allocated": 100, "max_size": 12}
    assert entry_for_rank({"peak_allocated": 5}, 1) == {"peak_allocated": 5}
    assert entry_for_rank(None, 1) is None


def test_a_records_figures_need_neither_the_rank_exchange_nor_attribution() -> None:
    # The stored figures are plain data: the record that carries them (and every reader of
    # a --vram-json document) loads neither the torchrun machinery nor the breakdown.
    code = (
        "import sys\n"
        "from pytest_vram.record.record import TestRecord\n"
        "ranks = [{'rank': 0, 'figures': {'peak_allocated': 1}}]\n"
        "assert TestRecord('t.py::a', 'cuda', 'gpu', ranks=ranks).figures()\n"
        "print(sorted(m for m in sys.modules if m.startswith('pytest_vram.')))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "pytest_vram.distributed" not in loaded
    assert "pytest_vram.attribution" not in loaded
