"""Shape-only and computing give the figures of a CUDA run, in training steps too.

Each case runs once shape-only (fake tensors) and once computing (real CPU tensors); both must
give the same figures, and where a CUDA kernel's allocations are known from PyTorch's source,
those figures.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from simulated_device import simulated as simulated_device
from torch import nn

from pytest_vram.backends.sim.backend import SimBackend
from pytest_vram.backends.sim.ops import likely_redraws

COMPUTING = [pytest.param(False, id="shape-only"), pytest.param(True, id="computing")]


def simulated(computing: bool) -> AbstractContextManager[SimBackend]:
    # As the plugin makes it: cuBLAS workspaces modelled, and a computing test counted by the
    # storage tracker, as a shape-only one is.
    return simulated_device(computing, workspaces=True)


def both_peaks(
    run: Callable[[Any], None], prepare: Callable[[], Any] = lambda: None
) -> tuple[int, int]:
    """The peak allocated bytes of ``run(prepare())`` shape-only and computing; ``prepare``
    runs before the simulated device starts (a model built on the host)."""
    figures = []
    for computing in (False, True):
        torch.manual_seed(0)
        prepared = prepare()
        with simulated(computing) as backend:
            run(prepared)
            figures.append(backend.peak_allocated())
    return figures[0], figures[1]


# -- the autograd engine's gradient sums ------------------------------------------------------


@pytest.mark.parametrize("computing", COMPUTING)
def test_a_gradient_from_two_places_is_summed_in_place(computing: bool) -> None:
    # InputBuffer::accumulate (torch/csrc/autograd/input_buffer.cpp) adds the second gradient
    # into the first in place when it holds the only reference: on CUDA, w's two gradients
    # are two buffers at the peak (with the loss's own, one 512-byte block), and one is left
    # as w.grad.
    with simulated(computing):
        w = nn.Parameter(torch.empty(256, 1024, device="cuda"))  # 1 MiB
        x = torch.randn(256, 1024, device="cuda")
        y = torch.randn(256, 1024, device="cuda")
        loss = (w * x + w * y).sum()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss.backward()
        assert torch.cuda.max_memory_allocated() - before == 512 + 2 * w.nbytes
        assert torch.cuda.memory_allocated() - before == w.nbytes  # w.grad


def _engine_sums(a: torch.Tensor, b: torch.Tensor) -> list[str]:
    """The adds torch's autograd engine runs for the graph below, on real CPU tensors, as its
    profiler records them: no dispatch mode, which would change what the engine decides."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.ones(1024, 256, requires_grad=True)
    h = x * 1
    loss = (h.t() * a).sum() + (h.t() * b).sum()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        loss.backward()
    return [event.name for event in profiler.events() if event.name.startswith("aten::add")]


@pytest.mark.parametrize("computing", COMPUTING)
def test_a_gradient_that_is_a_view_is_summed_out_of_place(computing: bool) -> None:
    # h's two gradients are views (the transposes of two products): each view's base holds
    # its storage too, so the engine adds them out of place, a third buffer, as torch does.
    # A linear layer's input gradient is such a view, and so is an einsum's.
    assert _engine_sums(torch.ones(256, 1024), torch.ones(256, 1024)) == ["aten::add"]
    with simulated(computing):
        x = torch.randn(1024, 256, device="cuda", requires_grad=True)  # 1 MiB
        a = torch.randn(256, 1024, device="cuda")
        b = torch.randn(256, 1024, device="cuda")
        h = x * 1
        loss = (h.t() * a).sum() + (h.t() * b).sum()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss.backward()
        assert torch.cuda.max_memory_allocated() - before == 512 + 3 * x.nbytes
        assert torch.cuda.memory_allocated() - before == x.nbytes  # x.grad


@pytest.mark.parametrize("computing", COMPUTING)
def test_a_gradient_sum_that_is_differentiated_stays_out_of_place(computing: bool) -> None:
    # With create_graph, grad mode is on in the backward, and the engine adds out of place.
    with simulated(computing):
        w = nn.Parameter(torch.empty(256, 1024, device="cuda"))
        x = torch.randn(256, 1024, device="cuda")
        loss = (w * x + w * x).sum()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        (grad,) = torch.autograd.grad(loss, w, create_graph=True)
        assert torch.cuda.max_memory_allocated() - before == 512 + 3 * w.nbytes
        del grad


