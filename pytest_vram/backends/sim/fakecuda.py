"""A virtual CUDA device for code that runs on fake ``cpu`` tensors.

While a simulated test runs, :class:`VirtualCuda` makes code written for CUDA work unchanged on
a CPU-only build of PyTorch:

- ``device="cuda"`` (``"cuda:0"``, ``torch.device("cuda")``, ``0``) in any torch function,
  ``Tensor.to("cuda")``, ``Tensor.cuda()``, ``Module.to("cuda")``, ``Module.cuda()`` and the
  ``torch.device("cuda")`` context manager put tensors on the (fake) ``cpu`` device, and the
  test's code sees them on ``cuda:0`` (:mod:`~pytest_vram.backends.sim.remapmode`,
  :mod:`~pytest_vram.backends.sim.presenting`, :mod:`~pytest_vram.backends.sim.moduleapply`;
  computing, for a test that does not see CUDA, :mod:`~pytest_vram.backends.sim.cudaremap`);
- ``torch.autocast("cuda", dtype)`` runs as CPU autocast, corrected so that the functions a test
  calls follow CUDA's autocast op lists (:mod:`~pytest_vram.backends.sim.autocast`);
- ``torch.cuda.*`` (and ``torch.accelerator.*``) device and memory queries answer from the
  simulated device (:mod:`~pytest_vram.backends.sim.torchcuda`); optimizers default to the
  ``foreach`` implementations they use on CUDA; ``GradScaler.step`` always steps, since the
  simulated device has no values to check for infs.
- an optimizer's own host tensors (AdamW's ``step`` counters) are made uncounted, as host
  memory (:mod:`~pytest_vram.backends.sim.hostscalars`), and the tensors a test keeps on the
  host are told from the device's (:mod:`~pytest_vram.backends.sim.hosttensors`), counted or
  not as ``--vram-sim-host-tensors`` says; transformers' ``is_tracing(tensor)``
  answers False for fake tensors, as in a real run;
- shape-only, TorchScript (scripted or traced code, tracing) is refused before it runs on fake
  tensors, where it would crash the process (:mod:`~pytest_vram.backends.sim.torchscript`);
- ``torch.cuda.memory._record_memory_history`` and ``_snapshot`` record and answer from the
  simulated allocator (:mod:`~pytest_vram.backends.sim.memhistory`).
- ``torch.compile`` compiles, and Inductor's graphs run op by op, counted as eager code is
  (:mod:`~pytest_vram.backends.sim.compiled`).

Everything is patched in :meth:`VirtualCuda.install` and put back, object for object, in
:meth:`VirtualCuda.uninstall` (a :class:`~pytest_vram.backends.sim.patches.PatchSet`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.amp.autocast_mode
import torch.amp.grad_scaler
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.optim import optimizer as torch_optimizer
from torch.overrides import _get_current_function_mode_stack
from torch.utils import _device
from torch.utils.data._utils import pin_memory as pin_memory_module

from pytest_vram.backends.sim import cudaremap
from pytest_vram.backends.sim.autocast import (
    autocast_init,
    cuda_query_as_cpu,
    real_get_autocast_dtype,
    real_is_autocast_enabled,
)
from pytest_vram.backends.sim.compiled import InductorRunsEagerly
from pytest_vram.backends.sim.hostscalars import HOST_FACTORIES, HostScalars
from pytest_vram.backends.sim.memhistory import MemoryHistory
from pytest_vram.backends.sim.moduleapply import module_apply
from pytest_vram.backends.sim.ops import trunc_normal_decided
from pytest_vram.backends.sim.patches import PatchSet
from pytest_vram.backends.sim.presenting import presented_devices
from pytest_vram.backends.sim.remapmode import (
    CudaRemapMode,
    HostCudaRemapMode,
    special_methods,
)
from pytest_vram.backends.sim.savedhooks import hooks_under
from pytest_vram.backends.sim.torchcuda import SimulatedDevice, cuda_replacements, record_stream
from pytest_vram.backends.sim.torchscript import shape_only_replacements as no_torchscript
from pytest_vram.importhook import PatchOnImport

__all__ = ["VirtualCuda"]

_CPU = torch.device("cpu")
_MISSING = object()


def _device_context_torch_function(
    self: Any, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
) -> Any:
    # torch.device("cuda") as a context manager adds its device to a factory's call. Entered
    # in the test, above the remapping mode, the mode then sees the device named; a default
    # device set before the test sits below the mode, and adds it after the mode has run:
    # remapped here.
    kwargs = kwargs or {}
    if func in _device._device_constructors() and kwargs.get("device") is None:
        device = self.device
        if device.type == "cuda" and not _remapped_below(_get_current_function_mode_stack()):
            device = _CPU
        kwargs["device"] = device
    return func(*args, **kwargs)


def _remapped_below(stack: list[Any]) -> bool:
    return any(isinstance(mode, CudaRemapMode) for mode in stack)


def _grad_scaler_step(
    self: Any, optimizer: torch.optim.Optimizer, optimizer_state: dict, *args: Any, **kwargs: Any
) -> Any:
    # Fake gradients have no values to be inf or NaN: always take the step.
    return optimizer.step(*args, **kwargs)


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
        #: Which factory calls make an optimizer's host scalars, made in ``host_memory``.
        self._host_scalars = HostScalars()
        host_scalar = self._host_scalars.made_by
        #: The tensors a test keeps on the host (None on a device that does not tell them
        #: from its own).
        self._host = host = getattr(device, "host", None)
        make = CudaRemapMode if host is None else functools.partial(HostCudaRemapMode, host)
        self._modes = {
            False: make(host_memory=host_memory, host_scalar=host_scalar),
            True: make(on_device=device.counted, host_memory=host_memory, host_scalar=host_scalar),
        }
        self._mode = self._modes[False]
        self._host_memory = host_memory
        #: The test's code sees where each tensor is.
        self._presented = (
            {}
            if host is None
            else {
                computing: list(presented_devices(mode.on_device))
                for computing, mode in self._modes.items()
            }
        )
        # Computing on a build without CUDA: devices are remapped below Python (cudaremap).
        self._below_python: bool | None = None
        self._remapping_below = False
        #: Whether cudaremap's CUDA kernels are active (computing on a build without CUDA).
        self._cuda_kernels = False
        self._made: dict[bool, list[tuple[object, str, object]]] = {}
        self._made_below: list[tuple[object, str, object]] | None = None
        self._patches = PatchSet()
        self._default_device: Any = None
        #: torch.compile's Inductor hands back the graph to run op by op while a test runs.
        self._inductor = InductorRunsEagerly(self._patches)
        self._finder: PatchOnImport | None = None
        #: ``torch.cuda.memory``'s allocator history, recorded while a test asks for it.
        self._history = MemoryHistory(device)  # type: ignore[arg-type]
        self.installed = False

    def install(self, computing: bool = False) -> None:
        if self.installed:
            return
        self._default_device = _default_device_context()
        self._mode = self._modes[computing]
        below = computing and self._below_python_will_do() and self._can_remap_below_python()
        try:
            self._patches.replace_all(self._replacements_for(computing))
            # Tensor only inherits it, from a class of C that cannot be patched.
            self._patches.shadow(torch.Tensor, "record_stream", record_stream)
            for owner, name, value in () if below else self._presented.get(computing, ()):
                self._patches.shadow(owner, name, value)
            self._host_scalars.start()
            self._inductor.start()
            if not computing:
                self._answer_not_tracing()
            if computing and self._can_remap_below_python():
                # Under the function mode too: what allocates on cuda below Python (a custom
                # op's own factory, FSDP2's all-gather buffer) gets a CPU tensor.
                cudaremap.activate()
                self._cuda_kernels = True
            if below:
                for owner, name, value in self._below_python_replacements():
                    self._patches.shadow(owner, name, value)
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
                    special_methods(self._device.counted),
                    HOST_FACTORIES,
                    self._host_scalars.made_by,
                    self._host_memory,
                    self._modes[True],
                )
            )
        return made

    def _below_python_will_do(self) -> bool:
        """Whether the test needs no more than devices remapped: the function mode places
        every call, for the host tensors the device does not count and for the devices that
        code which sees CUDA reads; a test that does not see CUDA reads none."""
        host = self._host
        return host is None or (host.counts_host and not self._device.cuda_shown)

    def _can_remap_below_python(self) -> bool:
        if self._below_python is None:
            self._below_python = cudaremap.available()
        return self._below_python

    def _answer_not_tracing(self) -> None:
        """Make transformers' ``is_tracing(tensor)`` answer as in a real run (False)."""

        def patch(module: Any) -> None:
            self._patches.replace(module, "is_fake_tensor", _not_a_fake_tensor)

        module = sys.modules.get(_TRANSFORMERS_IMPORT_UTILS)
        if module is not None:
            patch(module)
            return
        finder = PatchOnImport(_TRANSFORMERS_IMPORT_UTILS, patch)
        finder.install()
        self._finder = finder

    def uninstall(self) -> None:
        if not self.installed:
            return
        self.installed = False
        try:
            if self._remapping_below:
                self._remapping_below = False
            else:
                self._mode.__exit__(None, None, None)
        finally:
            self._restore()
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

    def _restore(self) -> None:
        finder, self._finder = self._finder, None
        if finder is not None:
            finder.remove()
        self._host_scalars.stop()
        self._inductor.stop()
        self._history.stop()  # a recording lasts no longer than its test
        self._remapping_below = False
        if self._cuda_kernels:
            self._cuda_kernels = False
            cudaremap.deactivate()
        self._patches.restore()

    def _replacements(self, computing: bool) -> Iterator[tuple[object, str, object]]:
        yield from cuda_replacements(self._device)
        yield from self._history.replacements()
        if not computing:
            yield nn.Module, "_apply", module_apply
            # trunc_normal_ redraws on values; shape-only, as often as a real run most likely
            # does (every call form of it ends here).
            init = torch.nn.init
            yield init, "_no_grad_trunc_normal_", trunc_normal_decided(init._no_grad_trunc_normal_)
            # TorchScript on fake tensors crashes the process: refused, the test computes.
            yield from no_torchscript()
        yield _device.DeviceContext, "__torch_function__", _device_context_torch_function

        autocast = torch.amp.autocast_mode.autocast
        yield autocast, "__init__", autocast_init(autocast.__init__)
        yield torch, "is_autocast_enabled", cuda_query_as_cpu(real_is_autocast_enabled)
        yield torch, "get_autocast_dtype", cuda_query_as_cpu(real_get_autocast_dtype)
        # Set as they are read: Dynamo reads CUDA's autocast state before it compiles and sets
        # it back after, which would leave the CPU's dtype as CUDA's to the tests after.
        for setter in ("set_autocast_enabled", "set_autocast_dtype"):
            if hasattr(torch, setter):
                yield torch, setter, cuda_query_as_cpu(getattr(torch, setter))

        # On CUDA, optimizers default to their foreach implementations, whose temporaries
        # (a whole copy of exp_avg_sq for Adam) set the step's peak.
        optimizer = torch_optimizer
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
        yield from hooks_under(self._function_mode)

    def _function_mode(self) -> Any:
        """The function mode the running test is under; None where devices are remapped below
        Python."""
        return None if self._remapping_below else self._mode
