"""The simulated device's FakeTensorMode: shape-only ops, each output counted once.

Shape-only, a measured test runs under :class:`SimFakeTensorMode`: every tensor carries its
shape, dtype and storage size but no data, so nothing is computed. The mode hands each op's
outputs to the storage tracker, answers ``.item()`` from the values known without computing
(:class:`~pytest_vram.backends.sim.known.KnownValues`), runs the autograd engine's gradient
sums in place as CUDA does, and multiplies grouped matrices in the dtypes the CPU kernel takes.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch._ops import OpOverload
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig, FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._mode_utils import no_dispatch

from pytest_vram.backends.gradsums import (
    IN_PLACE_SCATTERS,
    accumulates_in_place,
    scattered_in_place,
)
from pytest_vram.backends.sim import foreach
from pytest_vram.backends.sim.foreach import is_foreach
from pytest_vram.backends.sim.hosttensors import HostTensors
from pytest_vram.backends.sim.inference import runs_as_its_parts
from pytest_vram.backends.sim.known import KnownValues
from pytest_vram.backends.tracker import StorageTracker

__all__ = ["SimFakeTensorMode", "on_device"]

_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
# None before torch 2.8, which has no grouped matrix product.
_GROUPED_MM = getattr(getattr(torch.ops.aten, "_grouped_mm", None), "default", None)
_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default
_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_VIEW = torch.ops.aten.view.default
_ADD = torch.ops.aten.add.Tensor
_ADD_IN_PLACE = torch.ops.aten.add_.Tensor
_DEVICE = torch.ops.prim.device.default
_inference_mode = torch.is_inference_mode_enabled
# What FakeTensorMode answers before it looks for other subclasses, and how it looks.
try:
    from torch._subclasses.fake_tensor import (
        _DISPATCH_HANDLE_DIRECTLY as _HANDLED_DIRECTLY,
    )
    from torch._subclasses.fake_tensor import (
        _DISPATCH_META_HANDLERS as _META_HANDLERS,
    )
    from torch._subclasses.fake_tensor import _check_for_subclass

    _device_of = _META_HANDLERS.get(_DEVICE)
except ImportError:  # another torch: leave it all to FakeTensorMode
    _HANDLED_DIRECTLY = _META_HANDLERS = frozenset()
    _device_of = None

    def _check_for_subclass(flat_args: Any) -> bool:
        return False


# Arguments that FakeTensorMode's cache key takes as they are, after their type.
_PLAIN_ARGS = frozenset(
    {
        int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
        torch.memory_format,
    }
)  # fmt: skip
_STRIDED = torch.strided
_CONTIGUOUS = torch.contiguous_format
_LENGTHS = tuple(f"length_{n}" for n in range(64))


def on_device(tensor: torch.Tensor) -> bool:
    """Whether a shape-only test's ``tensor`` is device memory: every fake tensor of the
    simulation is, host tensors included; meta tensors are shapes only, and real tensors were
    made outside the simulation."""
    return isinstance(tensor, FakeTensor) and tensor.fake_device.type != "meta"


def _grouped_mm(
    mode: FakeTensorMode, func: Any, types: Any, args: tuple, kwargs: dict[str, Any]
) -> Any:
    """``torch._grouped_mm`` as the CPU kernel runs it.

    The meta kernel checks what CUDA's Hopper kernel needs (bfloat16 inputs); the CPU kernel,
    and CUDA's fallback, multiply float32 and float16 too (a Mixtral's experts in float32 or
    under autocast). For those, the result is the meta kernel's shape in the input's dtype.
    """
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    bound = dict(zip(names, args, strict=False)) | kwargs
    mat_a, mat_b = bound["mat_a"], bound["mat_b"]
    if (
        (mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16)
        or bound.get("bias") is not None
        or not isinstance(mat_a, FakeTensor)
        or mat_a.dtype != mat_b.dtype
    ):
        return mode.dispatch(func, types, args, kwargs)
    from torch._meta_registrations import _create_grouped_mm_output_tensor
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager

    with in_kernel_invocation_manager(mode):
        out = _create_grouped_mm_output_tensor(
            mat_a, mat_b, bound.get("offs"), bound.get("out_dtype")
        )
    return FakeTensor(mode, out, mat_a.fake_device)


def _other_subclass(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether FakeTensorMode would hand the op on to another tensor subclass among its
    arguments (a DTensor): it answers NotImplemented, and the subclass's own dispatch brings the
    op back with fake tensors. Answered here, before a cache key is tried on the subclass."""
    if func in _META_HANDLERS or func in _HANDLED_DIRECTLY:
        return False
    return _check_for_subclass(pytree.arg_tree_leaves(*args, **(kwargs or {})))


