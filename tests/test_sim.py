"""The simulated device: CUDA code runs unchanged on fake tensors and reports allocator bytes.

The backend is driven as the plugin drives it, one test at a time between ``begin_test()`` and
``end_test()``, without pytest machinery.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from pytest_vram.backends import create_backend
from pytest_vram.backends.sim.backend import UNLIMITED_TOTAL, SimBackend
from pytest_vram.backends.sim.torchcuda import DEVICE_NAME

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "suites"))
from gpt import GPT, GPTConfig, training_step

MiB, GiB = 1 << 20, 1 << 30


@contextlib.contextmanager
def simulated(backend: SimBackend | None = None) -> Iterator[SimBackend]:
    """One test on the simulated device."""
    backend = backend or SimBackend()
    backend.begin_test()
    try:
        yield backend
    finally:
        backend.end_test()


@pytest.fixture
def sim() -> Iterator[SimBackend]:
    with simulated() as backend:
        yield backend


# -- the backend ------------------------------------------------------------------------------


def test_backend_identity() -> None:
    backend = create_backend("sim", sim_capacity=None)
    assert isinstance(backend, SimBackend)
    assert backend.name == "sim"
    assert backend.device_class == "sim"
    assert backend.device == torch.device("cuda", 0)  # vram.device, as the test's code sees it
    assert backend.total_memory() is None
    assert SimBackend(capacity="80GB").total_memory() == 80_000_000_000
    assert create_backend("sim", sim_capacity=1 << 30).total_memory() == 1 << 30
    assert backend.environment()["backend"] == "sim"


def test_ten_1000_byte_tensors_are_10240_bytes(sim: SimBackend) -> None:
    tensors = [torch.empty(1000, dtype=torch.uint8, device="cuda") for _ in range(10)]
    assert sim.allocated() == 10_240
    assert sim.peak_allocated() == 10_240
    assert sim.reserved() == 2 * MiB  # one small-pool segment
    del tensors
    assert sim.allocated() == 0
    assert sim.peak_allocated() == 10_240
    assert sim.reserved() == 2 * MiB  # cached until released
    sim.release_cache()
    assert sim.reserved() == 0


def test_nothing_is_computed_so_huge_tensors_are_free(sim: SimBackend) -> None:
    x = torch.empty(1 << 40, dtype=torch.uint8, device="cuda")  # one TiB
    assert sim.allocated() == 1 << 40
    del x
    assert sim.allocated() == 0


def test_views_share_storage_and_frees_are_seen(sim: SimBackend) -> None:
    x = torch.ones(1024, device="cuda")
    views = [x.view(32, 32), x[::2], x.view(32, 32).t()]
    assert sim.allocated() == 4096
    del x
    assert sim.allocated() == 4096
    del views
    assert sim.allocated() == 0


def test_peak_and_reset(sim: SimBackend) -> None:
    kept = torch.empty(1024, device="cuda")
    transient = torch.empty(4096, device="cuda")
    del transient
    assert sim.peak_allocated() == 4096 + 16384
    sim.reset_peak()
    assert sim.peak_allocated() == 4096
    assert sim.peak_reserved() == sim.reserved()
    del kept


# -- the virtual CUDA device ------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(256, device="cuda"),
        lambda: torch.zeros(256, device="cuda:0"),
        lambda: torch.zeros(256, device=torch.device("cuda")),
        lambda: torch.zeros(256, device=torch.device("cuda", 0)),
        lambda: torch.zeros(256, device=0),
        lambda: torch.randn(256, device="cuda"),
        lambda: torch.arange(256, dtype=torch.float32, device="cuda"),
        lambda: torch.full((256,), 3.0, device="cuda"),
        lambda: torch.tensor([0.5] * 256, device="cuda"),
        lambda: torch.empty(2).new_zeros(256, device="cuda"),
        lambda: torch.zeros_like(torch.empty(256), device="cuda"),
        lambda: torch.empty(256, pin_memory=True),
    ],
    ids=[
        "str",
        "str-index",
        "device",
        "device-index",
        "int",
        "randn",
        "arange",
        "full",
        "tensor",
        "new_zeros",
        "zeros_like",
        "pin_memory",
    ],
)
def test_factories_with_a_cuda_device(
    sim: SimBackend, make: Callable[[], torch.Tensor], request: pytest.FixtureRequest
) -> None:
    tensor = make()
    assert isinstance(tensor, FakeTensor)
    # Pinned memory is the host's; every other names the device.
    pinned = request.node.callspec.id == "pin_memory"
    assert tensor.device == (torch.device("cpu") if pinned else torch.device("cuda", 0))
    assert tensor.is_cuda is not pinned
    assert sim.peak_allocated() >= 1024


def test_device_context_manager_and_default_device(sim: SimBackend) -> None:
    with torch.device("cuda"):
        inside = torch.zeros(256)
        model = nn.Linear(16, 16)
    assert inside.device == torch.device("cuda", 0)
    assert isinstance(model.weight, FakeTensor) and model.weight.is_cuda
    torch.set_default_device("cuda")
    try:
        default = torch.ones(256)
    finally:
        torch.set_default_device(None)
    assert default.device == torch.device("cuda", 0)
    assert sim.allocated() == 1024 + 1024 + (16 * 16 + 16) * 4 + 512 - 64


def test_tensor_moves_to_cuda(sim: SimBackend) -> None:
    host = torch.ones(256)  # on the host, counted as the device's by default
    assert host.device == torch.device("cpu")
    x = host.to("cuda")  # a copy, which takes over the host tensor's count
    assert x is not host and x.is_cuda and host.device.type == "cpu"
    assert sim.allocated() == 1024
    assert x.to("cuda") is x  # already on the device, as on CUDA
    assert x.cuda() is x
    assert x.to(device="cuda:0") is x
    bf16 = x.to("cuda", torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.is_cuda
    assert x.to(torch.device("cuda"), non_blocking=True) is x
    assert x.pin_memory() is x
    assert x.is_pinned() is False
    back = x.cpu()  # a copy on the host, which the device does not count
    assert back.device == torch.device("cpu") and back.get_device() == -1
    assert sim.allocated() == 1024 + 512


def test_a_host_tensor_from_before_the_test_becomes_a_counted_copy() -> None:
    host = torch.ones(1024)  # real, made before the simulation
    with simulated() as sim:
        moved = host.cuda()
        also = host.to("cuda")
        assert isinstance(moved, FakeTensor)
        assert isinstance(also, FakeTensor)
        assert sim.allocated() == 2 * 4096
        del moved, also
        # Used directly, it is host memory: only what the op makes is counted.
        doubled = host * 2
        view = host.view(32, 32)
        assert sim.allocated() == 4096
        del doubled, view
    assert not isinstance(host, FakeTensor)


def test_module_to_cuda_keeps_parameters(sim: SimBackend) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    params = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert model.cuda() is model
    assert model.to("cuda") is model
    model.to("cuda", torch.bfloat16)
    assert list(model.parameters()) == params  # the same objects: the optimizer still has them
    assert all(p.dtype == torch.bfloat16 for p in params)
    model.float().half().to(torch.device("cuda:0"))
    assert all(p.dtype == torch.float16 for p in params)
    assert optimizer.param_groups[0]["params"][0] is params[0]
    sizes = (64 * 64 + 64 + 64 + 64) * 2
    assert sim.allocated() <= sizes + 4 * 512


def test_a_model_built_before_the_test_moves_with_cuda() -> None:
    model = nn.Linear(256, 256)  # real parameters, as a model built at import time
    with simulated() as sim:
        model.cuda()
        assert isinstance(model.weight, FakeTensor)
        assert isinstance(model.weight, nn.Parameter)
        assert model.weight.requires_grad
        assert sim.allocated() == 256 * 256 * 4 + 1024
        model(torch.randn(8, 256, device="cuda")).sum().backward()
        assert model.weight.grad is not None


def test_to_empty_on_cuda_from_meta(sim: SimBackend) -> None:
    with torch.device("meta"):
        model = nn.Linear(128, 128)
    assert sim.allocated() == 0
    model.to_empty(device="cuda")
    assert model.weight.device == torch.device("cuda", 0)
    assert sim.allocated() == 128 * 128 * 4 + 512


def test_torch_cuda_answers_from_the_simulated_device(sim: SimBackend) -> None:
    assert torch.cuda.is_available()
    assert torch.cuda.device_count() == 1
    assert torch.cuda.current_device() == 0
    assert torch.cuda.get_device_name() == DEVICE_NAME
    assert torch.cuda.get_device_capability() == (9, 0)
    assert torch.cuda.get_device_properties(0).total_memory == UNLIMITED_TOTAL
    assert torch.cuda.is_bf16_supported()
    torch.cuda.set_device(0)
    torch.cuda.synchronize()
    with torch.cuda.device(0):
        x = torch.empty(1000, dtype=torch.uint8, device="cuda")
    y = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
    assert torch.cuda.memory_allocated() == 1024 + 30 * MiB
    assert torch.cuda.memory.memory_allocated(0) == 1024 + 30 * MiB
    assert torch.cuda.memory_reserved() == 2 * MiB + 30 * MiB
    del y
    assert torch.cuda.memory_allocated() == 1024
    assert torch.cuda.max_memory_allocated() == 1024 + 30 * MiB
    assert torch.cuda.max_memory_reserved() == 32 * MiB
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == 2 * MiB
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == 1024
    assert torch.cuda.max_memory_reserved() == 2 * MiB
    free, total = torch.cuda.mem_get_info()
    assert (free, total) == (UNLIMITED_TOTAL - 2 * MiB, UNLIMITED_TOTAL)
    stats = torch.cuda.memory_stats()
    assert stats["allocated_bytes.all.current"] == 1024
    assert stats["reserved_bytes.all.peak"] == 2 * MiB
    assert stats["num_ooms"] == 0
    assert "simulated" in torch.cuda.memory_summary()
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator() == torch.device("cuda")
    del x


def test_streams_and_events_are_already_done(sim: SimBackend) -> None:
    stream = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    with torch.cuda.stream(stream):
        x = torch.ones(8, device="cuda")
    end.record()
    torch.cuda.synchronize()
    assert start.elapsed_time(end) == 0.0
    assert stream.query()
    del x


def _snapshot() -> dict[str, Any]:
    optimizer = torch.optim.Optimizer.__module__
    modules = {
        "torch": torch,
        "torch.cuda": torch.cuda,
        "torch.cuda.memory": torch.cuda.memory,
        "torch.accelerator": torch.accelerator,
        "optimizer": sys.modules[optimizer],
    }
    # Older torch releases (2.6 among them) have no torch.accelerator.memory.
    if hasattr(torch.accelerator, "memory"):
        modules["torch.accelerator.memory"] = torch.accelerator.memory
    seen = {
        f"{name}.{attr}": value
        for name, module in modules.items()
        for attr, value in vars(module).items()
    }
    for cls in (
        nn.Module,
        torch.utils._device.DeviceContext,
        torch.amp.autocast_mode.autocast,
        torch.amp.GradScaler,
        torch.Tensor,
    ):
        seen.update({f"{cls.__qualname__}.{attr}": value for attr, value in vars(cls).items()})
    return seen


def test_nothing_leaks_out_of_the_test() -> None:
    before = _snapshot()
    foreach_types = list(sys.modules[torch.optim.Optimizer.__module__]._foreach_supported_types)
    modes = torch._C._len_torch_function_stack()
    with simulated():
        assert torch.cuda.is_available()
        assert torch._C._len_torch_function_stack() == modes + 1
        torch.zeros(4, device="cuda")
    after = _snapshot()
    assert before.keys() == after.keys()
    changed = [name for name in before if before[name] is not after[name]]
    assert changed == []
    assert sys.modules[torch.optim.Optimizer.__module__]._foreach_supported_types == foreach_types
    assert torch._C._len_torch_function_stack() == modes
    assert not torch.cuda.is_available()
    assert torch.cuda.memory_allocated() == 0
    real = torch.ones(4) * 2
    assert not isinstance(real, FakeTensor)
    assert real.sum().item() == 8.0
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(4, device="cuda")


def test_a_cuda_default_device_does_not_outlive_the_test() -> None:
    with simulated():
        torch.set_default_device("cuda")
        assert torch.ones(2).device == torch.device("cuda", 0)
    assert torch.get_default_device() == torch.device("cpu")
    assert not isinstance(torch.ones(2), FakeTensor)


def test_end_test_restores_even_after_a_failure() -> None:
    backend = SimBackend()
    with pytest.raises(ZeroDivisionError), simulated(backend):
        torch.zeros(4, device="cuda")
        _ = 1 / 0
    assert not backend.active
    assert not torch.cuda.is_available()


# -- values -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "needs_values",
    [
        lambda x: x.sum().item(),
        lambda x: x.tolist(),
        lambda x: bool(x.sum() > 0),
        lambda x: torch.nonzero(x),
        lambda x: x[x > 0],
        lambda x: float(x.max()),
        lambda x: f"{x.sum():.4f}",
    ],
    ids=["item", "tolist", "branch", "nonzero", "mask", "float", "format"],
)
def test_a_test_that_needs_values_is_explained(
    sim: SimBackend, needs_values: Callable[[torch.Tensor], object]
) -> None:
    x = torch.randn(16, device="cuda")
    with pytest.raises(RuntimeError) as caught:
        needs_values(x)
    message = sim.explain_error(caught.value)
    assert message is not None
    assert "the simulated device computes no values" in message
    assert '@pytest.mark.vram_backend("cpu")' in message
    assert __file__ in message  # where the test asked for the value


def test_a_chained_needs_values_error_is_explained(sim: SimBackend) -> None:
    x = torch.randn(16, device="cuda")
    try:
        try:
            x.sum().item()
        except RuntimeError as exc:
            raise ValueError("while logging the loss") from exc
    except ValueError as wrapped:
        assert sim.explain_error(wrapped) is not None
    try:
        try:
            torch.nonzero(x)
        except RuntimeError:
            raise KeyError("handler failed") from None
    except KeyError as wrapped:
        assert sim.explain_error(wrapped) is not None  # still in __context__


def test_other_errors_are_left_alone(sim: SimBackend) -> None:
    assert sim.explain_error(ValueError("no")) is None
    assert sim.explain_error(torch.OutOfMemoryError("CUDA out of memory.")) is None
    with pytest.raises(RuntimeError) as caught:
        torch.ones(3, device="cuda") @ torch.ones(4, device="cuda")
    assert sim.explain_error(caught.value) is None


def test_constants_keep_their_values_and_printing_is_a_placeholder(sim: SimBackend) -> None:
    constant = torch.tensor(3.0, device="cuda")
    assert constant.item() == 3.0
    assert f"{constant:.1f}" == "3.0"
    x = torch.randn(2, 3, device="cuda")
    for text in (repr(x), str(x), f"{x}"):
        assert text.startswith("FakeTensor(...")
        assert "size=(2, 3)" in text


# torch's Tensor.__deepcopy__ reads a fake tensor's data pointer, and says so.
@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_deepcopy_of_a_model(sim: SimBackend) -> None:

    model = nn.Linear(64, 64).cuda()
    before = sim.allocated()
    clone = copy.deepcopy(model)
    assert isinstance(clone.weight, FakeTensor)
    assert clone.weight is not model.weight
    assert sim.allocated() == 2 * before


# -- capacity ---------------------------------------------------------------------------------


def test_capacity_raises_cuda_out_of_memory_in_the_test() -> None:
    backend = SimBackend(capacity="1GiB")
    with simulated(backend):
        kept = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
        handled = False
        try:
            torch.empty(768 * MiB, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError as exc:
            handled = True
            message = str(exc)
        assert handled
        assert message.startswith("CUDA out of memory. Tried to allocate 768.00 MiB.")
        # PyTorch prints sizes up to 1 GiB in MiB.
        assert "GPU 0 has a total capacity of 1024.00 MiB of which 512.00 MiB is free" in message
        assert backend.allocated() == 512 * MiB  # the failed allocation left nothing behind
        smaller = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
        assert backend.counters()["num_ooms"] == 1
        assert torch.cuda.get_device_properties(0).total_memory == GiB
        assert torch.cuda.mem_get_info() == (256 * MiB, GiB)
        del kept, smaller
    assert backend.total_memory() == GiB


def test_out_of_memory_in_backward_reaches_the_test() -> None:
    backend = SimBackend(capacity=24 * MiB)
    with simulated(backend):
        weight = torch.randn(2048, 2048, device="cuda", requires_grad=True)  # 16 MiB
        x = torch.randn(64, 2048, device="cuda")  # 512 KiB, in a 2 MiB segment
        loss = (x @ weight).sum()
        assert backend.reserved() == 18 * MiB
        with pytest.raises(torch.cuda.OutOfMemoryError, match=r"Tried to allocate 16\.00 MiB"):
            loss.backward()  # the weight's gradient needs 16 MiB more


def test_cached_segments_go_back_before_out_of_memory() -> None:
    backend = SimBackend(capacity=100 * MiB)
    with simulated(backend):
        cached = torch.empty(60 * MiB, dtype=torch.uint8, device="cuda")
        del cached
        assert backend.reserved() == 60 * MiB
        bigger = torch.empty(70 * MiB, dtype=torch.uint8, device="cuda")
        assert backend.reserved() == 70 * MiB
        assert backend.counters() == {
            "num_ooms": 0,
            "num_alloc_retries": 1,
            "inactive_split_bytes": 0,
        }
        del bigger


# -- across tests -----------------------------------------------------------------------------


def test_a_module_scoped_fixture_lives_on_across_tests() -> None:
    backend = SimBackend()
    with simulated(backend):
        model = nn.Linear(256, 256).cuda()  # made in one test's setup
    with simulated(backend):
        assert backend.allocated() == 256 * 256 * 4 + 1024
        out = model(torch.randn(4, 256, device="cuda"))
        out.sum().backward()
        assert model.weight.grad is not None
    del model, out
    assert backend.allocated() == 0


# -- training ---------------------------------------------------------------------------------


def test_optimizers_default_to_their_cuda_implementation(sim: SimBackend) -> None:
    model = nn.Linear(1024, 1024, bias=False).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    before = sim.allocated()
    sim.reset_peak()
    optimizer.step()
    weight = 1024 * 1024 * 4
    # The two moments, plus foreach's temporary copy of the second (the single-tensor
    # implementation, the CPU default, would need less): the same peak as on CUDA.
    assert sim.peak_allocated() - before >= 3 * weight
    assert int(optimizer.state[model.weight]["step"].item()) == 1  # a constant torch reads


def test_autocast_follows_cuda_op_lists(sim: SimBackend) -> None:
    linear = nn.Linear(64, 64).cuda()
    x = torch.randn(8, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled("cuda")
        assert torch.get_autocast_dtype("cuda") == torch.bfloat16
        y = linear(x)
        assert y.dtype == torch.bfloat16
        assert (y @ y.t()).dtype == torch.bfloat16
        assert torch.einsum("ij,kj->ik", x, x).dtype == torch.bfloat16
        for fp32 in (
            y.softmax(-1),
            F.softmax(y, -1),
            F.log_softmax(y, -1),
            y.sum(),
            torch.exp(y),
            y**2,
            F.layer_norm(y, (64,)),
            F.mse_loss(y, y),
        ):
            assert fp32.dtype == torch.float32
        assert (y + y).dtype == torch.bfloat16  # not on CUDA's lists: no cast
        with torch.autocast("cuda", enabled=False):
            assert linear(x).dtype == torch.float32
    with torch.autocast("cuda"):
        assert linear(x).dtype == torch.float16  # CUDA's default low precision
    with pytest.warns(FutureWarning):
        legacy = torch.cuda.amp.autocast(dtype=torch.bfloat16)
    with legacy:
        assert linear(x).dtype == torch.bfloat16
    assert linear(x).dtype == torch.float32


def test_grad_scaler_steps(sim: SimBackend) -> None:
    model = nn.Linear(64, 64).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(torch.randn(8, 64, device="cuda")).float().sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def test_activation_checkpointing_runs_and_saves(sim: SimBackend) -> None:
    config = GPTConfig(num_layers=4)
    model = GPT(config).cuda()
    tokens = torch.randint(0, config.vocab_size, (4, 128), device="cuda")
    held = {}
    for checkpointing in (False, True):
        model.checkpointing = checkpointing
        start = sim.allocated()
        loss = model.loss(tokens, tokens)
        held[checkpointing] = sim.allocated() - start
        loss.backward()
        model.zero_grad(set_to_none=True)
        del loss
    assert held[True] < 0.5 * held[False]


def _agreement(run: Callable[[str, Callable[[], None]], None]) -> tuple[int, int]:
    """The peak of ``run`` on the simulated device, and as MemTracker sees it."""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    with simulated() as sim:
        run("cuda", lambda: None)
        sim_peak = sim.peak_allocated()
    with FakeTensorMode():
        tracker = mem_tracker.MemTracker()
        with tracker:
            run("cpu", tracker.reset_mod_stats)
        mem_peak = max(device["Total"] for device in tracker.get_tracker_snapshot("peak").values())
    return sim_peak, mem_peak


def _train(
    make_model: Callable[[], nn.Module], step: Callable[[nn.Module, str], None]
) -> Callable[[str, Callable[[], None]], None]:
    """Two training steps of ``make_model()`` on a device, with a hook between the steps."""

    def run(device: str, between_steps: Callable[[], None]) -> None:
        with torch.device(device):  # on the simulated device, the virtual cuda
            model = make_model()
        # Explicit foreach: the same optimizer code on both sides, whatever the device.
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        for i in range(2):
            if i:
                between_steps()
            step(model, device)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return run


@pytest.mark.slow
def test_transformers_decoder_agrees_with_memtracker() -> None:
    # Llama: RMSNorm, a SwiGLU MLP, grouped-query attention through SDPA, built from a config.
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )

    def step(model: nn.Module, device: str) -> None:
        ids = torch.randint(0, config.vocab_size, (2, 128), device=device)
        model(input_ids=ids, labels=ids).loss.backward()

    sim_peak, mem_peak = _agreement(_train(lambda: transformers.LlamaForCausalLM(config), step))
    assert sim_peak > 30 * MiB
    assert abs(sim_peak - mem_peak) <= 0.02 * mem_peak


def test_gpt_agrees_with_memtracker() -> None:
    config = GPTConfig(num_layers=2)

    def step(model: nn.Module, device: str) -> None:
        tokens = torch.randint(0, config.vocab_size, (2, 129), device=device)
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()

    sim_peak, mem_peak = _agreement(_train(lambda: GPT(config), step))
    assert sim_peak > 20 * MiB
    assert abs(sim_peak - mem_peak) <= 0.02 * mem_peak


def test_gpt_training_step_peak_is_the_sum_of_its_parts(sim: SimBackend) -> None:
    config = GPTConfig()
    model = GPT(config).cuda()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (2, 129), device="cuda")
    sim.reset_peak()
    training_step(model, optimizer, tokens[:, :-1], tokens[:, 1:])
    # fp32 weights, gradients, two moments and foreach's temporary: 20 bytes a parameter.
    assert sim.peak_allocated() >= 20 * params
    assert sim.allocated() >= 12 * params


# -- computing: real values, the same figures --------------------------------------------------


@contextlib.contextmanager
def computing(backend: SimBackend | None = None) -> Iterator[SimBackend]:
    """One test on the simulated device, computing its values on the CPU."""
    backend = backend or SimBackend()
    if not backend.computing:
        backend.use_values(True)
    with simulated(backend):
        yield backend


def _two_gpt_steps(backend: SimBackend) -> tuple[int, int, int, int]:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(GPTConfig(num_layers=2))
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 1024, (2, 129), device="cuda")
    backend.reset_peak()
    for _ in range(2):
        training_step(model, optimizer, tokens[:, :-1], tokens[:, 1:])
    figures = (
        backend.allocated(),
        backend.peak_allocated(),
        backend.reserved() or 0,
        backend.peak_reserved() or 0,
    )
    del model, optimizer, tokens
    assert backend.allocated() == 0
    return figures


def test_a_training_step_has_the_same_figures_shape_only_and_computing() -> None:
    with simulated() as backend:
        shape_only = _two_gpt_steps(backend)
    with computing() as backend:
        computed = _two_gpt_steps(backend)
    assert computed == shape_only
    assert shape_only[1] > 30 * MiB


def test_computing_gives_real_values_on_the_virtual_device() -> None:
    with computing() as backend:
        model = nn.Linear(16, 4).cuda()
        x = torch.ones(2, 16, device="cuda")
        loss = model(x).sum()
        loss.backward()
        assert not isinstance(loss, FakeTensor)
        assert loss.item() == pytest.approx(float(model(x).sum()))
        assert torch.cuda.is_available() and torch.cuda.memory_allocated() == backend.allocated()
        assert x.cpu().numpy().tolist() == [[1.0] * 16] * 2
        assert f"{loss:.2f}" == f"{loss.item():.2f}"
    assert not torch.cuda.is_available()


def test_computing_moves_a_host_model_with_its_parameters() -> None:
    model = nn.Linear(256, 256)  # made before the test: host memory
    weight = model.weight
    with computing() as backend:
        assert backend.allocated() == 0
        model.cuda()
        # PyTorch's own Module._apply: the parameter object stays, its data is a counted copy.
        assert model.weight is weight
        assert backend.allocated() == 256 * 256 * 4 + 1024
        assert backend.storage_bytes(model.weight) == 256 * 256 * 4
        assert backend.storage_bytes(torch.empty(0)) == 0


@pytest.mark.parametrize("use_values", [False, True])
def test_cuda_random_state_is_the_cpu_generators(use_values: bool) -> None:
    backend = SimBackend()
    backend.use_values(use_values)
    with simulated(backend):
        torch.cuda.manual_seed_all(7)
        state = torch.cuda.get_rng_state()
        first = torch.rand(4, device="cuda")
        with torch.random.fork_rng():
            torch.rand(100, device="cuda")
        torch.cuda.set_rng_state(state)
        again = torch.rand(4, device="cuda")
        assert torch.cuda.initial_seed() == 7
        assert len(torch.cuda.get_rng_state_all()) == 1
        if use_values:
            assert torch.equal(first, again)


@pytest.mark.parametrize("use_values", [False, True])
def test_torch_compile_runs_eagerly_with_the_eager_figures(use_values: bool) -> None:
    backend = SimBackend()
    backend.use_values(use_values)
    with simulated(backend):
        compiled = torch.compile(lambda x: (x.sin() * 2).exp())
        x = torch.ones(1024, device="cuda")
        out = compiled(x)
        # Eager, the two temporaries are seen: what was allocated peaks at four tensors.
        assert backend.peak_allocated() == 3 * 4096
        if use_values:
            assert torch.allclose(out, (x.sin() * 2).exp())
        del out


def test_computing_beyond_the_host_memory_fails_with_the_way_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pytest_vram.backends.sim import hostmemory

    monkeypatch.setattr(hostmemory, "available_host_memory", lambda: 1 * GiB)
    monkeypatch.setattr(hostmemory, "_data_size", lambda: None)  # the tracker's check alone
    backend = SimBackend()
    backend.use_values(True, reason="assert torch.isfinite(loss)")
    with computing(backend):
        kept = [torch.empty(100 * MiB, dtype=torch.uint8) for _ in range(4)]
        with pytest.raises(torch.OutOfMemoryError) as raised:
            kept += [torch.empty(600 * MiB, dtype=torch.uint8)]
        assert backend.allocated() == 400 * MiB
        del kept
    message = str(raised.value)
    assert "computes this test's values on the CPU" in message
    assert "1000.00 MiB of tensors would be live, with 1.00 GiB available" in message
    assert "assert torch.isfinite(loss)" in message
    assert 'vram_backend("cuda")' in message and "shape-only" in message


def test_computing_on_a_guess_holds_its_budget_at_most(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_vram.backends.sim import hostmemory

    monkeypatch.setattr(hostmemory, "GUESS_BUDGET", 64 * MiB)
    backend = SimBackend()
    backend.use_values(True, guess=True)
    with computing(backend):
        kept = torch.empty(60 * MiB, dtype=torch.uint8, device="cuda")
        with pytest.raises(torch.OutOfMemoryError) as raised:
            torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        assert backend.allocated() == 60 * MiB
        del kept
    message = str(raised.value)
    assert "computes this test's values on the CPU on a guess, which may hold 64.00 MiB" in message
    assert backend.explain_error(raised.value) is None  # the message says it all
    # Not on a guess, the host's memory is the limit.
    backend.use_values(True)
    with computing(backend):
        torch.empty(68 * MiB, dtype=torch.uint8, device="cuda")


def test_a_kernel_cannot_take_more_than_the_host_has() -> None:
    import resource

    from pytest_vram.backends.sim.hostmemory import available_host_memory

    before = resource.getrlimit(resource.RLIMIT_DATA)
    available = available_host_memory()
    assert available is not None
    backend = SimBackend()
    with computing(backend):
        with pytest.raises(RuntimeError) as raised:
            torch.zeros(available * 2, dtype=torch.uint8)  # refused before a page is touched
        message = backend.explain_error(raised.value) or str(raised.value)
        assert "this host has not the memory for it" in message
    assert resource.getrlimit(resource.RLIMIT_DATA) == before


def test_the_mode_changes_between_tests_only() -> None:
    backend = SimBackend()
    with simulated(backend), pytest.raises(RuntimeError):
        backend.use_values(True)
    backend.use_values(True)
    with simulated(backend):
        assert not isinstance(torch.ones(1), FakeTensor)
    backend.use_values(False)
    with simulated(backend):
        assert isinstance(torch.ones(1), FakeTensor)
