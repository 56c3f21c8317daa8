"""Simulated ranks: a test marked ``vram_world_size(n)`` runs as rank 0 of ``n`` on the sim.

Before the test's fixtures, torch.distributed is initialised with PyTorch's fake process group
(``FakeProcessGroup``: collectives complete at once and move no data) for ``n`` ranks, so that
``fully_shard`` (FSDP2), DDP, DTensor tensor parallelism and pipeline stages run unchanged in
one process; after its teardown the group is destroyed. The figures are rank 0's: its shards,
and the buffers its collectives allocate.

While the test runs, these are patched and put back, object for object (a
:class:`~pytest_vram.backends.sim.patches.PatchSet`):

- ``DeviceMesh``: its rank bookkeeping is plain integer tensors, which FakeTensorMode would
  make fake (and then fail to read); its methods run with the fake mode unset. A mesh of the
  virtual CUDA device is a ``cpu`` mesh inside, for the fake process group, whose
  ``device_type`` says ``cuda`` to the code that made it: FSDP2 and DTensor put their tensors
  on the mesh's device, which must be the simulated device's ``cuda:0``, not the host. Torch 2.6's
  ``init_device_mesh`` makes its mesh tensor under the fake mode: it is made again.
- ``torch.cpu``'s streams, where they have no ``record_event`` (torch 2.6): FSDP2 records and
  waits for events on a ``cpu`` mesh's streams; the stream put in their place waits for
  nothing, as later torch's does.
- ``UntypedStorage.resize_``: FSDP2 frees and refills its unsharded parameters by resizing
  their storages, which dispatches no op; the tracker is told the new size.
- DTensor's sharding propagation: it runs each op once more on global-shape fake tensors to
  learn the output's shape; that allocates nothing on a real rank, and is not counted. For a
  foreach op (an optimizer's step over every parameter) it reads all the op's argument specs
  again for each tensor of the list, to settle one flag (``_StridedShard``'s order) that
  depends on the op alone, walks all the arguments to build each tensor's schema, and expands
  each tensor's strategy over the mesh. Here the flag is read once per op, each tensor's schema
  is taken by index, and tensors with equal schemas (a model's layers are alike) share one
  expansion, as torch's own cache already has them share what the expansion is built from: the
  step's sharding takes linear, not quadratic, time in the number of parameters, and decides the
  same.
- DDP: its check that every rank has the same parameter shapes reads the (fake) data, and the
  fake group's all-reduce gives its reducer no result; with one rank there is nothing to
  check, and a module that registered no communication hook of its own gets one that
  averages each bucket in place, as NCCL's all-reduce does, allocating nothing.
- Pipeline schedules: before the first step the stages vote over point-to-point messages on
  whether their shapes are static; the fake group delivers no votes, so this rank's stages
  decide from their own metadata, as every rank of a pipeline built alike would. A stage
  without ``input_args`` and ``output_args`` needs its neighbours' shapes at run time, which
  the fake group cannot deliver.

The c10d collectives get meta kernels where torch has none (torch 2.6), as later torch
registers them on import: each completes at once, and they stay registered, as torch's do.

Imported only when such a test runs: it imports torch.distributed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed import device_mesh

from pytest_vram.backends.sim.foreach import group_by_kind
from pytest_vram.backends.sim.patches import PatchSet

__all__ = ["SimulatedRanks", "ranks_for", "skip_reason"]


def skip_reason(
    world_size: int, backend: str, environ: Mapping[str, str] | None = None
) -> str | None:
    """Why a ``vram_world_size(world_size)`` test cannot run on ``backend`` here; None when it
    can: on sim (simulated ranks), or under torchrun with ``world_size`` ranks (real ones)."""
    if backend == "sim":
        return None
    environ = os.environ if environ is None else environ
    ranks = environ.get("WORLD_SIZE")
    if ranks == str(world_size):
        return None
    now = f"{ranks} ranks under torchrun" if ranks else "one process"
    return (
        f"vram_world_size({world_size}): needs {world_size} ranks and this run has {now} on the "
        f"{backend} backend: run it on the simulated device (--vram-backend=sim), or under "
        f"torchrun --nproc-per-node={world_size}"
    )


def ranks_for(nodeid: str, world_size: int, backend: Any) -> SimulatedRanks | None:
    """What a ``vram_world_size`` test runs with on ``backend``: started simulated ranks on sim,
    None for real ranks under torchrun; a skip when neither fits, a failure when a process
    group is already initialised on sim."""
    reason = skip_reason(world_size, backend.name)
    if reason is not None:
        # Reported at the test, as a skip marker's is, not at this line.
        raise pytest.skip.Exception(reason, _use_item_location=True)
    if backend.name != "sim":
        return None
    if dist.is_available() and dist.is_initialized():
        pytest.fail(
            f"usage error in {nodeid}: vram_world_size({world_size}) runs the test in a fake "
            "process group of its own on the sim backend, and a process group is already "
            "initialised (a fixture's init_process_group?): leave that to the marker",
            pytrace=False,
        )
    ranks = SimulatedRanks(world_size, backend)
    ranks.start()
    return ranks


def _unfaked(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return func(*args, **kwargs)

    return call


def _mesh_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
        if device_type == "cuda":
            device_type = "cpu"
            # The code that asked sees a cuda mesh (device_type), whose tensors are on cuda:0.
            self._pytest_vram_shown = "cuda"
        with unset_fake_temporarily():
            rank_map = kwargs.get("_rank_map")
            # init_device_mesh made its identity rank map under the fake mode: make it again.
            if isinstance(rank_map, FakeTensor):
                kwargs["_rank_map"] = torch.arange(rank_map.numel(), dtype=rank_map.dtype)
            mesh = kwargs.get("mesh", args[0] if args else None)
            if isinstance(mesh, FakeTensor):
                if not _called_by(device_mesh.init_device_mesh):
                    raise ValueError(
                        "DeviceMesh(device_type, mesh): the mesh tensor was made on the "
                        "simulated device and has no values; pass the ranks as a list, or use "
                        "init_device_mesh"
                    )
                # Torch 2.6's init_device_mesh made its identity mesh under the fake mode.
                identity = torch.arange(mesh.numel(), dtype=mesh.dtype).view(mesh.shape)
                if "mesh" in kwargs:
                    kwargs["mesh"] = identity
                else:
                    args = (identity, *args[1:])
            original(self, device_type, *args, **kwargs)

    return __init__


def _called_by(function: Callable[..., Any]) -> bool:
    """Whether the caller of the function that asks is ``function``."""
    return sys._getframe(2).f_code is getattr(function, "__code__", None)


def _mesh_replacements() -> Iterator[tuple[str, Any]]:
    cls = device_mesh.DeviceMesh
    for name, value in vars(cls).items():
        if name == "__init__":
            yield name, _mesh_init(value)
        elif isinstance(value, staticmethod):
            yield name, staticmethod(_unfaked(value.__func__))
        elif name == "device_type" and isinstance(value, property):
            yield name, property(_shown_device_type, doc=value.__doc__)
        elif isinstance(value, property) and value.fget is not None:
            yield name, property(_unfaked(value.fget), value.fset, value.fdel, value.__doc__)
        elif callable(value) and not isinstance(value, type) and name not in ("__hash__", "__eq__"):
            yield name, _unfaked(value)


def _shown_device_type(self: Any) -> str:
    # A submesh or a flattened mesh is its root's: shown as the root is.
    root = getattr(self, "_root_mesh", None)
    shown = getattr(self, "_pytest_vram_shown", None) or getattr(root, "_pytest_vram_shown", None)
    return shown or self._device_type


def _verify_nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _ddp_pre_forward(original: Callable[..., Any], world_size: int) -> Callable[..., Any]:
    def average_in_place(state: object, bucket: Any) -> torch.futures.Future:
        buffer = bucket.buffer()
        buffer.div_(world_size)
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(buffer)
        return future

    @functools.wraps(original)
    def _pre_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._comm_hooks and not getattr(self, "_pytest_vram_hook", False):
            self._pytest_vram_hook = True
            # A built-in hook of the test's own may be registered: it stays.
            with contextlib.suppress(RuntimeError):
                dist._register_comm_hook(self.reducer, None, average_in_place)
        return original(self, *args, **kwargs)

    return _pre_forward


def _pipeline_warmup(original: Callable[..., Any]) -> Callable[..., Any]:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._utils import InferenceMode

    @functools.wraps(original)
    def _warmup_p2p(self: Any, stages: list[Any], has_backward: bool, *args: Any) -> None:
        if not all(isinstance(stage, PipelineStage) for stage in stages):
            return original(self, stages, has_backward, *args)
        for stage in stages:
            dynamic = InferenceMode.needs_dynamic(stage._user_meta, has_backward)
            stage._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC
        return None

    return _warmup_p2p


class _CpuStream(torch.cpu.Stream):
    """``torch.cpu.Stream`` with the event methods FSDP2 calls on a ``cpu`` mesh's streams;
    torch 2.6's has neither, and later ones record and wait for nothing, as here."""

    def record_event(self) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None