def _length(items: Any) -> str:
    return _LENGTHS[len(items)] if len(items) < len(_LENGTHS) else f"length_{len(items)}"


class SimFakeTensorMode(FakeTensorMode):
    """FakeTensorMode that counts the storages of what each op returns.

    Counting here, rather than in a second dispatch mode stacked on top, saves a trip through
    Python for every op; only the ops a program calls are counted, not those FakeTensorMode
    runs inside them (decompositions), just as a mode stacked above would see them.

    The dispatch cache's key is made as FakeTensorMode makes it, item for item, only faster
    for the arguments nearly every op has (see :meth:`_prep_args_for_hash`). So are a cached
    op's output (:meth:`_get_output_tensor_from_cache_entry`), a foreach op's
    (:mod:`~pytest_vram.backends.sim.foreach`), ``_unsafe_view``'s and a lifted one-element
    host tensor (:meth:`_lift_constant`), each checked against what torch makes.
    """

    # Like the storage tracker's mode, this one opts out of the wrapper torch puts around every
    # mode's dispatch to keep Dynamo out of it: the wrapper costs every op, and nothing here
    # is compiled.
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, tracker: StorageTracker, host: HostTensors | None = None) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self._observe_output = tracker.observe_output
        #: The tensors the test keeps on the host, which the device does not count.
        self._host = host
        self._depth = 0
        #: Above 0 while an op is dispatched here, where fake tensors show their own device.
        self.dispatching = 0
        #: What is known of the fake tensors' values without computing them.
        self.known = KnownValues()
        #: How a cached op's output is made here without FakeTensor's constructor.
        self.fresh_fakes = FreshFakes(self)

    def _prep_args_for_hash(
        self, result: list[object], args: Any, state: Any, id_hashed_objects: list[object]
    ) -> None:
        """FakeTensorMode's flattening of an op's arguments into its cache key, the same items
        in the same order: a dense fake tensor's metadata and plain scalars are written out
        here, everything else is left to FakeTensorMode.

        Making the key was a third of a shape-only op's time, mostly in building and walking
        a ``TensorMetadata`` for each tensor argument.
        """
        append = result.append
        if isinstance(args, (list, tuple, dict)):
            append(type(args))
            append(_length(args))
            if isinstance(args, dict):
                self._prep_args_for_hash(result, args.keys(), state, id_hashed_objects)
                self._prep_args_for_hash(result, args.values(), state, id_hashed_objects)
                return
        for arg in args:
            kind = type(arg)
            if kind in _PLAIN_ARGS:
                append(kind)
                append(arg)
            elif kind is list or kind is tuple:
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            elif (
                kind is FakeTensor
                and arg.fake_mode is self
                and arg.constant is None
                and arg.layout is _STRIDED
                and not arg._has_symbolic_sizes_strides
            ):
                # extract_tensor_metadata(arg)._flatten_into(result, ...), field by field.
                shape = arg.shape
                stride = arg.stride()
                # Only 4-d and 5-d tensors can be channels-last.
                memory_format = suggest_memory_format(arg) if len(shape) in (4, 5) else _CONTIGUOUS
                if not arg.is_contiguous(memory_format=memory_format):
                    memory_format = None
                append(arg.dtype)
                append(torch.Size)
                append(_length(shape))
                for size in shape:
                    append(int)
                    append(size)
                append(tuple)
                append(_length(stride))
                for step in stride:
                    append(int)
                    append(step)
                result.extend(
                    (
                        arg.device, _STRIDED, memory_format, arg.storage_offset(),
                        arg.untyped_storage().nbytes(), arg.requires_grad, arg.is_quantized,
                        arg.is_conj(), arg.is_neg(), arg.is_inference(),
                        False, None, None, None,  # not sparse: no coalescing, no sparse dims
                    )
                )  # fmt: skip
            else:
                # Symbolic sizes, other modes' or constant fakes, real tensors, callables.
                super()._prep_args_for_hash(result, iter((arg,)), state, id_hashed_objects)

    def _get_output_tensor_from_cache_entry(
        self, state: Any, entry: Any, key: Any, func: Any, args: Any
    ) -> Any:
        """A cached op's output, made as FakeTensorMode makes it, without its general
        constructor: for a plain output (concrete sizes, strided, neither conjugate nor
        negative), a meta tensor of the cached shape, on the storage of the input it views for a
        view op, wrapped as a fake tensor of the cached device with the attributes every new
        fake tensor of this mode starts with. Anything else is left to FakeTensorMode.

        Making outputs from the cache was a fifth of a simulated training step, most of it in
        ``FakeTensor.__new__``'s checks of arguments that are the same for every output.
        """
        metadata = entry.metadata
        if (
            metadata is None
            or entry.inplace_idx is not None
            or self.shape_env is not None
            or metadata.layout is not _STRIDED
            or metadata.is_conj
            or metadata.is_neg
            or not isinstance(func, OpOverload)
        ):
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        device = self.fresh_fakes[metadata.device]
        if device is None:
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        viewed = args[entry.view_idx] if func.is_view else None
        if viewed is not None and type(viewed) is not FakeTensor:
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        with _NO_DISPATCH():
            empty = torch.empty_strided(
                metadata.shape, metadata.stride, dtype=metadata.dtype, device=_META,
                requires_grad=metadata.requires_grad,
            )  # fmt: skip
            if viewed is not None:
                empty.set_(
                    viewed.untyped_storage(), metadata.storage_offset, metadata.shape,
                    metadata.stride,
                )  # fmt: skip
        return self.fresh_fakes.make(empty, device)

    def _lift_constant(self, args: tuple, kwargs: dict[str, Any] | None) -> FakeTensor | None:
        """``torch.tensor(0.0)`` as FakeTensorMode makes it, without its converter of real
        tensors: for a plain host tensor of one element, a fake tensor that keeps a copy of it
        as its constant, remembered as that copy's fake tensor (an op on the constant that
        returns it, in place, returns this fake tensor); None for anything else.

        An optimizer made one for each parameter's step, and the converter took a quarter of
        a millisecond for each.
        """
        real = args[0] if len(args) == 1 and not kwargs else None
        if (
            type(real) is not torch.Tensor
            or real.layout is not _STRIDED
            or real.device.type != "cpu"
            or real.requires_grad
            or real.is_quantized
            or real.is_conj()
            or real.is_neg()
            or not self.may_turn_const(real)
        ):
            return None
        device = self.fresh_fakes[real.device]
        remember = getattr(self.fake_tensor_converter, "set_tensor_memo", None)
        if device is None or remember is None:
            return None
        with no_dispatch():
            constant = real.clone()
            meta = torch.empty_strided(
                constant.shape, constant.stride(), dtype=constant.dtype, device=_META
            )
        fake = self.fresh_fakes.make(meta, device)
        fake.constant = constant
        remember(constant, fake)
        return fake

    def _new_like(self, fake: FakeTensor) -> FakeTensor:
        """A new fake tensor of ``fake``'s shape, stride, dtype and device, on its own storage."""
        with _NO_DISPATCH():
            meta = torch.empty_strided(fake.shape, fake.stride(), dtype=fake.dtype, device=_META)
        device = self.fresh_fakes[fake.fake_device]
        if device is None:
            return FakeTensor(self, meta, fake.fake_device)
        return self.fresh_fakes.make(meta, device)

    def __deepcopy__(self, memo: dict[int, Any]) -> SimFakeTensorMode:
        # copy.deepcopy(model) copies each fake tensor's __dict__, its mode included; there is
        # one simulated device, and the copies belong to it.
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is _DEVICE and _device_of is not None:
            # Three ops in five: a fake tensor's device, asked from C++, answered as
            # FakeTensorMode answers it.
            return _device_of(args)
        self.dispatching += 1
        try:
            if func is _LOCAL_SCALAR:
                # .item(), bool(t): a value known without computing is the value a real run reads.
                value = self.known.item(args[0])
                if value is not None:
                    return value
            elif func is _ADD and accumulates_in_place(func, args, kwargs, sys._getframe(1)):
                func = _ADD_IN_PLACE  # the autograd engine's gradient sum, in place as on CUDA
            elif func in IN_PLACE_SCATTERS:
                # A derivative formula filling its fresh zeros, in place as on CUDA.
                func = scattered_in_place(func, sys._getframe(1)) or func
            if kwargs and _names_cuda(kwargs.get("device")):
                # An op called below the function mode (a custom op's own factory, FSDP2's
                # all-gather buffer): the simulated device's tensors are cpu ones.
                kwargs = {**kwargs, "device": _CPU_DEVICE}
            # ``types``: the subclasses among the arguments, FakeTensor alone for nearly every op.
            only_fakes = not types or (len(types) == 1 and types[0] is FakeTensor)
            if not only_fakes and _other_subclass(func, args, kwargs):
                return NotImplemented
            if self._depth == 0 and _inference_mode() and runs_as_its_parts(func):
                # Autograd, which breaks such an op up, is skipped: its parts are counted here.
                with self:
                    return func.decompose(*args, **(kwargs or {}))
            self._depth += 1
            try:
                if func is _GROUPED_MM:
                    out = _grouped_mm(self, func, types, args, kwargs or {})
                elif func is _UNSAFE_VIEW:
                    # A view that autograd does not track as one (a matmul's output reshaped):
                    # below autograd it is ``view``, whose outputs the dispatch cache knows, where
                    # FakeTensorMode runs ``_unsafe_view`` anew each time.
                    out = self.dispatch(_VIEW, types, args, kwargs)
                elif func is _LIFT_FRESH:
                    out = self._lift_constant(args, kwargs)
                    if out is None:
                        out = self.dispatch(func, types, args, kwargs)
                elif is_foreach(func):
                    out = foreach.by_kind(
                        self, self.dispatch, self._new_like, func, types, args, kwargs or {}
                    )
                else:
                    out = self.dispatch(func, types, args, kwargs)
            finally:
                self._depth -= 1
            if self._depth == 0:
                # Queries return no tensor: skip them cheaply.
                if isinstance(out, (torch.Tensor, tuple, list)) and not (
                    self._host is not None and self._host.place(args, kwargs, out)
                ):
                    self._observe_output(func, out)
                self.known.after(func, args, kwargs or {}, out)
            return out
        finally:
            self.dispatching -= 1


