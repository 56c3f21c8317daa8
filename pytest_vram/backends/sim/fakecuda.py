"""A virtual CUDA device for code that runs on fake ``cpu`` tensors.

While a simulated test runs, :class:`VirtualCuda` makes code written for CUDA work unchanged on
a CPU-only build of PyTorch:

- ``device="cuda"`` (``"cuda:0"``, ``torch.device("cuda")``, ``0``) in any torch function,
  ``Tensor.to("cuda")``, ``Tensor.cuda()``, ``Module.to("cuda")``, ``Module.cuda()`` and the
  ``torch.device("cuda")`` context manager put tensors on the (fake) ``cpu`` device, where
  FakeTensorMode can run autograd and optimizers; a real tensor made before the test becomes a
  counted fake copy when moved to ``cuda``;
- ``torch.autocast("cuda", dtype)`` runs as CPU autocast, corrected so that the functions a test
  calls follow CUDA's autocast op lists (``softmax``, ``sum``, ``exp``, norms and losses in
  float32; ``einsum`` and friends in the low precision);
- ``torch.cuda.*`` (and ``torch.accelerator.*``) device and memory queries answer from the
  simulated device; optimizers default to the ``foreach`` implementations they use on CUDA;
  ``GradScaler.step`` always steps, since the simulated device has no values to check for infs.
- an optimizer's own host tensors (AdamW's ``step`` counters) are made uncounted, as host
  memory; transformers' ``is_tracing(tensor)`` answers False for fake tensors, as in a real run.

Everything is patched in :meth:`VirtualCuda.install` and put back, object for object, in
:meth:`VirtualCuda.uninstall`.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.amp.autocast_mode
import torch.amp.grad_scaler
import torch.cuda.memory
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.optim import optimizer as _optimizer
from torch.overrides import TorchFunctionMode
from torch.utils import _device
from torch.utils.data._utils import pin_memory as pin_memory_module

from pytest_vram.backends.sim import cudaremap
from pytest_vram.backends.sim.cudaremap import is_cuda_device
from pytest_vram.backends.sim.ops import trunc_normal_decided
from pytest_vram.importhook import PatchOnImport

__all__ = ["SimulatedDevice", "SimulatedDeviceProperties", "VirtualCuda"]

_CPU = torch.device("cpu")
# The real answers, read before anything is patched.
_is_autocast_enabled = torch.is_autocast_enabled
_get_autocast_dtype = torch.get_autocast_dtype


class SimulatedDevice(Protocol):
    """What the virtual device reads its memory figures from (the sim backend)."""

    def allocated(self) -> int: ...

    def peak_allocated(self) -> int: ...

    def reserved(self) -> int | None: ...

    def peak_reserved(self) -> int | None: ...

    def reset_peak(self) -> None: ...

    def release_cache(self) -> None: ...

    def device_total(self) -> int: ...

    def memory_stats_nested(self) -> dict[str, Any]: ...

    def memory_summary(self) -> str: ...

    def counted(self, tensor: torch.Tensor) -> bool: ...


@dataclass(frozen=True)
class SimulatedDeviceProperties:
    """What ``torch.cuda.get_device_properties`` returns for the simulated device."""

    name: str
    total_memory: int
    major: int = 9
    minor: int = 0
    multi_processor_count: int = 132
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    max_threads_per_multi_processor: int = 2048
    warp_size: int = 32
    L2_cache_size: int = 50 * 1024 * 1024
    gcnArchName: str = "NVIDIA"
    uuid: str = "00000000-0000-0000-0000-000000000000"


DEVICE_NAME = "pytest-vram simulated CUDA device"


# ---------------------------------------------------------------------------------------------
# Function mode: device arguments, tensor moves and CUDA's autocast lists
# ---------------------------------------------------------------------------------------------


def _tensor_to(
    on_device: Callable[[torch.Tensor], bool], func: Callable, args: tuple, kwargs: dict
) -> Any:
    to_cuda = False
    if len(args) > 1 and is_cuda_device(args[1]):
        args = (args[0], _CPU, *args[2:])
        to_cuda = True
    device = kwargs.get("device")
    if device is not None and is_cuda_device(device):
        kwargs["device"] = _CPU
        to_cuda = True
    # A host tensor made before the simulation moves to the device: a new, counted copy.
    if to_cuda and not on_device(args[0]) and len(args) < 5:
        kwargs.setdefault("copy", True)
    return func(*args, **kwargs)


def _tensor_cuda(
    on_device: Callable[[torch.Tensor], bool], func: Callable, args: tuple, kwargs: dict
) -> Any:
    tensor = args[0]
    non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    memory_format = kwargs.get("memory_format", torch.preserve_format)
    return tensor.to(
        _CPU,
        non_blocking=non_blocking,
        copy=not on_device(tensor),
        memory_format=memory_format,
    )


def _tensor_format(func: Callable, args: tuple, kwargs: dict) -> Any:
    # f"{loss:.4f}" reads the value, as it does on a real tensor: a constant formats, anything
    # else raises FakeTensorMode's "needs values" error rather than a TypeError.
    tensor, spec = args[0], args[1] if len(args) > 1 else kwargs.get("format_spec", "")
    if spec and isinstance(tensor, FakeTensor) and tensor.dim() == 0:
        return format(tensor.item(), spec)
    return func(*args, **kwargs)


def _returns_self(func: Callable, args: tuple, kwargs: dict) -> Any:
    return args[0]


def _returns_false(func: Callable, args: tuple, kwargs: dict) -> Any:
    return False


def _is_fake(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, FakeTensor)


def _special_methods(on_device: Callable[[torch.Tensor], bool]) -> dict[Callable, Callable]:
    tensor = torch.Tensor
    return {
        tensor.to: functools.partial(_tensor_to, on_device),
        tensor.cuda: functools.partial(_tensor_cuda, on_device),
        tensor.__format__: _tensor_format,
        # Pinned host memory needs a CUDA runtime; on the simulated device it is plain memory.
        tensor.pin_memory: _returns_self,
        tensor.is_pinned: _returns_false,
    }


_FP32, _FP32_DTYPE, _LOWER, _PROMOTE = "fp32", "fp32 dtype", "lower", "promote"


def _autocast_policies() -> dict[Callable, str]:
    """CUDA autocast's op lists (ATen's autocast_mode.cpp) where they differ from the CPU's."""
    F = nn.functional
    T = torch.Tensor
    linalg = torch.linalg
    table: dict[Callable, str] = {}

    def add(policy: str, *funcs: Callable | None) -> None:
        for func in funcs:
            if func is not None:
                table[func] = policy

    def both(*names: str) -> list[Callable | None]:
        return [f for name in names for f in (getattr(torch, name, None), getattr(T, name, None))]

    add(
        _FP32,
        *both(
            "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
            "reciprocal", "rsqrt", "sinh", "tan", "pow", "norm", "dist", "renorm", "logsumexp",
            "cosine_similarity", "cdist", "layer_norm", "group_norm", "rms_norm",
        ),
        T.__pow__, T.__rpow__,
        F.softplus, F.layer_norm, F.group_norm, getattr(F, "rms_norm", None),
        F.cosine_similarity, F.poisson_nll_loss, F.cosine_embedding_loss, F.nll_loss,
        F.hinge_embedding_loss, F.kl_div, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.mse_loss,
        F.margin_ranking_loss, F.multilabel_margin_loss, F.soft_margin_loss,
        F.triplet_margin_loss, F.multi_margin_loss, F.binary_cross_entropy_with_logits,
        F.pdist, F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear,
    )  # fmt: skip
    add(
        _FP32_DTYPE,
        *both("softmax", "log_softmax", "cumsum", "cumprod", "prod", "sum"),
        F.softmax, F.log_softmax, linalg.vector_norm, linalg.matrix_norm,
    )  # fmt: skip
    add(
        _LOWER,
        *both("addmv", "addr", "mv", "chain_matmul"),
        torch.einsum, linalg.multi_dot, linalg.vecdot,
    )  # fmt: skip
    add(
        _PROMOTE,
        *both("addcdiv", "addcmul", "atan2", "cross", "dot", "vdot", "index_put", "tensordot",
              "scatter_add"),
        F.bilinear,
    )  # fmt: skip
    return table