# The c10d collectives later torch gives meta kernels (torch.distributed._meta_registrations):
# those that return their tensors with their work, those that return the work alone, and the one
# that returns nothing.
_RETURN_TENSORS = (
    "broadcast_",
    "allreduce_",
    "allgather_",
    "_allgather_base_",
    "reduce_scatter_",
    "_reduce_scatter_base_",
    "scatter_",
    "alltoall_",
)
_RETURN_WORK = (
    "reduce_",
    "gather_",
    "alltoall_base_",
    "barrier",
    "send",
    "recv_",
    "recv_any_source_",
)
_RETURN_NOTHING = ("monitored_barrier_",)


def _completed_work() -> Any:
    """A c10d work that is done: the fake group's collectives complete at once."""
    from torch._C._distributed_c10d import _create_work_from_future

    future: torch.futures.Future = torch.futures.Future()
    future.set_result(None)
    return _create_work_from_future(future).boxed()


@functools.cache
def _register_collective_metas() -> torch.library.Library | None:
    """Meta kernels, as later torch's, for the c10d collectives that have none (torch 2.6):
    without them a collective on the simulated device's fake tensors fails. The library is
    kept (cached): its registrations go with it."""
    kernels: dict[str, Callable[..., Any]] = {
        **dict.fromkeys(_RETURN_TENSORS, lambda *args: (args[0], _completed_work())),
        **dict.fromkeys(_RETURN_WORK, lambda *args: _completed_work()),
        **dict.fromkeys(_RETURN_NOTHING, lambda *args: None),
    }
    missing = {
        name: kernel
        for name, kernel in kernels.items()
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"c10d::{name}", "Meta")
    }
    if not missing:
        return None
    library = torch.library.Library("c10d", "IMPL")
    for name, kernel in missing.items():
        library.impl(name, kernel, "Meta")
    return library


