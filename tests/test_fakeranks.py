"""Simulated ranks: ``vram_world_size(n)`` runs a test as rank 0 of a fake process group.

Most tests drive the pieces as the plugin does, without pytest machinery: a
:class:`SimulatedRanks` started around one test on a :class:`SimBackend`; the last ones run
pytest through pytester.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import device_mesh
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from pytest_vram import vram_world_size
from pytest_vram.backends.sim.backend import SimBackend
from pytest_vram.backends.sim.ranks import skip_reason
from pytest_vram.estimate import estimate
from pytest_vram.marks import MARKER_HELP, MarkerError, read_marks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "suites"))
from gpt import GPT, GPTConfig, parameter_count
from simulated_ranks import ranks

MiB = 1 << 20
HIDDEN = 1024


def linears(count: int = 4, width: int = HIDDEN) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(width, width, device="cuda") for _ in range(count)])


def fsdp(model: nn.Module, mesh: device_mesh.DeviceMesh, **options: object) -> nn.Module:
    for layer in model.children():
        fully_shard(layer, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def cpu_flash_attention_has_gqa() -> bool:
    """Whether torch's CPU flash attention takes grouped-query attention, as a GPU's does: the
    simulated device's attention runs on the CPU kernels."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    query, key = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)
    with warnings.catch_warnings(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        warnings.simplefilter("ignore")
        try:
            nn.functional.scaled_dot_product_attention(query, key, key, enable_gqa=True)
        except RuntimeError:
            return False
    return True


# The small GPT's attention is grouped-query: where the simulated device runs it on the math
# kernel, its attention matrices leave the allocator other blocks to round the states into.
needs_gqa_flash_attention = pytest.mark.skipif(
    not cpu_flash_attention_has_gqa(),
    reason=f"torch {torch.__version__}'s CPU flash attention has no grouped-query attention "
    "(enable_gqa): the simulated device runs it on the math kernel, which a GPU would not",
)


# -- the process group and what is patched ----------------------------------------------------


def test_the_test_runs_as_rank_0_of_n_and_the_group_goes_afterwards() -> None:
    init = device_mesh.DeviceMesh.__init__
    # torch's MemTracker, run by another test, leaves its own copy of the method behind.
    resize = vars(torch.UntypedStorage).get("resize_")
    with ranks(4):
        assert dist.is_initialized()
        assert (dist.get_rank(), dist.get_world_size()) == (0, 4)
        assert device_mesh.DeviceMesh.__init__ is not init
        assert vars(torch.UntypedStorage).get("resize_") not in (None, resize)
    assert not dist.is_initialized()
    assert device_mesh.DeviceMesh.__init__ is init
    assert vars(torch.UntypedStorage).get("resize_") is resize


def test_device_meshes_of_the_virtual_cuda_device_work_under_the_fake_mode() -> None:
    with ranks(8):
        mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))
        assert mesh.shape == (2, 4)
        assert mesh["tp"].size() == 4
        assert mesh["dp"].get_local_rank() == 0
        assert tuple(mesh.get_coordinate()) == (0, 0)
        # Inside, a cpu mesh, as the simulated device's tensors are cpu tensors; the code sees
        # the cuda mesh it asked for, submeshes included, whose tensors are on cuda:0.
        assert mesh._device_type == "cpu"
        assert mesh.device_type == mesh["tp"].device_type == "cuda"
        flat = mesh._flatten("all")
        assert flat.size() == 8 and flat.device_type == "cuda"
        assert init_device_mesh("cpu", (8,)).device_type == "cpu"


def test_a_mesh_tensor_made_on_the_simulated_device_is_refused_with_a_reason() -> None:
    with ranks(2), pytest.raises(ValueError, match="pass the ranks as a list"):
        device_mesh.DeviceMesh("cuda", torch.arange(2))
    with ranks(2):
        assert device_mesh.DeviceMesh("cuda", [0, 1]).size() == 2


def test_cpu_streams_record_and_wait_for_events_as_fsdp2_asks_and_are_put_back() -> None:
    stream_class, default = torch.cpu.Stream, torch.cpu.current_stream()
    with ranks(2):
        stream = torch.cpu.Stream()
        with torch.cpu.stream(stream):
            stream.wait_event(stream.record_event())
        current = torch.cpu.current_stream()
        current.wait_event(current.record_event())
        current.wait_stream(stream)
    assert torch.cpu.Stream is stream_class
    assert torch.cpu.current_stream() is default


