"""pytest-vram fit: the table of GPU sizes against layouts, from --build or --config."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pytest_vram.cli import main

CONFIGS = Path(__file__).parent / "configs"

BUILD = """
import torch


def build(layout):
    width = 512
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
    ).to("cuda")

    def step(batch):
        optimizer = torch.optim.AdamW(model.parameters())
        with torch.autocast("cuda", dtype=layout.compute_dtype, enabled=layout.dtype != "fp32"):
            loss = model(torch.randn(batch, layout.seq, width, device="cuda")).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step
"""


@pytest.fixture(autouse=True)
def sys_path_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fit --build`` makes the current directory importable, as ``python -m`` does; run
    in-process here, that lasts only for the test (later pytester runs would otherwise find this
    checkout's own package metadata in it)."""
    monkeypatch.setattr(sys, "path", list(sys.path))


@pytest.fixture
def builder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "fit_model_under_test.py").write_text(BUILD)
    monkeypatch.chdir(tmp_path)
    yield "fit_model_under_test:build"
    sys.modules.pop("fit_model_under_test", None)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(["fit", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_build_gives_the_largest_batch_per_capacity_and_layout(
    builder: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, out, _ = run(
        capsys, "--build", builder, "--capacity", "64MiB", "200MB", "--seq", "64",
        "--dtype", "fp32", "bf16", "--json", "--html", str(tmp_path / "fit.html"),
    )  # fmt: skip
    assert status == 0
    table = json.loads(out)
    assert [c["capacity"] for c in table["capacities"]] == ["64MiB", "200MB"]
    fp32, bf16 = table["layouts"]
    assert (fp32["label"], bf16["label"]) == ("fp32, 1 GPU", "bf16, 1 GPU")
    for layout in (fp32, bf16):
        small, large = layout["fits"]
        assert 1 <= small["max_batch"] < large["max_batch"]
        assert small["peak"] <= 64 << 20 < small["next_peak"]
        assert large["peak"] <= 200_000_000 < large["next_peak"]
        assert small["estimated_max_batch"] is None  # no config to estimate from
    # bf16 activations are half the size: more sequences fit.
    assert bf16["fits"][1]["max_batch"] > fp32["fits"][1]["max_batch"]
    # Neither recomputes nor shards: the one that fits more sequences is the cheaper.
    assert table["capacities"][1]["cheapest"] == "bf16, 1 GPU"
    html = (tmp_path / "fit.html").read_text()
    assert "<svg" in html and "bf16, 1 GPU" in html and "200MB" in html


def test_the_terminal_table_names_each_capacity_and_the_cheapest_layout(
    builder: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = run(capsys, "--build", builder, "--capacity", "1MiB", "64MiB", "--seq", "64")
    assert status == 0
    lines = out.splitlines()
    assert lines[0].split("  ")[0] == "GPU"
    assert lines[1].startswith("1MiB") and lines[1].endswith("none")
    assert lines[2].startswith("64MiB") and "bf16, 1 GPU: batch" in lines[2]
    assert "bf16, 1 GPU:" in err  # progress goes to stderr


@pytest.mark.slow
def test_config_puts_the_estimators_answer_beside_the_simulated_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("transformers")
    status, out, _ = run(
        capsys, "--config", str(CONFIGS / "qwen2.5-0.5b.json"), "--capacity", "24GB",
        "--seq", "512", "--json",
    )  # fmt: skip
    assert status == 0
    (fit,) = json.loads(out)["layouts"][0]["fits"]
    assert fit["max_batch"] >= 1 and fit["estimated_max_batch"] >= 1
    assert fit["peak"] <= 24_000_000_000 < fit["next_peak"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--build", "nosuchmodule_h13:build"], "cannot import 'nosuchmodule_h13'"),
        (["--build", "json"], "expected MODULE:FUNCTION"),
        (["--build", "json:nothing"], "has no function 'nothing'"),
        (["--build", "json:loads", "--capacity", "80GBs"], "invalid size '80GBs'"),
        (["--build", "json:loads", "--zero", "3"], "give --gpus 2 or more"),
    ],
)
def test_input_it_cannot_use_is_an_error_naming_it(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    status, _, err = run(capsys, *args)
    assert status == 2
    assert message in err and "Traceback" not in err


NOISY = """
import torch

print("imported: chatty")


def build(layout):
    print("building", layout.dtype)
    model = torch.nn.Linear(64, 64).to("cuda")

    def step(batch):
        print("step of", batch)
        model(torch.randn(batch, 64, device="cuda")).sum().backward()

    return step


def not_a_step(layout):
    return 42
"""


@pytest.fixture
def chatty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "fit_chatty_h43.py").write_text(NOISY)
    monkeypatch.chdir(tmp_path)
    yield "fit_chatty_h43"
    sys.modules.pop("fit_chatty_h43", None)


def test_what_the_builder_prints_goes_to_stderr_and_the_json_stays_json(
    chatty: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = run(
        capsys, "--build", f"{chatty}:build", "--capacity", "1MiB", "--max-batch", "4", "--json"
    )
    assert status == 0
    assert json.loads(out)["layouts"][0]["label"] == "bf16, 1 GPU"
    assert "imported: chatty" in err and "building bf16" in err and "step of 1" in err


@pytest.mark.slow
def test_two_layouts_with_a_chatty_builder_give_one_json_object(chatty: str, capfd) -> None:
    status = main(
        ["fit", "--build", f"{chatty}:build", "--capacity", "1MiB", "--max-batch", "4",
         "--dtype", "fp32", "bf16", "--json"]
    )  # fmt: skip
    out, err = capfd.readouterr()
    assert status == 0, err
    assert [layout["label"] for layout in json.loads(out)["layouts"]] == [
        "fp32, 1 GPU",
        "bf16, 1 GPU",
    ]
    assert "building fp32" in err and "building bf16" in err


@pytest.mark.parametrize("where", ["directory", "below a file"])
def test_an_html_path_that_cannot_be_written_is_refused_before_the_search(
    chatty: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, where: str
) -> None:
    if where == "directory":
        path = tmp_path / "pages"
        path.mkdir()
        reason = "it is a directory"
    else:
        (tmp_path / "plain").write_text("")
        path = tmp_path / "plain" / "fit.html"
        reason = "is a file, not a directory"
    status, out, err = run(capsys, "--build", f"{chatty}:build", "--html", str(path))
    assert status == 2 and out == ""
    assert f"--html {path}: cannot write the page there: " in err and reason in err
    assert "Traceback" not in err
    assert chatty not in sys.modules  # nothing ran: not even the builder's import


# With two layouts each runs in a process of its own (seconds), whose error is the same line.
@pytest.mark.parametrize(
    "dtypes", [["bf16"], pytest.param(["fp32", "bf16"], marks=pytest.mark.slow)]
)
def test_a_builder_that_returns_no_step_is_an_error_naming_it(
    chatty: str, capsys: pytest.CaptureFixture[str], dtypes: list[str]
) -> None:
    status, _, err = run(
        capsys, "--build", f"{chatty}:not_a_step", "--capacity", "1MiB", "--dtype", *dtypes
    )
    assert status == 2
    (line,) = [line for line in err.splitlines() if line.startswith("pytest-vram: error")]
    assert line == (
        f"pytest-vram: error: --build {chatty}:not_a_step: it returned 42 (int), not a step: "
        "return step(batch), a function that runs one training step on batch sequences"
    )


def test_a_builder_module_with_a_syntax_error_is_an_error_naming_its_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "fit_broken_h43.py").write_text("def build(layout)\n    pass\n")
    monkeypatch.chdir(tmp_path)
    status, _, err = run(capsys, "--build", "fit_broken_h43:build")
    assert status == 2 and "Traceback" not in err
    assert err.strip() == (
        "pytest-vram: error: --build 'fit_broken_h43:build': cannot import 'fit_broken_h43': "
        f"expected ':' ({tmp_path / 'fit_broken_h43.py'}, line 1)"
    )


def test_an_html_path_that_turns_unwritable_during_the_search_is_one_line_after_the_table(
    chatty: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_vram.fit import render

    def refused(table: object, path: Path) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(render, "write_html", refused)
    page = tmp_path / "fit.html"
    status, out, err = run(
        capsys, "--build", f"{chatty}:build", "--capacity", "1MiB", "--max-batch", "4",
        "--html", str(page),
    )  # fmt: skip
    assert status == 2
    assert out.startswith("GPU")  # the table, before the error
    assert err.splitlines()[-1] == (
        f"pytest-vram: error: --html {page}: cannot write the page: Permission denied ({page})"
    )


def test_a_step_that_leaks_between_attempts_is_an_error_naming_the_builder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "fit_leaky_step.py").write_text(
        "import torch\n\nKEPT = []\n\n\ndef build(layout):\n"
        "    def step(batch):\n"
        "        KEPT.append(torch.empty(batch, 1 << 20, device='cuda'))\n\n"
        "    return step\n"
    )
    monkeypatch.chdir(tmp_path)
    status, out, err = run(capsys, "--build", "fit_leaky_step:build", "--capacity", "1GiB")
    sys.modules.pop("fit_leaky_step", None)
    assert status == 2 and "Traceback" not in err and out == ""
    (line,) = [line for line in err.splitlines() if line.startswith("pytest-vram: error")]
    assert line.startswith("pytest-vram: error: --build fit_leaky_step:build: ")
    assert "more allocated each time it ran" in line