class _ArgsSpec:
    """Stands in for an op's schema where only its argument specs are read."""

    __slots__ = ("args_spec",)

    def __init__(self, args_spec: tuple[Any, ...]) -> None:
        self.args_spec = args_spec


def _strided_specs(schema: Any) -> _ArgsSpec:
    """Of ``schema``'s argument specs, those that decide the ``_StridedShard`` flag: the
    flag comes from the specs with a ``_StridedShard`` placement, and one of them that holds
    the flag they decide gives the same flag alone."""
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = [
        spec
        for spec in schema.args_spec
        if any(isinstance(p, _StridedShard) for p in spec.placements)
    ]
    # The flag as torch's loop settles it: agreement keeps it, disagreement makes it True.
    flag = None
    for spec in strided:
        value = spec.use_strided_shard_as_shard_order
        flag = True if flag is not None and flag != value else value
    for spec in strided:
        if spec.use_strided_shard_as_shard_order == flag:
            return _ArgsSpec((spec,))
    return _ArgsSpec(tuple(strided))


def _strided_flag_once(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_propagate_use_strided_shard_flag(strategy, schema)``, reading ``schema``'s argument
    specs once for all the strategies of one op (a foreach op calls it for each tensor)."""
    # The last schema and its deciding spec. Sound to keep: only torch's fix-up writes the
    # flag afterwards, and it writes the flag the specs decided, which decides it again.
    last: list[Any] = [None, None]

    @functools.wraps(original)
    def propagate(op_strategy: Any, op_schema: Any) -> None:
        if last[0] is not op_schema:
            last[0], last[1] = op_schema, _strided_specs(op_schema)
        try:
            original(op_strategy, last[1])
        except AttributeError:  # a torch that reads more of the schema: give it the whole
            original(op_strategy, op_schema)

    return propagate


def _foreach_each_kind_once(original: Callable[..., Any]) -> Callable[..., Any] | None:
    """``_expand_single_dim_strategy_to_mesh`` whose foreach strategies expand each kind of
    tensor once: the tensors of a foreach op's lists whose per-tensor schemas are equal (the
    same placements, shape, stride and dtype, and the same output) share one expansion.

    Torch expands every tensor of the lists on its own, and builds each tensor's schema by
    walking all the op's arguments, so an optimizer step over a sharded model's hundreds of
    parameters takes quadratic time. Its own cache already hands tensors with equal schemas the
    same expansion, built from the first of them; here that expansion is also run once, and each
    tensor's schema is taken by index. None for a torch whose foreach expansion is not this."""
    from torch.distributed.tensor._op_schema import OpSchema, TupleStrategy
    from torch.distributed.tensor._ops import single_dim_strategy

    elementwise = getattr(single_dim_strategy, "_resolve_foreach_elementwise_overload", None)
    if elementwise is None:
        return None

    @functools.wraps(original)
    def expand(mesh: Any, op_schema: Any, strategy_info: Any, output_meta: Any) -> Any:
        torch_foreach = original(mesh, op_schema, strategy_info, output_meta)
        if getattr(torch_foreach, "__name__", None) != "expanded_foreach_strategy":
            return torch_foreach
        arguments = op_schema.args_schema
        lists = [arg.children for arg in arguments if isinstance(arg, TupleStrategy)]
        nested = any(
            isinstance(arg, (list, tuple)) and any(isinstance(a, TupleStrategy) for a in arg)
            for arg in arguments
        )
        if nested or not lists or len({len(children) for children in lists}) != 1:
            return torch_foreach
        target = elementwise(op_schema.op) or op_schema.op

        def expanded_foreach_strategy(op: Any, args_schema: Any, kwargs_schema: Any) -> Any:
            expanded: dict[Any, Any] = {}
            children = []
            for index in range(len(lists[0])):
                schema = OpSchema(
                    target,
                    args_schema=tuple(
                        arg.children[index] if isinstance(arg, TupleStrategy) else arg
                        for arg in arguments
                    ),
                    kwargs_schema=op_schema.kwargs_schema,
                )
                meta = output_meta[index] if output_meta is not None else None
                try:
                    key: Any = (schema, meta)
                    strategy = expanded.get(key)
                except TypeError:  # symbolic sizes do not hash: expand this one on its own
                    key, strategy = None, None
                if strategy is None:
                    one = original(mesh, schema, strategy_info, meta)
                    strategy = one(op, schema.args_meta, schema.kwargs_meta)
                    if key is not None:
                        expanded[key] = strategy
                children.append(strategy)
            return TupleStrategy(children=children)

        return expanded_foreach_strategy

    return expand