def test_collectives_and_point_to_point_messages_complete_at_once_and_allocate_nothing() -> None:
    with ranks(4) as sim:
        tensor = torch.empty(MiB, device="cuda")
        gathered = torch.empty(4 * MiB, device="cuda")
        # Torch 2.6 keeps the last barrier's one-byte tensor until the next barrier, as on a GPU.
        dist.barrier()
        before = sim.allocated()
        dist.broadcast(tensor, 0)
        dist.all_reduce(tensor)
        # Newer names first: torch 2.13 deprecates the older ones.
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(gathered, tensor)
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(tensor, gathered)
        dist.send(tensor, 1)
        assert dist.recv(tensor, 1) == 1
        dist.isend(tensor, 2).wait()
        dist.barrier()
        assert sim.allocated() == before
        assert sim.counted(tensor) and tensor.shape == (MiB,)


def test_a_group_made_before_the_test_is_refused() -> None:
    from pytest_vram.backends.sim.ranks import ranks_for

    backend = SimBackend()
    with ranks(2), pytest.raises(pytest.fail.Exception, match="already initialised"):
        ranks_for("test_x.py::test_y", 2, backend)


def test_other_backends_skip_unless_torchrun_has_n_ranks() -> None:
    assert skip_reason(8, "sim", {}) is None
    assert skip_reason(4, "cuda", {"WORLD_SIZE": "4"}) is None
    reason = skip_reason(4, "cpu", {})
    assert reason is not None
    assert "--vram-backend=sim" in reason and "torchrun --nproc-per-node=4" in reason
    assert "one process" in reason
    assert "2 ranks under torchrun" in (skip_reason(4, "cuda", {"WORLD_SIZE": "2"}) or "")