_META = torch.device("meta")
_CPU_DEVICE = torch.device("cpu")


def _names_cuda(device: object) -> bool:
    return isinstance(device, torch.device) and device.type == "cuda"


_NO_DISPATCH = torch._C._DisableTorchDispatch
_make_subclass = torch.Tensor._make_subclass
_throw_on_data_ptr = getattr(torch._C, "_set_throw_on_mutable_data_ptr", None)
_warn_on_data_ptr = getattr(torch._C, "_set_warn_deprecated_on_mutable_data_ptr", None)


class FreshFakes(dict):
    """How a mode makes the fake tensors of cached outputs without FakeTensor's constructor,
    where that makes the same tensor: the attributes a new fake tensor starts with, and, for
    each device an output is made on, the device itself where the constructor keeps it as it
    is (the host, a device with an index, meta where the mode allows it) and None where it would
    change or refuse it.

    Whether it makes the same tensor is checked once, on the mode's first fake tensor; where
    this torch's constructor differs, every device maps to None and the constructor runs.
    """

    def __init__(self, mode: FakeTensorMode) -> None:
        super().__init__()
        self._mode = mode
        #: What FakeTensor's constructor sets besides the device and mode (no constant, no real
        #: tensor, empty memos), or None where it does not make what :meth:`make` makes.
        self.state = _fresh_state(mode)

    def __missing__(self, device: torch.device) -> torch.device | None:
        if device.type == "meta":
            plain = self._mode.allow_meta  # shapes only, as a model built on meta is sharded
        else:
            plain = device.type == "cpu" or device.index is not None
        plain = plain and self.state is not None
        # Normalising a GPU device also readies the GPU context that backward needs.
        kept = device if plain and FakeTensor._normalize_fake_device(device) == device else None
        self[device] = kept
        return kept

    def make(self, meta: torch.Tensor, device: torch.device) -> FakeTensor:
        """``FakeTensor(mode, meta, device)`` for a device this table keeps."""
        return _fake(self._mode, self.state, meta, device)


