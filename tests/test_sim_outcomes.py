"""Causes of a test that passes plain and failed on the simulated device, each reproduced with
torch alone: a traced module checked against other inputs, a scripted function that calls a
factory, lazy modules, and torch.compile under the counting dispatch mode."""

from __future__ import annotations

import contextlib
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from pytest_vram.backends.sim.backend import SimBackend
from pytest_vram.backends.tracker import StorageTracker


class _Listener:
    """A listener of the tracker, as attribution's: the computing test counts in Python."""

    def allocated(self, tag: int, size: int, handle: Any) -> None:
        pass

    def resized(self, tag: int | None, old: int, new: int, handle: Any) -> None:
        pass

    def freed(self, tag: int | None, size: int, handle: Any) -> None:
        pass


def _dispatch_modes() -> list[Any]:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


def _running(how: str, cuda_shown: bool = True) -> Iterator[SimBackend]:
    backend = SimBackend()
    backend.use_values(how != "shape-only")
    backend.show_cuda(cuda_shown)
    listener = _Listener()
    if how == "dispatch mode":
        backend.tracker.add_listener(listener)
    backend.begin_test()
    try:
        if how == "dispatch mode":
            assert backend.tracker.mode in _dispatch_modes()
        yield backend
    finally:
        backend.end_test()
        backend.tracker.remove_listener(listener)


@pytest.fixture(params=["op counter", "dispatch mode"])
def computing(request: pytest.FixtureRequest) -> Iterator[SimBackend]:
    """A computing test on the simulated device, counted by the op counter or, as while
    attribution listens, by the tracker's dispatch mode."""
    yield from _running(request.param)


@pytest.fixture(params=["shape-only", "op counter", "dispatch mode"])
def simulated(request: pytest.FixtureRequest) -> Iterator[SimBackend]:
    """A test on the simulated device, shape-only or computing (as :func:`computing`)."""
    yield from _running(request.param)


class _Twice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2.0).view(-1)


def test_a_traced_module_checked_against_other_inputs_runs_under_the_counting_mode() -> None:
    # Torch hands a Python dispatch mode the graph's constant 2.0 as a float.
    tracker = StorageTracker(counts=lambda tensor: True)
    with tracker.mode:
        x = torch.ones(2, 3)
        traced = torch.jit.trace(_Twice(), x, check_inputs=[(torch.ones(4, 3),)])
        out = traced(x)
    assert out.tolist() == [2.0] * 6
    assert tracker.peak > 0


def test_a_traced_module_checked_against_other_inputs_computes(computing: SimBackend) -> None:
    x = torch.ones(2, 3, device="cuda")
    traced = torch.jit.trace(_Twice(), x, check_inputs=[(torch.ones(4, 3, device="cuda"),)])
    assert traced(x).sum().item() == 12.0
    assert computing.peak_allocated() > 0


_ARANGE = torch.arange


def _numbers(n: int) -> torch.Tensor:
    return torch.arange(n) * 2


@pytest.mark.parametrize("cuda_shown", [True, False], ids=["sees CUDA", "gated only"])
@pytest.mark.parametrize("how", ["op counter", "dispatch mode"])
def test_a_function_that_calls_a_factory_is_scripted_while_computing(
    how: str, cuda_shown: bool
) -> None:
    with contextlib.contextmanager(_running)(how, cuda_shown):
        # Computing, a test that does not see CUDA has devices remapped below Python, where
        # torch.arange is the simulated device's wrapper, which TorchScript cannot compile: it
        # is known to TorchScript as aten::arange. One that sees CUDA runs the function mode.
        assert (torch.arange is not _ARANGE) is not cuda_shown
        scripted = torch.jit.script(_numbers)
        assert scripted(3).tolist() == [0, 2, 4]


def test_a_lazy_module_moves_and_initialises_while_computing(computing: SimBackend) -> None:
    model = nn.LazyLinear(4).to("cuda")
    out = model(torch.ones(2, 3, device="cuda"))
    assert out.shape == (2, 4)
    assert model.weight.shape == (4, 3)
    assert computing.counted(model.weight)


