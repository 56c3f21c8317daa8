"""``torch.compile`` on the simulated device: Dynamo compiles, Inductor's graphs run op by op.

A test that checks what ``torch.compile`` made (graph counts, graph breaks, a compiled
function's guards) sees Dynamo's own work, shape-only and computing. Inductor's kernels are
another matter: on fake tensors they would write through fake data pointers (a crash), and on
the CPU they allocate their buffers behind the dispatcher, unseen by a dispatch mode, so that a
test's figures would depend on whether it compiled. While a test runs, Inductor's entry point
(``torch._inductor.compile_fx.compile_fx``, which both ``torch.compile``'s default backend and
the registered ``"inductor"`` backend call) hands back the graph's own ``forward``, as the
``"eager"`` backend does: its ops run through the dispatcher and count as eager code does.

Neither Dynamo nor Inductor is imported for it: a test that compiles imports them, and
Inductor's module is patched when it is first imported. The simulated device's modes are kept
out of Dynamo (:mod:`~pytest_vram.backends.dynamoskip`): the eager parts of compiled code run
through them.
"""

from __future__ import annotations

import sys
from typing import Any

from pytest_vram.backends.dynamoskip import keep_out_of_dynamo
from pytest_vram.backends.sim.fakemode import SimFakeTensorMode
from pytest_vram.backends.sim.patches import PatchSet
from pytest_vram.backends.sim.remapmode import CudaRemapMode, HostCudaRemapMode
from pytest_vram.importhook import PatchOnImport

__all__ = ["InductorRunsEagerly"]

_INDUCTOR = "torch._inductor.compile_fx"


def _graph_forward(model: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
    """What Inductor's ``compile_fx`` makes of a graph while a simulated test runs."""
    return model.forward


class InductorRunsEagerly:
    """Replaces Inductor's ``compile_fx`` through ``patches`` from :meth:`start` (now, or when
    Inductor is first imported) until the patches are restored and :meth:`stop` is called."""

    def __init__(self, patches: PatchSet) -> None:
        self._patches = patches
        self._finder: PatchOnImport | None = None

    def start(self) -> None:
        module = sys.modules.get(_INDUCTOR)
        if module is not None:
            self._patch(module)
            return
        finder = PatchOnImport(_INDUCTOR, self._patch)
        finder.install()
        self._finder = finder

    def _patch(self, module: Any) -> None:
        self._patches.replace(module, "compile_fx", _graph_forward)

    def stop(self) -> None:
        finder, self._finder = self._finder, None
        if finder is not None:
            finder.remove()


keep_out_of_dynamo(
    SimFakeTensorMode.__torch_dispatch__,
    CudaRemapMode.__torch_function__,
    HostCudaRemapMode.__torch_function__,
)