def _fake(
    mode: FakeTensorMode, state: dict[str, Any], meta: torch.Tensor, device: torch.device
) -> FakeTensor:
    """A fake tensor of ``mode`` made without FakeTensor's constructor: the subclass, its data
    pointer guarded as the mode guards it, then ``state``, the attributes a new one has."""
    fake = _make_subclass(
        FakeTensor, meta, meta.requires_grad, dispatch_device=True, device_for_backend_keys=device
    )
    if mode._allow_unsafe_data_ptr_access:
        _warn_on_data_ptr(fake)
    else:
        _throw_on_data_ptr(fake)
    fake.__dict__.update(state, _fake_device=device, fake_mode=mode)
    return fake


def _fresh_state(mode: FakeTensorMode) -> dict[str, Any] | None:
    """The attributes FakeTensor's constructor gives a new fake tensor of ``mode`` besides its
    device and mode, where :func:`_fake` with them makes the same fake tensor: the same type,
    attributes, dispatch keys and flags; None where it does not."""
    if getattr(FakeTensorConfig, "debug", True) or not (_throw_on_data_ptr and _warn_on_data_ptr):
        return None
    try:
        device = torch.device("cpu")
        meta = torch.empty_strided((2, 3), (3, 1), device=_META, requires_grad=True)
        made = FakeTensor(mode, meta, device)
        state = {
            name: value
            for name, value in made.__dict__.items()
            if name not in ("_fake_device", "fake_mode")
        }
        made_here = _fake(mode, state, meta, device)
    except Exception:  # any difference in this torch: its own constructor runs
        return None
    same = (
        type(made_here) is type(made)
        and made_here.__dict__ == made.__dict__
        and all(value is None for value in state.values())
        # Compared as numbers: torch 2.6's key sets have no ``==`` of their own.
        and torch._C._dispatch_keys(made_here).raw_repr()
        == torch._C._dispatch_keys(made).raw_repr()
        and made_here.requires_grad == made.requires_grad
        and made_here.fake_device == made.fake_device
    )
    return state if same else None