def test_an_uninitialised_parameter_has_no_tag() -> None:
    tracker = StorageTracker(counts=lambda tensor: True, adopt_unseen=True)
    tracker.add_listener(_Listener())
    assert tracker.tag_of(nn.LazyLinear(4).weight) is None
    assert not tracker.counted(nn.LazyLinear(4).weight)


def _sine(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() * 2).exp()


def test_dynamo_compiles_under_the_counting_mode() -> None:
    tracker = StorageTracker(counts=lambda tensor: True)
    x = torch.ones(1024)
    with tracker.mode:
        explained = torch._dynamo.explain(_sine)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def test_a_function_compiled_in_a_test_is_one_graph_and_counted(simulated: SimBackend) -> None:
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(_sine, backend=counter)
    x = torch.ones(1024, device="cuda")
    simulated.reset_peak()
    start = simulated.allocated()
    out = compiled(x)
    assert counter.frame_count == 1
    # Its ops run through the dispatcher, seen as eager code is: two tensors at once beside x.
    assert simulated.peak_allocated() - start == 2 * 4096
    if simulated.computing:
        assert torch.allclose(out, _sine(x))
    explained = torch._dynamo.explain(_sine)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def test_inductor_runs_the_graph_op_by_op(simulated: SimBackend) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(_sine)  # the default backend, Inductor
    x = torch.ones(1024, device="cuda")
    simulated.reset_peak()
    start = simulated.allocated()
    out = compiled(x)
    assert simulated.peak_allocated() - start == 2 * 4096
    if simulated.computing:
        assert torch.allclose(out, _sine(x))


def test_a_compiled_step_with_a_graph_break_leaves_the_modes_uncompiled(
    simulated: SimBackend,
) -> None:
    from pytest_vram.backends.sim.fakemode import SimFakeTensorMode
    from pytest_vram.backends.tracker import StorageTracker as Tracker

    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).cuda()

    @torch.compile
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    # backward() runs the modes' handlers from inside the compiled call's eager part.
    step(torch.ones(4, 8, device="cuda")).backward()
    assert all(p.grad is not None for p in model.parameters())
    cache_entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    handlers = (SimFakeTensorMode.__torch_dispatch__, Tracker(bool).mode.__torch_dispatch__)
    assert all(cache_entries(handler.__code__) == [] for handler in handlers)


def test_compiling_leaves_cudas_autocast_dtype_as_it_was() -> None:
    # Dynamo reads CUDA's autocast state before it compiles and sets it back after.
    before = torch.get_autocast_dtype("cuda")
    for computing in (False, True):
        backend = SimBackend()
        backend.use_values(computing)
        backend.begin_test()
        try:
            torch._dynamo.reset()
            torch.compile(_sine)(torch.ones(8, device="cuda"))
            with torch.autocast("cuda"):
                out = nn.Linear(8, 8).cuda()(torch.ones(2, 8, device="cuda"))
            assert out.dtype == torch.float16  # CUDA's default, not the CPU's bfloat16
        finally:
            backend.end_test()
        assert torch.get_autocast_dtype("cuda") == before


@contextlib.contextmanager
def _broken_down(modules: bool) -> Iterator[tuple[SimBackend, dict[str, Any]]]:
    """A shape-only test whose peak is broken down, as attribution does; the breakdown's
    result is in the dict once the block ends."""
    from pytest_vram.attribution.breakdown import PeakBreakdown

    backend = SimBackend()
    backend.begin_test()
    breakdown = PeakBreakdown(backend.tracker, modules=modules)
    breakdown.start()
    found: dict[str, Any] = {}
    try:
        torch._dynamo.reset()
        yield backend, found
        found.update(breakdown.result(backend.peak_allocated()))
    finally:
        breakdown.stop()
        backend.end_test()


def test_a_model_that_runs_only_compiled_has_its_parameters_categorised() -> None:
    with _broken_down(modules=False) as (backend, result):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
        model.compile()
        model(torch.ones(4, 64, device="cuda")).sum().backward()
    params = sum(backend.storage_bytes(p) or 0 for p in model.parameters())
    assert result["categories"]["parameters"] == params
    assert result["categories"]["gradients"] == params


