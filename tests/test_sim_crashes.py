"""No test takes the run down: TorchScript computes, and a test whose shape-only run killed its
process computes in the next run, which says so."""

from __future__ import annotations

import pytest

# The crash of issue 42: TorchScript's constant folding writes into a fake tensor's missing
# data. A test that calls such a function, and the test after it, pass.
SCRIPTED = """
import torch
from torch import nn


@torch.jit.script
def scale(x: torch.Tensor) -> torch.Tensor:
    return x * torch.tensor([1.0, 2.0])


def test_scripted_function(vram):
    assert scale(torch.ones(3, 2, device="cuda")).sum().item() == 9.0


def test_after_it(vram):
    assert torch.ones(4, device="cuda").sum().item() == 4.0


class Rows(nn.Module):
    def forward(self, x):
        return torch.concat([x, torch.tensor([[1.0, 2.0]])])


def test_traced_module(vram):
    traced = torch.jit.trace(Rows(), torch.ones(1, 2))
    assert traced(torch.zeros(1, 2)).tolist() == [[0.0, 0.0], [1.0, 2.0]]


def test_scripted_module(vram):
    module = torch.jit.script(nn.Linear(2, 3))
    assert module(torch.ones(4, 2)).shape == (4, 3)
"""


@pytest.mark.slow
@pytest.mark.parametrize("first", ["", "test_scripted_module", "test_traced_module"])
def test_torchscript_computes_instead_of_crashing(pytester: pytest.Pytester, first: str) -> None:
    pytester.makepyfile(test_scripted=SCRIPTED)
    # Each test first in its file: the one that meets TorchScript shape-only.
    selected = ("-k", first) if first else ()
    result = pytester.runpytest_subprocess("--vram-report", "-p", "no:randomly", *selected)
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=1 if first else 4)


def test_torchscript_is_refused_shape_only(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_scripted=SCRIPTED)
    result = pytester.runpytest("--vram-report", "--vram-sim-compute=never", "-k", "function")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*TorchScriptShapeOnly: this test calls a TorchScript function (scripted or traced)*"]
    )


# A test that kills its process the first time it runs (the guard file), as a crash in native
# code would, and writes down whether its tensors were fake when it runs to its end.
KILLED = """
import os
import signal
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor


def test_before(vram):
    assert torch.ones(2, device="cuda").shape == (2,)


def test_dies_once(vram):
    guard = Path("killed-once")
    if not guard.exists():
        guard.write_text("")
        os.kill(os.getpid(), signal.SIGKILL)
    fake = isinstance(torch.ones(2, device="cuda"), FakeTensor)
    Path("mode").write_text("shape-only" if fake else "computing")


def test_after(vram):
    assert torch.ones(2, device="cuda").shape == (2,)
"""


@pytest.mark.slow
def test_a_test_that_killed_its_process_computes_in_the_next_run(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_killed=KILLED)
    died = pytester.runpytest_subprocess("--vram-report", "-p", "no:randomly")
    assert died.ret != 0
    assert not (pytester.path / "mode").exists()

    result = pytester.runpytest_subprocess("--vram-report", "-p", "no:randomly")
    result.assert_outcomes(passed=3)
    assert (pytester.path / "mode").read_text() == "computing"
    result.stdout.fnmatch_lines(
        [
            "pytest-vram: test_killed.py::test_dies_once: a process of an earlier run died "
            "while this test ran shape-only (killed, or a crash in native code on fake "
            "tensors); it computes from the start in this run and the ones after it (pytest "
            "--cache-clear forgets)"
        ]
    )
    # Remembered: the run after computes it from the start too, and has nothing to say.
    (pytester.path / "mode").unlink()
    again = pytester.runpytest_subprocess("--vram-report", "-p", "no:randomly")
    again.assert_outcomes(passed=3)
    assert (pytester.path / "mode").read_text() == "computing"
    assert "died while this test ran" not in again.stdout.str()
    # Forgotten with the cache: it runs shape-only, as any test.
    (pytester.path / "mode").unlink()
    cleared = pytester.runpytest_subprocess("--vram-report", "-p", "no:randomly", "--cache-clear")
    cleared.assert_outcomes(passed=3)
    assert (pytester.path / "mode").read_text() == "shape-only"


@pytest.mark.slow
def test_an_xdist_worker_that_died_in_a_test_is_found_by_its_controller(
    pytester: pytest.Pytester,
) -> None:
    pytest.importorskip("xdist")
    pytester.makepyfile(test_killed=KILLED)
    died = pytester.runpytest_subprocess("--vram-report", "-p", "no:randomly", "-n", "1")
    assert died.ret != 0
    died.stdout.fnmatch_lines(
        [
            "pytest-vram: test_killed.py::test_dies_once: an xdist worker of this run died "
            "while this test ran shape-only (killed, or a crash in native code on fake "
            "tensors); it computes from the start in the runs after this one (pytest "
            "--cache-clear forgets)"
        ]
    )
    (pytester.path / "mode").unlink(missing_ok=True)
    result = pytester.runpytest_subprocess("--vram-report", "-p", "no:randomly", "-n", "1")
    result.assert_outcomes(passed=3)
    assert (pytester.path / "mode").read_text() == "computing"
