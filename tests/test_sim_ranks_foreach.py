"""Simulated ranks: DTensor's sharding of a foreach op in linear time, deciding the same.

For each tensor of a foreach op's lists, DTensor settles ``_StridedShard``'s order flag from all
the op's argument specs again, builds the tensor's schema by walking all the op's arguments, and
expands the tensor's strategy over the mesh: quadratic in the number of parameters, most of an
optimizer step's time over a sharded 32B model. While simulated ranks run, the flag is settled
once per op, each tensor's schema is taken by index, and tensors with equal schemas share one
expansion; the strategies are equal to torch's own.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from simulated_ranks import ranks
from torch.distributed.tensor import _sharding_prop
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from pytest_vram.backends.sim.backend import SimBackend
from pytest_vram.backends.sim.ranks import SimulatedRanks, _strided_flag_once

ORIGINAL = getattr(_sharding_prop, "_propagate_use_strided_shard_flag", None)
TORCH_EXPAND = getattr(_sharding_prop, "_expand_single_dim_strategy_to_mesh", None)
needs_strided_flag = pytest.mark.skipif(
    ORIGINAL is None,
    reason=f"torch {torch.__version__}'s DTensor settles no _StridedShard order flag",
)
needs_single_dim_expansion = pytest.mark.skipif(
    TORCH_EXPAND is None,
    reason=f"torch {torch.__version__}'s DTensor expands no single-dim strategies",
)


def spec(strided: bool, flag: bool) -> SimpleNamespace:
    placements = (_StridedShard(0, split_factor=2), Shard(0)) if strided else (Replicate(),)
    return SimpleNamespace(
        placements=placements, use_strided_shard_as_shard_order=flag, shard_order=()
    )


class Schema:
    """An op's schema as the flag reads it, counting the reads of its argument specs."""

    def __init__(self, specs: list[SimpleNamespace]) -> None:
        self._specs = tuple(specs)
        self.reads = 0

    @property
    def args_spec(self) -> tuple[SimpleNamespace, ...]:
        self.reads += 1
        return self._specs


def strategy(count: int) -> SimpleNamespace:
    """A foreach op's strategy for one tensor: outputs and inputs with strided placements."""
    specs = [
        SimpleNamespace(output_specs=(spec(True, False),), input_specs=[spec(True, True)])
        for _ in range(count)
    ]
    return SimpleNamespace(strategies=specs)


def flags(strategy: SimpleNamespace) -> list[tuple[Any, ...]]:
    return [
        (s.use_strided_shard_as_shard_order, s.shard_order)
        for op_spec in strategy.strategies
        for s in (*op_spec.output_specs, *op_spec.input_specs)
    ]


# Every order of up to three strided specs and their flags, among specs without one.
KINDS = [(True, True), (True, False), (False, False)]
ARGUMENTS = [
    [spec(strided, flag) for strided, flag in combination]
    for length in range(4)
    for combination in itertools.product(KINDS, repeat=length)
]


@needs_strided_flag
@pytest.mark.parametrize("arguments", ARGUMENTS)
def test_the_flag_is_settled_as_torch_settles_it(arguments: list[SimpleNamespace]) -> None:
    theirs, ours = strategy(2), strategy(2)
    ORIGINAL(theirs, Schema(arguments))
    _strided_flag_once(ORIGINAL)(ours, Schema(arguments))
    assert flags(ours) == flags(theirs)


@needs_strided_flag
def test_a_foreach_op_reads_its_argument_specs_once_under_simulated_ranks() -> None:
    group = SimulatedRanks(2, SimBackend())
    group.start()
    try:
        schema = Schema([spec(True, False), spec(True, True), spec(False, False)] * 100)
        strategies = [strategy(1) for _ in range(300)]
        for one in strategies:  # as DTensor does for each tensor of the op's lists
            _sharding_prop._propagate_use_strided_shard_flag(one, schema)
        assert schema.reads == 1
        # Disagreeing flags settle on True, on every strategy.
        assert all(flag for one in strategies for flag, _ in flags(one))
    finally:
        group.stop()
    assert _sharding_prop._propagate_use_strided_shard_flag is ORIGINAL