def test_a_compiled_module_under_the_breakdowns_hooks_warns_of_no_global_hook() -> None:
    with _broken_down(modules=True) as (backend, result):
        model = torch.compile(nn.Linear(4, 4).cuda(), backend="eager")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the breakdown's own global hooks: no warning
            model(torch.ones(2, 4, device="cuda"))
        # A global hook of the test's own is one that fires an extra time: torch says so.
        handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
        try:
            with pytest.warns(UserWarning, match="global hooks"):
                model(torch.ones(2, 4, device="cuda"))
        finally:
            handle.remove()
    assert result["categories"]["parameters"] == sum(
        backend.storage_bytes(p) or 0 for p in model.parameters()
    )
    assert not nn.modules.module._has_any_global_hook()


# Each cause in a test of its own, as a suite has them: every test passes under plain pytest.
# The compiled ones read no values, so that they run shape-only in a file of their own.
COMPILED = """
import pytest
import torch
from torch import nn

OPT_IN = {opt_in}


def measured(test):
    return pytest.mark.max_vram("1GB")(test) if OPT_IN else test


def sine(x):
    return (x.sin() * 2).exp()


@measured
def test_compiled_function():
    explained = torch._dynamo.explain(sine)(torch.ones(8))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


@measured
def test_compiled_module():
    from torch._dynamo.testing import CompileCounter

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    counter = CompileCounter()
    torch.compile(model, backend=counter)(torch.ones(4, 8))
    explained = torch._dynamo.explain(model)(torch.ones(4, 8))
    assert (counter.frame_count, explained.graph_count, explained.graph_break_count) == (1, 1, 0)
"""

SUITE = """
import pytest
import torch
from torch import nn

OPT_IN = {opt_in}


def measured(test):
    return pytest.mark.max_vram("1GB")(test) if OPT_IN else test


class Twice(nn.Module):
    def forward(self, x):
        return (x * 2.0).view(-1)


@measured
def test_trace_check_inputs():
    x = torch.ones(2, 3)
    traced = torch.jit.trace(Twice(), x, check_inputs=[(torch.ones(4, 3),)])
    assert traced(x).sum().item() == 12.0


def numbers(n: int) -> torch.Tensor:
    return torch.arange(n) * 2


@measured
def test_script_a_factory():
    assert torch.jit.script(numbers)(3).tolist() == [0, 2, 4]


@measured
def test_lazy_module():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.LazyLinear(4).to(device)
    assert model(torch.ones(2, 3, device=device)).shape == (2, 4)
"""


def _outcomes(pytester: pytest.Pytester, *options: str) -> dict[str, str]:
    junit = pytester.path / "outcomes.xml"
    run = pytester.runpytest_subprocess(f"--junitxml={junit}", "-p", "no:randomly", *options)
    # Each test's outcome is the simulated device's own, not the backstop's plain run.
    assert "its memory was not simulated" not in run.stdout.str()
    assert "passes without the simulated device" not in run.stdout.str()
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        found[case.attrib["name"]] = "failed" if failed else "passed"
    return found


@pytest.mark.slow
@pytest.mark.parametrize(
    "opt_in, options",
    [(True, ()), (False, ("--vram-report", "--vram-gate=all"))],
    ids=["opted in", "every test gated"],
)
def test_each_cause_keeps_its_outcome_on_the_simulated_device(
    pytester: pytest.Pytester, opt_in: bool, options: tuple[str, ...]
) -> None:
    pytester.makepyfile(
        test_causes=SUITE.format(opt_in=opt_in), test_compiled=COMPILED.format(opt_in=opt_in)
    )
    plain = _outcomes(pytester, "-p", "no:vram")
    assert set(plain.values()) == {"passed"} and len(plain) == 5
    assert _outcomes(pytester, "--vram-backend=sim", *options) == plain
    # Shape-only, with no rerun that computes: Dynamo compiles on fake tensors too.
    compiled = _outcomes(pytester, "test_compiled.py", "--vram-backend=sim",
                         "--vram-sim-compute=never", *options)  # fmt: skip
    assert compiled == {"test_compiled_function": "passed", "test_compiled_module": "passed"}