def _map_tensors(value: Any, cast: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return cast(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(cast(v) if isinstance(v, torch.Tensor) else v for v in value)
    return value


def _tensors(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _eligible(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and tensor.dtype != torch.float64


def _autocast_call(policy: str, func: Callable, args: tuple, kwargs: dict) -> Any:
    if policy == _FP32_DTYPE:
        first = next(_tensors(args, kwargs), None)
        has_dtype = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)
        if first is not None and _eligible(first) and not has_dtype:
            kwargs["dtype"] = torch.float32
        return func(*args, **kwargs)
    if policy == _FP32:
        target = torch.float32
        wanted = {torch.float16, torch.bfloat16}
    elif policy == _LOWER:
        target = _get_autocast_dtype("cpu")
        wanted = {torch.float32, torch.float16, torch.bfloat16} - {target}
    else:
        dtypes = {t.dtype for t in _tensors(args, kwargs) if _eligible(t)}
        if torch.float32 not in dtypes or len(dtypes) < 2:
            return func(*args, **kwargs)
        target = torch.float32
        wanted = {torch.float16, torch.bfloat16}

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(target) if tensor.dtype in wanted else tensor

    args = tuple(_map_tensors(a, cast) for a in args)
    kwargs = {k: _map_tensors(v, cast) for k, v in kwargs.items()}
    return func(*args, **kwargs)


# The wrapper torch puts around every optimizer's step: its frame tells that a step runs.
_STEP_WRAPPER_CODE = _optimizer.Optimizer.profile_hook_step(lambda: None).__code__
_HOST_FACTORIES = frozenset(
    {torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.zeros, torch.ones, torch.full,
     torch.empty}
)  # fmt: skip
# The originals: computing, the names in torch may be replaced by wrappers (cudaremap).
_COPYING_FACTORIES = (torch.tensor, torch.as_tensor)


def _stepping_optimizer() -> Any:
    """The optimizer whose ``step`` is running on this thread, if one is."""
    frame = sys._getframe(2)
    for _ in range(64):
        if frame is None:
            return None
        if frame.f_code is _STEP_WRAPPER_CODE:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


def _host_scalar(func: Callable, args: tuple, kwargs: dict | None) -> bool:
    """Whether ``func`` makes one of an optimizer's own host tensors (AdamW's ``step``).

    For CUDA parameters that are neither ``capturable`` nor ``fused``, torch keeps such
    tensors on the host: made inside ``step`` with no device or the CPU, while the default
    device is not CUDA. Capturable and fused optimizers put them on the parameters' device,
    which is ``cpu`` on the simulated device too, so their factories are left alone.
    """
    device = kwargs.get("device") if kwargs else None
    if device is not None and is_cuda_device(device):
        return False
    if func in _COPYING_FACTORIES and args and isinstance(args[0], torch.Tensor):
        return False
    if torch.get_default_device().type == "cuda":
        return False
    optimizer = _stepping_optimizer()
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list):
        return False
    return not any(group.get("capturable") or group.get("fused") for group in groups)


class CudaRemapMode(TorchFunctionMode):
    """Sends CUDA device arguments to the fake ``cpu`` device and applies CUDA autocast lists.

    Only the functions a test calls reach a function mode (what they call in turn does not),
    which is all that device arguments need; for autocast it means the corrections apply to the
    functions called directly, while CPU autocast, underneath, casts everything else. With
    ``host_memory``, a context in which the device counts nothing, an optimizer's own host
    tensors are made in it.
    """

    def __init__(
        self,
        on_device: Callable[[torch.Tensor], bool] = _is_fake,
        host_memory: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        super().__init__()
        self._special = _special_methods(on_device)
        self._autocast = _autocast_policies()
        self._host_memory = host_memory

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if (
            func in _HOST_FACTORIES
            and self._host_memory is not None
            and _host_scalar(func, args, kwargs)
        ):
            with self._host_memory():
                return func(*args, **(kwargs or {}))
        if kwargs:
            device = kwargs.get("device")
            if device is not None and is_cuda_device(device):
                kwargs = {**kwargs, "device": _CPU}
            if kwargs.get("pin_memory"):
                kwargs = {**kwargs, "pin_memory": False}
        else:
            kwargs = {}
        special = self._special.get(func)
        if special is not None:
            return special(func, args, dict(kwargs))
        policy = self._autocast.get(func)
        if policy is not None and _is_autocast_enabled("cpu"):
            return _autocast_call(policy, func, args, dict(kwargs))
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Replacements for torch functions and methods
# ---------------------------------------------------------------------------------------------


def _device_context_torch_function(
    self: Any, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
) -> Any:
    # torch.device("cuda") as a context manager sits at the bottom of the function-mode stack
    # and adds its device after every other mode has run: remap it here.
    kwargs = kwargs or {}
    if func in _device._device_constructors() and kwargs.get("device") is None:
        kwargs["device"] = _CPU if self.device.type == "cuda" else self.device
    return func(*args, **kwargs)


class _Converted(threading.local):
    #: During one ``Module._apply``: per real parameter converted, (it, its fake one).
    params: dict[int, tuple[nn.Parameter, nn.Parameter]] | None = None


_converted = _Converted()


def _module_apply(self: nn.Module, fn: Callable, recurse: bool = True) -> nn.Module:
    """``Module._apply`` for fake tensors, whose swap the stock version cannot do.

    A parameter whose conversion returns itself stays as it is; a fake parameter converted to
    another fake keeps its identity (its data is replaced, as PyTorch does by default), so that
    an optimizer made before ``.to()`` still holds it; a real parameter becomes a new fake one,
    the same one wherever the module tree holds it (tied weights stay tied: one copy, as on a
    GPU, where the parameter keeps its identity).
    """
    if _converted.params is not None:
        return _apply_converting(self, fn, recurse, _converted.params)
    _converted.params = {}
    try:
        return _apply_converting(self, fn, recurse, _converted.params)
    finally:
        _converted.params = None


def _apply_converting(
    self: nn.Module,
    fn: Callable,
    recurse: bool,
    converted: dict[int, tuple[nn.Parameter, nn.Parameter]],
) -> nn.Module:
    if recurse:
        for module in self.children():
            module._apply(fn)
    for key, param in self._parameters.items():
        if param is None:
            continue
        done = converted.get(id(param))
        if done is not None and done[0] is param:
            self._parameters[key] = done[1]
            continue
        with torch.no_grad():
            applied = fn(param)
        grad = param.grad
        if applied is not param:
            # A fake tensor's device is a Python attribute that ``.data =`` would not update.
            if (
                isinstance(param, FakeTensor)
                and isinstance(applied, FakeTensor)
                and param.fake_device == applied.fake_device
            ):
                param.data = applied
            else:
                original = param
                param = nn.Parameter(applied, requires_grad=param.requires_grad)
                self._parameters[key] = param
                converted[id(original)] = (original, param)
        if grad is not None:
            with torch.no_grad():
                grad_applied = fn(grad)
            if grad_applied is not grad:
                param.grad = grad_applied
    for key, buf in self._buffers.items():
        if buf is not None:
            self._buffers[key] = fn(buf)
    return self


def _autocast_init(original: Callable) -> Callable:
    def __init__(
        self: Any,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        # Computing without the function mode, a CUDA autocast enters it (cudaremap).
        self._pytest_vram_cuda = isinstance(device_type, str) and device_type == "cuda"
        if self._pytest_vram_cuda:
            # CUDA's default low precision is float16, the CPU's bfloat16.
            dtype = _get_autocast_dtype("cuda") if dtype is None else dtype
            device_type = "cpu"
        original(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    return __init__


def _cuda_to_cpu_query(original: Callable) -> Callable:
    def query(device_type: str | None = None, *args: Any) -> Any:
        if device_type is None or device_type == "cuda":
            device_type = "cpu"
        return original(device_type, *args)

    return query


def _grad_scaler_step(
    self: Any, optimizer: torch.optim.Optimizer, optimizer_state: dict, *args: Any, **kwargs: Any
) -> Any:
    # Fake gradients have no values to be inf or NaN: always take the step.
    return optimizer.step(*args, **kwargs)


class _Stream:
    """A CUDA stream on a device that computes nothing: every wait is already over."""

    device = torch.device("cuda", 0)
    device_index = 0
    device_type = 1
    stream_id = 0
    cuda_stream = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return False

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stream)

    def __hash__(self) -> int:
        return 0


class _Event:
    """A CUDA event on a device that computes nothing: no time passes between two of them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


class _DeviceGuard:
    """``torch.cuda.device(i)``: there is one simulated device, so selecting it changes nothing."""

    def __init__(self, device: Any = None) -> None:
        self.idx = 0

    def __enter__(self) -> _DeviceGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __call__(self, func: Callable) -> Callable:
        return func


_STREAM = _Stream()
_MISSING = object()
_INHERITED = object()  # a class attribute set over an inherited one: restoring deletes it


# The simulated device's tensors are CPU tensors, drawn from the CPU generator: CUDA's random
# state is that generator's, so fork_rng, torch.compile and checkpointing, which save and
# restore both, restore the one that was used.
def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.default_generator.get_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.default_generator.set_state(new_state)


def _manual_seed(seed: int) -> None:
    # Not torch.manual_seed, which seeds the CUDA generators in turn, that is: this.
    torch.default_generator.manual_seed(int(seed))


_RNG_FUNCTIONS: dict[str, Callable] = {
    "get_rng_state": _get_rng_state,
    "set_rng_state": _set_rng_state,
    "get_rng_state_all": lambda: [_get_rng_state()],
    "set_rng_state_all": lambda new_states: _set_rng_state(next(iter(new_states))),
    "manual_seed": _manual_seed,
    "manual_seed_all": _manual_seed,
    "seed": lambda: torch.default_generator.seed(),
    "seed_all": lambda: torch.default_generator.seed(),
    "initial_seed": lambda: torch.default_generator.initial_seed(),
}


def _pin_nothing(data: Any, device: Any = None) -> Any:
    return data


# transformers asks is_tracing(tensor), which is True for any FakeTensor, and then takes the
# path of a traced graph: an explicit causal mask a real run never makes, no packed-sequence
# check. A real run's answer is False; the values it then reads are the simulated device's
# known values, or a needs-values error (computed by values on demand).
_TRANSFORMERS_IMPORT_UTILS = "transformers.utils.import_utils"


def _not_a_fake_tensor(x: Any) -> bool:
    return False


def _default_device_context() -> Any:
    """The context ``torch.set_default_device`` entered on this thread, if any."""
    holder = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)
    return getattr(holder, "device_context", None)


class VirtualCuda:
    """Installs and removes the virtual CUDA device around one simulated test.

    Shape-only (the default), tensors are fake and a tensor is on the device when it is fake;
    ``install(computing=True)`` serves a test that runs on real CPU tensors, where a tensor is
    on the device when the simulated device counts its storage, and the parts that only fake
    tensors need (a module's parameter swap, a gradient scaler that cannot read infs) stay
    PyTorch's own.
    """

    def __init__(self, device: SimulatedDevice) -> None:
        self._device = device
        host_memory = getattr(device, "host_memory", None)
        self._modes = {
            False: CudaRemapMode(host_memory=host_memory),
            True: CudaRemapMode(on_device=device.counted, host_memory=host_memory),
        }
        self._mode = self._modes[False]
        self._host_memory = host_memory
        # Computing on a build without CUDA: devices are remapped below Python (cudaremap).
        self._below_python: bool | None = None
        self._remapping_below = False
        self._made: dict[bool, list[tuple[object, str, object]]] = {}
        self._made_below: list[tuple[object, str, object]] | None = None
        self._saved: list[tuple[object, str, object]] = []
        self._default_device: Any = None
        self._stance: Any = _MISSING
        self._finder: PatchOnImport | None = None
        self.installed = False

    def install(self, computing: bool = False) -> None:
        if self.installed:
            return
        self._saved = []
        self._default_device = _default_device_context()
        self._mode = self._modes[computing]
        below = computing and self._can_remap_below_python()
        try:
            for owner, name, value in self._replacements_for(computing):
                self._patch(owner, name, value)
            self._force_eager()
            if not computing:
                self._answer_not_tracing()
            if below:
                for owner, name, value in self._below_python_replacements():
                    self._shadow(owner, name, value)
                cudaremap.activate()
                self._remapping_below = True
            else:
                self._mode.__enter__()
        except BaseException:
            self._restore()
            raise
        self.installed = True

    def _replacements_for(self, computing: bool) -> list[tuple[object, str, object]]:
        # Made once (every test of a session installs the same), while nothing is installed:
        # the originals they wrap are PyTorch's own.
        made = self._made.get(computing)
        if made is None:
            made = self._made[computing] = list(self._replacements(computing))
        return made

    def _below_python_replacements(self) -> list[tuple[object, str, object]]:
        made = self._made_below
        if made is None:
            made = self._made_below = list(
                cudaremap.replacements(
                    _special_methods(self._device.counted),
                    _HOST_FACTORIES,
                    _host_scalar,
                    self._host_memory,
                    self._modes[True],
                )
            )
        return made

    def _can_remap_below_python(self) -> bool:
        if self._below_python is None:
            self._below_python = cudaremap.available()
        return self._below_python

    def _answer_not_tracing(self) -> None:
        """Make transformers' ``is_tracing(tensor)`` answer as in a real run (False)."""

        def patch(module: Any) -> None:
            self._patch(module, "is_fake_tensor", _not_a_fake_tensor)

        module = sys.modules.get(_TRANSFORMERS_IMPORT_UTILS)
        if module is not None:
            patch(module)
            return
        finder = PatchOnImport(_TRANSFORMERS_IMPORT_UTILS, patch)
        finder.install()
        self._finder = finder

    def _force_eager(self) -> None:
        """Run ``torch.compile``'d code eagerly while the test runs.

        Compiled for fake tensors, Inductor's kernels would write through fake data pointers
        (a segmentation fault); compiled for the CPU, they would allocate behind the
        dispatcher, unseen, so that a test's figures would depend on whether it computed.
        Eager, the same ops run and are counted either way. Dynamo is not imported for it:
        a test that compiles imports it, through torch.compile, which calls this again.
        """
        if self._stance is not _MISSING:
            return
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        stance = getattr(eval_frame, "DynamoStance", None)
        if stance is None:
            return
        # Not inside a compiled region, where the stance cannot change.
        with contextlib.suppress(RuntimeError, TypeError, AttributeError):
            self._stance = eval_frame._set_stance(stance(stance="force_eager"))

    def _restore_stance(self) -> None:
        stance, self._stance = self._stance, _MISSING
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        if stance is not _MISSING and eval_frame is not None:
            with contextlib.suppress(RuntimeError, AttributeError):
                eval_frame._set_stance(stance)

    def _compile(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def compile(*args: Any, **kwargs: Any) -> Any:
            compiled = original(*args, **kwargs)
            self._force_eager()
            return compiled

        return compile

    def uninstall(self) -> None:
        if not self.installed:
            return
        self.installed = False
        try:
            if self._remapping_below:
                self._remapping_below = False
                cudaremap.deactivate()
            else:
                self._mode.__exit__(None, None, None)
        finally:
            self._restore()
            self._restore_stance()
            # A test that made "cuda" the default device would leave it to every later test,
            # which on a machine without CUDA cannot make a tensor any more.
            context = _default_device_context()
            if (
                context is not None
                and context is not self._default_device
                and context.device.type == "cuda"
            ):
                previous = self._default_device
                torch.set_default_device(None if previous is None else previous.device)
                if previous is None:
                    # torch 2.6 and older leave device_context = None behind, on which their
                    # own get_default_device() fails; without the attribute it answers cpu.
                    holder = torch._GLOBAL_DEVICE_CONTEXT
                    if getattr(holder, "device_context", _MISSING) is None:
                        del holder.device_context

    def _patch(self, owner: object, name: str, value: object) -> None:
        # Only what exists in this torch version (and, on a class, in the class itself) is
        # replaced, so that restoring puts back exactly what was there and adds no names.
        if isinstance(owner, type):
            original = owner.__dict__.get(name, _MISSING)
        else:
            original = getattr(owner, name, _MISSING)
        if original is _MISSING:
            return
        self._saved.append((owner, name, original))
        setattr(owner, name, value)

    def _shadow(self, owner: object, name: str, value: object) -> None:
        """Set ``name`` on ``owner`` (a class may inherit it), as restoring will undo."""
        if isinstance(owner, type) and name not in owner.__dict__:
            if not hasattr(owner, name):
                return
            self._saved.append((owner, name, _INHERITED))
            setattr(owner, name, value)
        else:
            self._patch(owner, name, value)

    def _restore(self) -> None:
        finder, self._finder = self._finder, None
        if finder is not None:
            finder.remove()
        if self._remapping_below:
            self._remapping_below = False
            cudaremap.deactivate()
        while self._saved:
            owner, name, original = self._saved.pop()
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)

    def _replacements(self, computing: bool) -> Iterator[tuple[object, str, object]]:
        dev = self._device
        cuda = torch.cuda
        memory = torch.cuda.memory

        # The GPU model simulated decides the capability code checks (9.0 by default).
        capability = getattr(dev, "gpu", None)
        major, minor = (9, 0) if capability is None else (capability.major, capability.minor)

        def properties(device: Any = None) -> SimulatedDeviceProperties:
            return SimulatedDeviceProperties(
                name=DEVICE_NAME, total_memory=dev.device_total(), major=major, minor=minor
            )

        def mem_get_info(device: Any = None) -> tuple[int, int]:
            total = dev.device_total()
            return max(total - (dev.reserved() or 0), 0), total

        def memory_stats(device: Any = None) -> OrderedDict[str, Any]:
            flat: list[tuple[str, Any]] = []

            def walk(prefix: str, value: Any) -> None:
                if isinstance(value, dict):
                    for key, item in value.items():
                        walk(f"{prefix}.{key}" if prefix else key, item)
                else:
                    flat.append((prefix, value))

            walk("", dev.memory_stats_nested())
            return OrderedDict(sorted(flat))

        def reset_peak(device: Any = None) -> None:
            dev.reset_peak()

        def empty_cache() -> None:
            dev.release_cache()

        functions: dict[str, Callable] = {
            "is_available": lambda: True,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "set_device": lambda device: None,
            "synchronize": lambda device=None: None,
            "init": lambda: None,
            "is_bf16_supported": lambda including_emulation=True: True,
            "get_device_name": lambda device=None: DEVICE_NAME,
            "get_device_capability": lambda device=None: (major, minor),
            "get_device_properties": properties,
            "mem_get_info": mem_get_info,
            "memory_allocated": lambda device=None: dev.allocated(),
            "max_memory_allocated": lambda device=None: dev.peak_allocated(),
            "memory_reserved": lambda device=None: dev.reserved() or 0,
            "max_memory_reserved": lambda device=None: dev.peak_reserved() or 0,
            "memory_cached": lambda device=None: dev.reserved() or 0,
            "max_memory_cached": lambda device=None: dev.peak_reserved() or 0,
            "reset_peak_memory_stats": reset_peak,
            "reset_max_memory_allocated": reset_peak,
            "reset_max_memory_cached": reset_peak,
            "reset_accumulated_memory_stats": lambda device=None: None,
            "memory_stats": memory_stats,
            "memory_stats_as_nested_dict": lambda device=None: dev.memory_stats_nested(),
            "memory_summary": lambda device=None, abbreviated=False: dev.memory_summary(),
            "empty_cache": empty_cache,
            "current_stream": lambda device=None: _STREAM,
            "default_stream": lambda device=None: _STREAM,
            "stream": lambda stream=None: contextlib.nullcontext(stream),
            "set_stream": lambda stream: None,
            "is_current_stream_capturing": lambda: False,
            "Stream": _Stream,
            "Event": _Event,
            "device": _DeviceGuard,
            **_RNG_FUNCTIONS,
        }
        random = torch.cuda.random
        for name, value in functions.items():
            yield cuda, name, value
            if name in memory.__dict__:
                yield memory, name, value
            if name in random.__dict__:
                yield random, name, value

        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None:
            yield accelerator, "is_available", lambda: True
            yield accelerator, "device_count", lambda: 1
            yield accelerator, "current_device_index", lambda: 0
            yield accelerator, "set_device_index", lambda device: None
            yield accelerator, "synchronize", lambda device=None: None
            yield accelerator, "current_stream", lambda device=None: _STREAM
            yield (
                accelerator,
                "current_accelerator",
                lambda check_available=False: torch.device("cuda"),
            )
            accelerator_memory = {
                "empty_cache": empty_cache,
                "memory_allocated": functions["memory_allocated"],
                "max_memory_allocated": functions["max_memory_allocated"],
                "memory_reserved": functions["memory_reserved"],
                "max_memory_reserved": functions["max_memory_reserved"],
                "reset_peak_memory_stats": reset_peak,
                "memory_stats": memory_stats,
                "get_memory_info": mem_get_info,
            }
            for owner in (accelerator, getattr(accelerator, "memory", None)):
                if owner is not None:
                    for name, value in accelerator_memory.items():
                        if name in owner.__dict__:
                            yield owner, name, value

        yield torch, "compile", self._compile(torch.compile)
        if not computing:
            yield nn.Module, "_apply", _module_apply
            # trunc_normal_ redraws on values; shape-only, as often as a real run most likely
            # does (every call form of it ends here).
            init = torch.nn.init
            yield init, "_no_grad_trunc_normal_", trunc_normal_decided(init._no_grad_trunc_normal_)
        yield _device.DeviceContext, "__torch_function__", _device_context_torch_function

        autocast = torch.amp.autocast_mode.autocast
        yield autocast, "__init__", _autocast_init(autocast.__init__)
        yield torch, "is_autocast_enabled", _cuda_to_cpu_query(_is_autocast_enabled)
        yield torch, "get_autocast_dtype", _cuda_to_cpu_query(_get_autocast_dtype)

        # On CUDA, optimizers default to their foreach implementations, whose temporaries
        # (a whole copy of exp_avg_sq for Adam) set the step's peak.
        optimizer = _optimizer
        supported = optimizer._get_foreach_kernels_supported_devices
        yield (
            optimizer,
            "_get_foreach_kernels_supported_devices",
            lambda: [*supported(), "cpu"],
        )
        yield (
            optimizer,
            "_foreach_supported_types",
            [*optimizer._foreach_supported_types, FakeTensor],
        )
        if not computing:
            yield torch.amp.grad_scaler.GradScaler, "_maybe_opt_step", _grad_scaler_step
        # Pinning needs a CUDA runtime; a DataLoader's pinning thread does not see the
        # function mode that makes Tensor.pin_memory a no-op.
        yield pin_memory_module, "pin_memory", _pin_nothing