FILLED_BY_FORMULAS = {
    "max": lambda x: x.max(dim=1).values,
    "sort": lambda x: x.sort(dim=1).values,
    "topk": lambda x: x.topk(8, dim=1).values,
    "cummax": lambda x: x.cummax(dim=1).values,
    "index": lambda x: x[torch.arange(0, 256, 2, device="cuda")],
    "gather": lambda x: x.gather(1, torch.zeros(256, 4, dtype=torch.long, device="cuda")),
    "index_select": lambda x: x.index_select(0, torch.arange(0, 256, 2, device="cuda")),
    "take": lambda x: x.take(torch.arange(0, 1024, device="cuda")),
}


@pytest.mark.parametrize("op", FILLED_BY_FORMULAS.values(), ids=FILLED_BY_FORMULAS.keys())
def test_a_derivative_that_fills_fresh_zeros_fills_them_in_place(op: Callable) -> None:
    # These formulas fill the zeros they make in place for plain tensors, as on CUDA, and
    # out of place, one more buffer the size of x, for fake tensors or under a dispatch mode.
    # The op counter runs them as a plain CUDA run does: shape-only and the tracker agree.
    peaks = {}
    for way, computing, capacity in [
        ("plain tensors (the op counter)", True, None),
        ("shape-only", False, None),
        ("computing through the tracker", True, "1TiB"),
    ]:
        backend = SimBackend(capacity=capacity, workspaces=True)
        backend.use_values(computing)
        backend.begin_test()
        try:
            x = torch.randn(256, 1024, device="cuda", requires_grad=True)  # 1 MiB
            y = op(x)
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            y.backward(torch.ones_like(y))
            peaks[way] = torch.cuda.max_memory_allocated() - before
        finally:
            backend.end_test()
    assert len(set(peaks.values())) == 1, peaks


@pytest.mark.parametrize("computing", COMPUTING)
def test_tied_weights_moved_to_the_device_stay_tied(computing: bool) -> None:
    model = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 1000, bias=False))
    model[1].weight = model[0].weight  # 256,000 B, once
    with simulated(computing):
        model.to("cuda")
        assert model[1].weight is model[0].weight
        assert torch.cuda.memory_allocated() == 256_000


# -- trunc_normal_ ------------------------------------------------------------------------------


def test_likely_redraws_is_the_median_of_a_real_run() -> None:
    outside = 1 - math.erf(3 / math.sqrt(2))  # beyond 3 standard deviations: 0.27%
    # A million values: one redraw leaves n * q**2 = 7.3 expected outside, two leave 0.02.
    assert likely_redraws(1 << 20, 0.0, 1.0, -3.0, 3.0) == 2
    assert (1 - outside**2) ** (1 << 20) < 0.5 <= (1 - outside**3) ** (1 << 20)
    assert likely_redraws(16, 0.0, 1.0, -3.0, 3.0) == 0  # 96% of 16 draws are all inside
    assert likely_redraws(1 << 20, 0.0, 0.02, -2.0, 2.0) == 0  # 100 standard deviations
    assert likely_redraws(0, 0.0, 1.0, -3.0, 3.0) == 0


@pytest.mark.parametrize(
    ("shape", "bounds"),
    [
        # (mean, std, a, b): what a real run redraws is near certain in each case.
        pytest.param((1024, 1024), (0.0, 0.02, -0.06, 0.06), id="3-std-1M-2-redraws"),
        pytest.param((4, 4), (0.0, 0.02, -0.06, 0.06), id="3-std-16-no-redraw"),
        pytest.param((100, 100), (0.0, 1.0, -0.1, 0.1), id="narrow-10k-1-redraw"),
    ],
)
def test_trunc_normal_runs_shape_only_with_the_computed_figures(
    shape: tuple[int, int], bounds: tuple[float, float, float, float]
) -> None:
    mean, std, a, b = bounds

    def run(_: None) -> None:
        weight = torch.empty(shape, device="cuda")
        nn.init.trunc_normal_(weight, mean=mean, std=std, a=a, b=b)

    shape_only, computed = both_peaks(run)
    assert shape_only == computed


def test_trunc_normal_imported_by_name_runs_shape_only() -> None:
    from torch.nn.init import trunc_normal_

    with simulated(False):
        weight = torch.empty(64, 64, device="cuda")
        assert trunc_normal_(weight, std=0.02, a=-0.06, b=0.06) is weight