def _writes_the_key_as_torch_does() -> bool:
    """Whether this torch flattens an op's arguments into its cache key as
    :meth:`SimFakeTensorMode._prep_args_for_hash` does: the same method signature, and the
    same fields of a tensor's metadata (torch 2.13's). Elsewhere torch's own method runs."""
    import dataclasses
    import inspect

    from torch._subclasses import fake_tensor

    try:
        parameters = list(inspect.signature(FakeTensorMode._prep_args_for_hash).parameters)
        fields = [field.name for field in dataclasses.fields(fake_tensor.TensorMetadata)]
    except (AttributeError, TypeError, ValueError):
        return False
    return parameters == ["self", "result", "args", "state", "id_hashed_objects"] and fields == [
        "dtype", "shape", "stride", "device", "layout", "memory_format", "storage_offset",
        "storage_bytes", "requires_grad", "is_quantized", "is_conj", "is_neg", "is_inference",
        "is_sparse", "is_coalesced", "dense_dim", "sparse_dim",
    ]  # fmt: skip


if not _writes_the_key_as_torch_does():
    del SimFakeTensorMode._prep_args_for_hash


def _reads_cache_entries_as_torch_does() -> bool:
    """Whether this torch makes a cached op's output where
    :meth:`SimFakeTensorMode._get_output_tensor_from_cache_entry` takes over: the same method
    signature, and the same fields of an output's cache entry (torch 2.13's). Elsewhere
    torch's own method runs."""
    import dataclasses
    import inspect

    from torch._subclasses import fake_tensor

    try:
        method = FakeTensorMode._get_output_tensor_from_cache_entry
        parameters = list(inspect.signature(method).parameters)
        fields = {
            field.name for field in dataclasses.fields(fake_tensor._DispatchCacheEntryOutputInfo)
        }
    except (AttributeError, TypeError, ValueError):
        return False
    return parameters == ["self", "state", "entry", "key", "func", "args"] and fields == {
        "inplace_idx", "metadata", "view_idx", "constant_value",
    }  # fmt: skip


if not _reads_cache_entries_as_torch_does():
    del SimFakeTensorMode._get_output_tensor_from_cache_entry