def _step_over_strided_shards(features: int, widths: list[int]) -> None:
    """A training step of Linear layers of ``widths`` (from ``features`` inputs), column-wise
    over a mesh's tp and FSDP over its dp, with foreach AdamW, under simulated ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
    model = torch.nn.Sequential(
        *[torch.nn.Linear(features, width, device="cuda") for width in widths]
    )
    for layer in model:
        parallelize_module(layer, mesh["tp"], ColwiseParallel(output_layouts=Replicate()))
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.ones(8, features, device="cuda")
    for layer in model[:-1]:
        x = layer(x)
    model[-1](x).sum().backward()
    optimizer.step()


# The layers return views of their gathered outputs; nothing here writes to them in place.
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module:UserWarning")
def test_an_optimizer_step_over_tensor_parallel_fsdp_shards_runs_under_simulated_ranks() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    with ranks(4):
        mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, device="cuda") for _ in range(4)])
        for layer in model:
            parallelize_module(layer, mesh["tp"], ColwiseParallel(output_layouts=Replicate()))
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        # Column-wise over tp, then FSDP over dp on the same dim: strided shards.
        assert any(isinstance(p, _StridedShard) for p in model[0].weight.placements)
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
        model(torch.ones(8, 64, device="cuda")).sum().backward()
        optimizer.step()
        moments = optimizer.state[model[0].weight]["exp_avg"]
        assert moments.placements == model[0].weight.placements
        assert moments.to_local().shape == model[0].weight.to_local().shape == (16, 64)


@needs_single_dim_expansion
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module:UserWarning")
def test_a_foreach_op_expands_each_kind_of_tensor_once_into_torchs_strategies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.distributed.tensor._op_schema import TupleStrategy
    from torch.distributed.tensor._ops import utils

    with ranks(4, monkeypatch):
        ours = _sharding_prop._expand_single_dim_strategy_to_mesh
        assert ours is not TORCH_EXPAND
        expansions = [0]
        compared: list[int] = []
        torch_full_mesh = utils.expand_to_full_mesh_op_strategy

        def counted(*args: Any, **kwargs: Any) -> Any:
            expansions[0] += 1
            return torch_full_mesh(*args, **kwargs)

        def both(mesh: Any, op_schema: Any, info: Any, meta: Any) -> Any:
            mine = ours(mesh, op_schema, info, meta)
            if not any(isinstance(arg, TupleStrategy) for arg in op_schema.args_schema):
                return mine

            def checked(op: Any, args: Any, kwargs: Any) -> Any:
                before = expansions[0]
                strategy = mine(op, args, kwargs)
                compared.append(len(strategy.children))
                assert expansions[0] - before < len(strategy.children)
                theirs = TORCH_EXPAND(mesh, op_schema, info, meta)(op, args, kwargs)
                assert isinstance(strategy, TupleStrategy)
                assert strategy == theirs  # child for child: every OpSpec's input and output specs
                costs = [
                    [s.redistribute_cost for s in child.strategies] for child in strategy.children
                ]
                assert costs == [
                    [s.redistribute_cost for s in child.strategies] for child in theirs.children
                ]
                return strategy

            return checked

        monkeypatch.setattr(utils, "expand_to_full_mesh_op_strategy", counted)
        monkeypatch.setattr(_sharding_prop, "_expand_single_dim_strategy_to_mesh", both)
        # Three kinds of parameter: strided weights, plain bias shards, and a narrower layer's.
        widths = [64, 64, 64, 32]
        _step_over_strided_shards(64, widths)
    assert _sharding_prop._expand_single_dim_strategy_to_mesh is TORCH_EXPAND
    assert compared and all(count == 2 * len(widths) for count in compared)


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module:UserWarning")
def test_a_foreach_ops_outputs_are_found_once_for_each_kind_of_tensor_as_torch_finds_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.distributed.tensor._op_schema import OpSchema
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    name = "_propagate_tensor_meta_non_cached"
    torch_meta = ShardingPropagator.__dict__[name]
    with ranks(4, monkeypatch):
        ours = ShardingPropagator.__dict__[name]
        assert ours is not torch_meta
        fake_runs = [0]
        foreach_lengths: list[int] = []
        torch_fake_args = OpSchema.gen_fake_args

        def counted(self: Any) -> Any:
            fake_runs[0] += 1
            return torch_fake_args(self)

        def both(self: Any, op_schema: Any) -> Any:
            if not op_schema.op._schema.name.startswith("aten::_foreach_"):
                return ours(self, op_schema)
            before = fake_runs[0]
            mine = ours(self, op_schema)
            runs = fake_runs[0] - before
            theirs = torch_meta(self, op_schema)
            assert mine == theirs, op_schema.op
            length = len(next(a for a in op_schema.args_schema if isinstance(a, (list, tuple))))
            foreach_lengths.append(length)
            assert runs < length  # each kind once: fewer fake runs than tensors
            return mine

        monkeypatch.setattr(OpSchema, "gen_fake_args", counted)
        monkeypatch.setattr(ShardingPropagator, name, both)
        # Shapes no other test uses, since torch keeps what it propagated for the process.
        widths = [40, 40, 40, 24]
        _step_over_strided_shards(40, widths)
    assert ShardingPropagator.__dict__[name] is torch_meta
    assert foreach_lengths and all(length == 2 * len(widths) for length in foreach_lengths)