# -- FSDP2 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_fsdp2_keeps_one_nth_of_the_parameters_per_rank(world_size: int) -> None:
    with ranks(world_size) as sim:
        mesh = init_device_mesh("cuda", (world_size,))
        model = linears()
        full = sim.allocated()
        assert full == parameter_bytes(model)
        fsdp(model, mesh)
        assert sim.allocated() == full // world_size
        optimizer = torch.optim.AdamW(model.parameters())
        batch = torch.randn(8, HIDDEN, device="cuda")
        before = sim.allocated()
        sim.reset_peak()
        model(batch).sum().backward()
        # Gradients are sharded like the parameters; the unsharded ones are gone again. A block
        # is counted whole, as CUDA counts it: up to 1 MiB the allocator does not split off.
        assert 0 <= sim.allocated() - before - full // world_size <= 2**20
        # The forward and backward gather one layer at a time, in full.
        assert sim.peak_allocated() >= before + HIDDEN * HIDDEN * 4
        optimizer.step()
        # Parameters, gradients and AdamW's two moments, each 1/n, and the step counters.
        held = sim.allocated() - batch.nbytes
        assert held == pytest.approx(4 * full // world_size, abs=8192 + 2 * 2**20)


def test_fsdp2_frees_the_gathered_parameters_after_each_layer() -> None:
    # FSDP2 frees the gathered parameters by resizing their storages: counted as freed.
    with ranks(4) as sim:
        mesh = init_device_mesh("cuda", (4,))
        model = fsdp(linears(8), mesh)
        sharded = sim.allocated()
        batch = torch.randn(8, HIDDEN, device="cuda")
        sim.reset_peak()
        with torch.no_grad():
            model(batch)
        layer = (HIDDEN * HIDDEN + HIDDEN) * 4
        # After the forward only the output is left, and no more than a few of the eight
        # layers were ever gathered at once.
        assert sim.allocated() - sharded <= 2 * batch.nbytes
        assert sim.peak_allocated() - sharded < 4 * layer


def test_fsdp2_with_mixed_precision_gathers_bf16() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    with ranks(4) as sim:
        mesh = init_device_mesh("cuda", (4,))
        model = linears(2)
        full = parameter_bytes(model)
        fsdp(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        sharded = sim.allocated()
        assert sharded == full // 4
        batch = torch.randn(8, HIDDEN, device="cuda")
        sim.reset_peak()
        with torch.no_grad():
            model(batch)
        # Gathered in bf16: what fp32 gathering holds at its peak (over three layers' fp32
        # bytes, with the all-gather's output and the next layer's) halves.
        layer = (HIDDEN * HIDDEN + HIDDEN) * 4
        assert layer < sim.peak_allocated() - sharded < 2 * layer


# -- DDP, tensor parallel, pipeline -----------------------------------------------------------


def test_ddp_holds_a_gradient_bucket_as_large_as_the_parameters() -> None:
    from torch.nn.parallel import DistributedDataParallel

    with ranks(2) as sim:
        model = linears(2)
        params = sim.allocated()
        ddp = DistributedDataParallel(model)
        assert sim.allocated() == 2 * params  # the flat bucket the gradients are reduced in
        optimizer = torch.optim.AdamW(ddp.parameters())
        batch = torch.randn(8, HIDDEN, device="cuda")
        ddp(batch).sum().backward()
        optimizer.step()
        # Parameters, bucket, gradients and two moments: every rank holds them in full.
        assert sim.allocated() - batch.nbytes == pytest.approx(5 * params, abs=8192)


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_splits_the_weights_and_counts_its_all_reduce(world_size: int) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    with ranks(world_size) as sim:
        mesh = init_device_mesh("cuda", (world_size,))
        model = nn.Sequential(
            nn.Linear(HIDDEN, 4 * HIDDEN, device="cuda"),
            nn.ReLU(),
            nn.Linear(4 * HIDDEN, HIDDEN, device="cuda"),
        )
        full = parameter_bytes(model)
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        # Every weight and the first bias split; the row-parallel bias is replicated.
        replicated_bias = HIDDEN * 4
        assert sim.allocated() == (full - replicated_bias) // world_size + replicated_bias
        batch = torch.randn(8, HIDDEN, device="cuda")
        before = sim.allocated()
        output = model(batch)
        # The row-parallel output is the all-reduce's, a new full-size tensor on each rank.
        assert output.shape == (8, HIDDEN)
        assert sim.counted(output)
        assert sim.allocated() - before >= output.nbytes


def test_functional_collectives_allocate_their_outputs() -> None:
    from torch.distributed import _functional_collectives as funcol

    with ranks(4) as sim:
        mesh = init_device_mesh("cuda", (4,))
        shard = torch.empty(MiB, device="cuda")
        before = sim.allocated()
        # Newer names first: torch 2.13 deprecates the older ones.
        all_gather = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
        reduce_scatter = getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)
        gathered = all_gather(shard, 0, mesh)
        assert gathered.shape == (4 * MiB,)
        assert sim.allocated() - before == 4 * shard.nbytes
        reduced = funcol.all_reduce(shard, "sum", mesh)
        assert sim.allocated() - before == 5 * shard.nbytes
        scattered = reduce_scatter(gathered, "sum", 0, mesh)
        assert sim.allocated() - before == 6 * shard.nbytes
        del gathered, reduced, scattered


def test_a_pipeline_stage_trains_as_the_first_of_n() -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    with ranks(4) as sim:
        stage_module = linears(2)
        params = sim.allocated()
        micro = torch.empty(8, HIDDEN, device="cuda")
        stage = PipelineStage(
            stage_module,
            stage_index=dist.get_rank(),
            num_stages=dist.get_world_size(),
            device=torch.device("cuda"),
            input_args=(micro,),
            output_args=(torch.empty(8, HIDDEN, device="cuda", requires_grad=True),),
        )
        schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda y, t: y.sum())
        batch = torch.randn(32, HIDDEN, device="cuda")
        sim.reset_peak()
        schedule.step(batch)
        assert stage.is_first and not stage.is_last
        assert all(p.grad is not None for p in stage_module.parameters())
        # GPipe keeps every micro-batch's activations until the backward: 4 x 2 outputs.
        assert sim.peak_allocated() >= 2 * params + 8 * micro.nbytes