def _foreach_kinds(op_schema: Any) -> tuple[list[Any], list[int]] | None:
    """A foreach op's schema as one schema per kind of tensor in its lists, and each list
    position's kind: positions whose tensors have the same shape, stride and dtype, with the
    same scalars at that position, are one kind. None for any other op, or a foreach op whose
    arguments are not lists of one length beside single values."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema

    if not op_schema.op._schema.name.startswith("aten::_foreach_"):
        return None
    arguments = op_schema.args_schema
    lists = [arg for arg in arguments if isinstance(arg, (list, tuple))]
    if not lists or len({len(arg) for arg in lists}) != 1:
        return None
    if any(isinstance(value, (list, tuple)) for value in op_schema.kwargs_schema.values()):
        return None
    for arg in lists:
        if not all(isinstance(item, (DTensorSpec, int, float, bool)) for item in arg):
            return None

    def item_key(item: Any) -> Any:
        # What torch makes the fake tensor from: the global shape, stride and dtype.
        return item.tensor_meta if isinstance(item, DTensorSpec) else (type(item), item)

    split = group_by_kind(lists, item_key)
    if split is None:
        return None
    first_of_kind, kind_of = split
    schemas = [
        OpSchema(
            op_schema.op,
            args_schema=tuple(
                type(arg)(arg[index : index + 1]) if isinstance(arg, (list, tuple)) else arg
                for arg in arguments
            ),
            kwargs_schema=op_schema.kwargs_schema,
            schema_info=op_schema.schema_info,
        )
        for index in first_of_kind
    ]
    return schemas, kind_of


def _foreach_meta_each_kind_once(original: Callable[..., Any]) -> Callable[..., Any]:
    """``ShardingPropagator._propagate_tensor_meta_non_cached`` that runs a foreach op on fake
    tensors once for each kind of tensor in its lists (see :func:`_foreach_kinds`) rather than
    on all of them: a foreach op works on each position of its lists alone, so the outputs of
    one kind are alike. Torch makes a fake tensor for each of an optimizer step's hundreds of
    parameters, for each foreach op of the step; a sharded model's layers are alike."""

    @functools.wraps(original)
    def propagate(self: Any, op_schema: Any) -> Any:
        split = _foreach_kinds(op_schema)
        if split is None:
            return original(self, op_schema)
        schemas, kind_of = split
        metas = [original(self, schema) for schema in schemas]
        if all(meta is None for meta in metas):  # an in-place foreach op returns nothing
            return None
        if not all(isinstance(meta, (list, tuple)) and len(meta) == 1 for meta in metas):
            return original(self, op_schema)
        outputs = [metas[kind][0] for kind in kind_of]
        return tuple(outputs) if isinstance(metas[0], tuple) else outputs

    return propagate