# -- a Transformer LM's training step -----------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, tokens, 3, self.heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LM(nn.Module):
    """GPT-2-shaped, initialised as nanoGPT-style code does: truncated normals at 3 standard
    deviations (which read values), or kaiming, xavier and orthogonal initialisers."""

    def __init__(
        self,
        vocab: int = 10_000,
        width: int = 256,
        layers: int = 4,
        heads: int = 8,
        tied: bool = False,
        init: str = "trunc_normal",
    ) -> None:
        super().__init__()
        self.embed, self.positions = nn.Embedding(vocab, width), nn.Embedding(512, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        std = 0.02
        for name, parameter in self.named_parameters():
            if parameter.dim() < 2:
                continue
            if init == "trunc_normal":
                nn.init.trunc_normal_(parameter, std=std, a=-3 * std, b=3 * std)
            elif "qkv" in name:
                nn.init.xavier_uniform_(parameter)
            elif "proj" in name:
                nn.init.orthogonal_(parameter)
            elif "up" in name or "down" in name:
                nn.init.kaiming_normal_(parameter, nonlinearity="relu")
            else:
                nn.init.trunc_normal_(parameter, std=std, a=-3 * std, b=3 * std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.embed(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_step(tokens: int = 128, **config: Any) -> Callable[[LM | None], None]:
    """A training step after reset_peak_memory_stats(), of a model moved to the device from
    the host, or (given None) built on the device."""

    def run(on_host: LM | None) -> None:
        if on_host is None:
            with torch.device("cuda"):
                model = LM(**config)
        else:
            model = on_host.to("cuda")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, model.head.out_features, (8, tokens), device="cuda")
        torch.cuda.reset_peak_memory_stats()
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return run


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_small_lm_step_gives_one_figure(tied: bool) -> None:
    config = {"vocab": 2000, "width": 64, "layers": 2, "heads": 4, "tied": tied}
    shape_only, computed = both_peaks(lm_step(tokens=64), lambda: LM(**config))
    assert shape_only == computed


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("built", ["host", "device"])
def test_the_issue_lm_step_gives_one_figure(tied: bool, built: str) -> None:
    # 4 layers, d_model 256, a 10,000-token vocabulary.
    prepare = (lambda: LM(tied=tied)) if built == "host" else (lambda: None)
    shape_only, computed = both_peaks(lm_step(tied=tied), prepare)
    assert shape_only == computed


# -- the fidelity panel, exactly ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "bert", "t5", "llama", "mistral", "mixtral", "vit",
                                  "convnet"])  # fmt: skip
def test_the_panel_gives_one_figure_in_training_steps(name: str) -> None:
    pytest.importorskip("transformers")
    from test_sim_fidelity import PANEL, peaks, skip_if_the_experts_need_values

    if name == "mixtral":
        skip_if_the_experts_need_values()
    shape_only, computed = peaks(PANEL[name]())
    assert shape_only == computed


# -- a builder that initialises runs shape-only under the plugin -------------------------------

BUILDER = """
import math

import torch
import torch.nn.functional as F
from torch import nn


def build():
    layers = [nn.Embedding(4000, 128)]
    for _ in range(2):
        linear = nn.Linear(128, 128)
        layers.append(linear)
    head = nn.Linear(128, 4000, bias=False)
    std = 0.02
    nn.init.trunc_normal_(layers[0].weight, std=std, a=-3 * std, b=3 * std)
    nn.init.kaiming_uniform_(layers[1].weight, a=math.sqrt(5))
    nn.init.xavier_normal_(layers[2].weight)
    nn.init.orthogonal_(head.weight)
    return nn.Sequential(*layers, head)


def test_step(vram):
    with torch.device("cuda"):
        model = build()
    ids = torch.randint(0, 4000, (4, 64), device="cuda")
    F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
"""


def test_a_builder_with_initialisers_runs_shape_only(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_builder=BUILDER)
    result = pytester.runpytest(
        "--vram-report", "--vram-backend=sim", "--vram-json", "figures.json", "-p", "no:randomly"
    )
    result.assert_outcomes(passed=1)
    record = json.loads(Path(pytester.path, "figures.json").read_text())["tests"][0]
    assert record["peak_allocated"] > 2 * 4000 * 128 * 4  # embedding and head
    # Had the test needed values, values on demand would have computed it and said so here.
    needs_values = pytester.path / ".pytest_cache" / "v" / "vram" / "needs_values"
    assert not needs_values.exists()