# -- agreement: torch's FSDP2 memory tracker and the estimator --------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 8])
def test_the_peak_agrees_with_fsdp_mem_tracker(world_size: int) -> None:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    with ranks(world_size) as sim:
        mesh = init_device_mesh("cuda", (world_size,))
        model = fsdp(linears(4, 2048), mesh)
        optimizer = torch.optim.AdamW(model.parameters())
        batch = torch.randn(64, 2048, device="cuda")

        def step() -> None:
            model(batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

        step()  # the moments exist before the measured step, as in a training loop
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((batch,))
        sim.reset_peak()
        with tracker:
            step()
        # The tracker keeps the host (AdamW's step counters) apart from the device, as on a GPU.
        peaks = tracker.get_tracker_snapshot("peak")[torch.device("cuda", 0)]
        assert sim.peak_allocated() == pytest.approx(peaks["Total"], rel=0.02)


SMALL_QWEN = {
    "model_type": "qwen2",
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 4096,
    "tie_word_embeddings": False,
    "max_position_embeddings": 512,
}


# The same shape for the repository's GPT (Qwen2 has q, k and v biases).
SMALL_GPT = GPTConfig(
    vocab_size=SMALL_QWEN["vocab_size"],
    hidden_size=SMALL_QWEN["hidden_size"],
    num_layers=SMALL_QWEN["num_hidden_layers"],
    num_heads=SMALL_QWEN["num_attention_heads"],
    num_kv_heads=SMALL_QWEN["num_key_value_heads"],
    ffn_size=SMALL_QWEN["intermediate_size"],
    qkv_bias=True,
)


# A large block whose remainder is 1 MiB or less is handed out whole, and CUDA counts it all as
# allocated; the estimator counts the tensors' bytes.
UNSPLIT_REMAINDER = 2**20


def near_estimate(measured: int, estimated: int) -> bool:
    """Whether a measured figure is the estimator's, within 1% and one unsplit block."""
    return abs(measured - estimated) <= 0.01 * estimated + UNSPLIT_REMAINDER


def model_states(world_size: int, mp_policy: object = None) -> dict[str, int]:
    """A simulated rank's parameters, gradients and optimizer states of the small GPT under
    FSDP2 (one unit per block and the root), measured after sharding, after the backward and
    after the first AdamW step."""
    options = {} if mp_policy is None else {"mp_policy": mp_policy}
    with ranks(world_size) as sim:
        mesh = init_device_mesh("cuda", (world_size,))
        model = GPT(SMALL_GPT).cuda()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
        weights = sim.allocated()
        tokens = torch.randint(0, SMALL_QWEN["vocab_size"], (1, 257), device="cuda")
        optimizer = torch.optim.AdamW(model.parameters())
        before = sim.allocated()
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        gradients = sim.allocated() - before
        optimizer.step()
        states = sim.allocated() - before - gradients
        return {"weights": weights, "gradients": gradients, "optimizer": states}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [pytest.param(2, marks=needs_gqa_flash_attention), 8])
def test_model_states_per_rank_equal_the_estimators_zero3_breakdown(world_size: int) -> None:
    assert parameter_count(GPT(SMALL_GPT)) == estimate(config=SMALL_QWEN).parameters
    measured = model_states(world_size)
    # fp32 training: FSDP2 shards fp32 parameters, gradients and both moments, as ZeRO-3.
    expected = estimate(config=SMALL_QWEN, mode="train", dtype="fp32", gpus=world_size, zero=3)
    for term in ("weights", "gradients", "optimizer"):
        assert near_estimate(measured[term], expected.breakdown[term]), term


