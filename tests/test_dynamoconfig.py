"""Shape-only tests make their FakeTensorMode, and run the decompositions torch keeps from
Dynamo, without importing torch._dynamo, which stays importable and whole for code that
compiles.

Each check runs in a fresh interpreter: this one may have imported torch._dynamo already.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def run_python(code: str) -> str:
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout


def test_a_shape_only_test_does_not_import_dynamo() -> None:
    out = run_python(
        """
        import sys
        import torch
        from pytest_vram.backends.sim.backend import SimBackend

        backend = SimBackend()
        backend.use_values(False)
        backend.begin_test()
        try:
            weight = torch.empty(256, 256, device="cuda")
            print(type(weight).__name__, backend.allocated())
        finally:
            backend.end_test()
        print("torch._dynamo" in sys.modules)
        """
    )
    assert out.split() == ["FakeTensor", str(256 * 256 * 4), "False"]


def test_decompositions_run_shape_only_without_dynamo_and_compile_after() -> None:
    # Elementwise ops with Python numbers run decompositions that torch wraps with
    # torch._disable_dynamo, which would import torch._dynamo at their first call.
    out = run_python(
        """
        import sys
        import torch
        from pytest_vram.backends.sim.backend import SimBackend

        backend = SimBackend()
        backend.use_values(False)
        backend.begin_test()
        try:
            x = torch.rand(2, 3, 8, 8, device="cuda")
            y = (0.299 * x[:, 0] + 0.587 * x[:, 1]).clamp(0.0, 1.0) / (x.sum() + 1e-8)
            print(type(y).__name__, tuple(y.shape))
        finally:
            backend.end_test()
        print("torch._dynamo" in sys.modules)
        compiled = torch.compile(lambda t: (0.5 * t).clamp(0.0, 1.0), backend="eager")
        print(compiled(torch.ones(3)).tolist())
        backend.begin_test()
        try:
            print(tuple((0.5 * torch.ones(4, device="cuda")).clamp(0.0, 1.0).shape))
        finally:
            backend.end_test()
        """
    )
    assert out.split("\n")[:4] == ["FakeTensor (2, 8, 8)", "False", "[0.5, 0.5, 0.5]", "(4,)"]


def test_dynamo_imported_later_is_whole_and_shares_the_config() -> None:
    out = run_python(
        """
        import sys
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from pytest_vram.backends.sim.dynamoconfig import load_config_alone

        print(load_config_alone())
        config = sys.modules["torch._dynamo.config"]
        mode = FakeTensorMode()
        print("torch._dynamo" in sys.modules)
        # Anything but the config imports the real package, through the placeholder (as
        # some of the Python kernels FakeTensorMode runs do).
        print(torch._dynamo.is_compiling())
        with mode:
            print(tuple(torch.ones(2, 3).sum(0).shape))
        import torch._dynamo

        print(torch._dynamo.config is config, type(torch._dynamo).__name__)
        compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
        print(compiled(torch.ones(3)).tolist())
        """
    )
    assert out.split("\n")[:6] == [
        "True",
        "False",
        "False",
        "(3,)",
        "True module",
        "[3.0, 3.0, 3.0]",
    ]


# Another interpreter that imports torch._dynamo (seconds); the one above runs by default.
@pytest.mark.slow
def test_nothing_is_done_once_dynamo_is_imported() -> None:
    out = run_python(
        """
        import sys
        import torch
        import torch._dynamo
        from pytest_vram.backends.sim.dynamoconfig import load_config_alone

        real = sys.modules["torch._dynamo"]
        print(load_config_alone(), torch._dynamo is real)
        """
    )
    assert out.split() == ["False", "True"]


# Another interpreter that imports torch._dynamo (seconds).
@pytest.mark.slow
def test_compile_after_the_config_alone_imports_dynamo_with_it() -> None:
    out = run_python(
        """
        import sys
        import torch
        from pytest_vram.backends.sim.dynamoconfig import load_config_alone

        print(load_config_alone())
        config = sys.modules["torch._dynamo.config"]
        import torch._dynamo

        print(torch._dynamo.config is config)
        print(any("dynamoconfig" in type(finder).__module__ for finder in sys.meta_path))
        compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
        print(compiled(torch.ones(3)).tolist())
        """
    )
    assert out.split("\n")[:4] == ["True", "True", "False", "[3.0, 3.0, 3.0]"]