class SimulatedRanks:
    """Rank 0 of a fake process group of ``world_size`` ranks, around one test on the sim."""

    def __init__(self, world_size: int, backend: Any) -> None:
        self.world_size = world_size
        self.backend = backend
        # Shadowed, not replaced: UntypedStorage.resize_ is inherited, and set on the class.
        self._patches = PatchSet()
        self.started = False

    def start(self) -> None:
        # Importing it registers the "fake" backend with torch.distributed.
        from torch.testing._internal.distributed.fake_pg import FakeStore

        with unset_fake_temporarily():
            dist.init_process_group("fake", rank=0, world_size=self.world_size, store=FakeStore())
        self.started = True
        try:
            self._install()
        except BaseException:
            self.stop()
            raise

    def _install(self) -> None:
        patches = self._patches
        cls = device_mesh.DeviceMesh
        for name, value in list(_mesh_replacements()):
            patches.shadow(cls, name, value)
        patches.shadow(torch.UntypedStorage, "resize_", self._storage_resize())
        if not hasattr(torch.cpu.Stream, "record_event"):
            stream = _CpuStream()
            patches.replace(torch.cpu, "Stream", _CpuStream)
            patches.replace(torch.cpu, "_default_cpu_stream", stream)
            patches.replace(torch.cpu, "_current_stream", stream)
        _register_collective_metas()
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
        from torch.nn.parallel import DistributedDataParallel as DDP

        patches.shadow(dist, "_verify_params_across_processes", _verify_nothing)
        patches.shadow(DDP, "_pre_forward", _ddp_pre_forward(DDP._pre_forward, self.world_size))
        with contextlib.suppress(ImportError):  # another torch: the vote may be elsewhere
            from torch.distributed.pipelining.schedules import _PipelineSchedule

            warmup = _PipelineSchedule.__dict__.get("_warmup_p2p")
            if warmup is not None:
                patches.shadow(_PipelineSchedule, "_warmup_p2p", _pipeline_warmup(warmup))

        name = "_propagate_tensor_meta_non_cached"
        original = ShardingPropagator.__dict__.get(name)
        if original is not None:
            meta = _foreach_meta_each_kind_once(original)
            patches.shadow(ShardingPropagator, name, self._uncounted(meta))
        from torch.distributed.tensor import _sharding_prop

        flag = getattr(_sharding_prop, "_propagate_use_strided_shard_flag", None)
        if flag is not None:
            patches.replace(_sharding_prop, flag.__name__, _strided_flag_once(flag))
        expand = getattr(_sharding_prop, "_expand_single_dim_strategy_to_mesh", None)
        each_kind_once = _foreach_each_kind_once(expand) if expand is not None else None
        if each_kind_once is not None:
            patches.replace(_sharding_prop, expand.__name__, each_kind_once)

    def _storage_resize(self) -> Callable[..., Any]:
        resize = torch.UntypedStorage.resize_
        observe = self.backend.tracker.observe_resize
        as_one_op = self.backend.as_one_op

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            with as_one_op():
                out = resize(storage, size)
            observe(storage)
            return out

        return resize_

    def _uncounted(self, original: Callable[..., Any]) -> Callable[..., Any]:
        uncounted = self.backend.uncounted

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            with uncounted():
                return original(*args, **kwargs)

        return call

    def stop(self) -> None:
        try:
            self._patches.restore()
        finally:
            if self.started:
                self.started = False
                if dist.is_initialized():
                    with unset_fake_temporarily():
                        dist.destroy_process_group()