@pytest.mark.slow
@needs_gqa_flash_attention
def test_mixed_precision_model_states_total_the_estimators_bf16_figure() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    measured = model_states(8, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    expected = estimate(config=SMALL_QWEN, mode="train", dtype="bf16", gpus=8, zero=3).breakdown
    # FSDP2 keeps fp32 shards (its master weights) and gathers bf16 copies; the estimator
    # counts bf16 weights and gradients with the fp32 master in the optimizer: 16 bytes a
    # parameter either way.
    total = expected["weights"] + expected["gradients"] + expected["optimizer"]
    assert near_estimate(sum(measured.values()), total)


# -- the marker -------------------------------------------------------------------------------


def test_the_marker_is_a_function_whose_signature_is_its_api() -> None:
    assert vram_world_size(8).mark == pytest.mark.vram_world_size(8).mark
    assert read_marks([vram_world_size(8).mark]).world_size == 8
    assert read_marks([pytest.mark.vram_world_size(n=2).mark]).world_size == 2
    assert read_marks([vram_world_size(8).mark]).any
    assert MARKER_HELP["vram_world_size"].startswith("vram_world_size(n)")


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((0,), {}, "n must be an int >= 1, got 0"),
        (("8",), {}, "n must be an int >= 1, got '8'"),
        ((True,), {}, "n must be an int >= 1, got True"),
        ((2.0,), {}, "n must be an int >= 1, got 2.0"),
        ((), {}, "missing a required argument: 'n'"),
        ((2, 4), {}, "too many positional arguments"),
        ((), {"ranks": 2}, "missing a required argument: 'n'; got vram_world_size(ranks=2)"),
    ],
)
def test_bad_marker_arguments_are_errors(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(MarkerError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_marks([pytest.mark.vram_world_size(*args, **kwargs).mark])


# -- end to end -------------------------------------------------------------------------------

RANK_TESTS = """
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from pytest_vram import max_vram, vram_world_size


@pytest.fixture
def mesh():
    # The group exists before the test's fixtures.
    return init_device_mesh("cuda", (dist.get_world_size(),))


def step(world_size):
    mesh = init_device_mesh("cuda", (world_size,))
    model = nn.Sequential(*[nn.Linear(1024, 1024, device="cuda") for _ in range(4)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(8, 1024, device="cuda")
    model(batch).sum().backward()
    optimizer.step()


@pytest.mark.parametrize("n", [pytest.param(n, marks=vram_world_size(n)) for n in (2, 8)])
def test_fsdp2(vram, n):
    assert (dist.get_rank(), dist.get_world_size()) == (0, n)
    step(n)


# One rank's shards and what it gathers, and cuBLAS's two 32 MiB workspaces (forward and
# autograd's threads), which the simulated H100 holds as a GPU would.
@max_vram("88MiB")
@vram_world_size(8)
def test_fsdp2_fits(mesh):
    assert mesh.size() == 8
    step(8)


@max_vram("88MiB")
@vram_world_size(2)
def test_fsdp2_over_budget():
    step(2)


def test_plain_after(vram):
    assert not dist.is_initialized()
"""


def test_simulated_ranks_run_on_the_sim_and_report_that_ranks_figures(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_ranks=RANK_TESTS)
    result = pytester.runpytest_subprocess(
        "--vram-backend=sim", "--vram-report", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.fnmatch_lines(
        [
            "peak allocated memory * MiB exceeds max_vram(88.00 MiB) by * MiB",
            "*vram report*",
        ]
    )
    rows = {line.split()[0]: line.split() for line in result.outlines if line.startswith("test_")}
    two, eight = (rows[f"test_ranks.py::test_fsdp2[{n}]"] for n in (2, 8))
    assert two[1] == eight[1] == "sim"
    # The figures are one rank's: its shards of the parameters, gradients and moments.
    assert two[3] == eight[3] == "MiB"
    # Besides cuBLAS's two 32 MiB workspaces, which every rank holds.
    workspaces = 64.0
    assert float(two[2]) - workspaces > 2 * (float(eight[2]) - workspaces)


# The reason itself is test_other_backends_skip_unless_torchrun_has_n_ranks's.
@pytest.mark.slow
def test_other_backends_skip_them_with_the_way_to_run_them(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_ranks=RANK_TESTS)
    result = pytester.runpytest_subprocess("--vram-backend=cpu", "-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=4)
    result.stdout.fnmatch_lines(
        [
            "SKIPPED [[]*] test_ranks.py:*: vram_world_size(8): needs 8 ranks and this run has one"
            " process on the cpu backend:"
            " run it on the simulated device (--vram-backend=sim), or under torchrun"
            " --nproc-per-node=8*"
        ]
    )


# The message itself is test_bad_marker_arguments_are_errors's.
@pytest.mark.slow
def test_a_bad_marker_is_a_usage_error_naming_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import sys
        import pytest

        @pytest.mark.vram_world_size("8")
        def test_bad():
            pass

        @pytest.mark.vram_backend("sim")
        def test_idle_sim():
            # Simulated ranks are loaded only for a test that has them.
            assert "pytest_vram.backends.sim.ranks" not in sys.modules
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*usage error in *.py::test_bad: vram_world_size: n must be an int >= 1, got '8'*"]
    )
    markers = pytester.runpytest_subprocess("--markers")
    markers.stdout.fnmatch_lines(["@pytest.mark.vram_world_size(n): run as rank 0 of n ranks*"])


@pytest.mark.slow
def test_under_torchrun_with_n_ranks_the_real_ranks_run_it(pytester: pytest.Pytester) -> None:
    from test_torchrun import CONFTEST, torchrun

    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_real="""
        import torch
        import torch.distributed as dist

        from pytest_vram import vram_world_size


        @vram_world_size(2)
        def test_two(vram, group):
            assert dist.get_world_size() == 2
            x = torch.ones(1024 * (dist.get_rank() + 1))


        @vram_world_size(4)
        def test_four(vram, group):
            pass
        """
    )
    result = torchrun(pytester, "-rs")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*vram_world_size(4): needs 4 ranks and this run has 2 ranks under torchrun on the "
            "cpu backend*"
        ]
    )
    result.stdout.fnmatch_lines(
        ["*test_real.py::test_two: rank 0 4.00 KiB, rank 1 8.00 KiB (max 8.00 KiB)*"]
    )
