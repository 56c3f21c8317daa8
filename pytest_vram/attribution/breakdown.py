"""What was live at a test's peak, by category and by module.

The categories are those of ``torch.distributed._tools.mem_tracker.MemTracker``: a storage is
``parameters`` when it is a module's parameter, ``gradients`` when it is a parameter's
``.grad``, ``optimizer`` when it is in an optimizer's ``state``, ``activations`` when it was
allocated during the forward of a module (activation-checkpointing recomputation included), and
``temporaries`` otherwise; ``cublas_workspaces`` are the workspaces cuBLAS keeps for the
matrix multiplies of each thread (the simulated device names them); ``other`` is what none of
these explain (buffers, memory held from before the test that it never touched, and on the cpu
allocator counter what kernels allocate for themselves).

How: a listener on the storage tracker logs each allocation and free as it happens (an append
per event) with the module whose forward was running, and global module and optimizer hooks
note which storages are parameters, gradients and optimizer state. When the test's call ends
the log is replayed to the moment of the peak, and what was alive then is summed (the cpu
allocator counter's log, kept in C++, replays itself and hands back only that). Modules are
grouped as a model's top-level children (the items of a top-level ``ModuleList``, ``ModuleDict``
or ``Sequential`` each on its own), the largest first.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pytest_vram.record.figures import (
    CATEGORIES,
    category_figures,
    category_label,
    entry_categories,
)
from pytest_vram.units import format_delta, format_size

if TYPE_CHECKING:
    from pytest_vram.backends.cpu.allocatorlog import AllocatorLog
    from pytest_vram.backends.tracker import StorageTracker

# The category names and the figures an entry keeps of them belong to pytest_vram.record.figures;
# category_figures and entry_categories are handed on for the callers that import them here.
__all__ = [
    "CATEGORIES",
    "GLOBAL_HOOKS",
    "PeakBreakdown",
    "category_figures",
    "describe_breakdown",
    "describe_growth",
    "entry_categories",
]

#: How many modules a breakdown lists.
MODULES_SHOWN = 8

_FORWARD, _OPTIMIZER, _OUTSIDE = 1, 2, 0
# Which category a storage that is more than one of these is counted in: the lowest.
_RANK = {"parameters": 0, "gradients": 1, "optimizer": 2, "cublas_workspaces": 3, "other": 4}
# Where a broader-scoped fixture made in the test's setup allocated: classified as memory held
# from before the test is, since a later test that uses the fixture finds it so.
_HELD: tuple[int | None, str | None] = (None, None)


def describe_growth(current: Mapping[str, int], baseline: Mapping[str, int]) -> str:
    """``activations +9.69 MiB; parameters, gradients, optimizer unchanged``."""
    changed, unchanged = [], []
    for name in CATEGORIES:
        now, then = int(current.get(name, 0)), int(baseline.get(name, 0))
        if now != then:
            changed.append((now - then, name))
        elif now:
            unchanged.append(name)
    changed.sort(key=lambda item: -item[0])
    parts = [f"{category_label(name)} {format_delta(delta)}" for delta, name in changed]
    if unchanged:
        parts.append(f"{', '.join(map(category_label, unchanged))} unchanged")
    return "; ".join(parts) if parts else "every category unchanged"


def describe_breakdown(breakdown: Mapping[str, Any]) -> str:
    """``activations 40.00 MiB, parameters 12.76 MiB, ...; largest modules: blocks.0 ...``."""
    categories = breakdown.get("categories") or {}
    ordered = sorted(((int(v), k) for k, v in categories.items() if v), key=lambda item: -item[0])
    text = ", ".join(f"{category_label(name)} {format_size(size)}" for size, name in ordered)
    text = text or "nothing"
    modules = breakdown.get("modules") or []
    if modules:
        text += "; largest modules: " + ", ".join(
            f"{m['name']} {format_size(int(m['bytes']))}" for m in modules[:4]
        )
    return text


# torch._dynamo's OptimizedModule, by name: the hooks import no Dynamo.
_COMPILED_WRAPPER = "OptimizedModule"


def _never() -> bool:
    return False


def _nothing() -> None:
    pass


class _GlobalHooks:
    """The global module and optimizer hooks of the breakdowns that listen now.

    Registered for the first and removed after the last, unless held (:meth:`hold`): a session
    that breaks every test down keeps them between tests, where they return at once, since
    registering and removing four global hooks would cost a small test more than the rest of
    its categories.
    """

    def __init__(self) -> None:
        self.breakdowns: tuple[PeakBreakdown, ...] = ()
        self._handles: list[Any] = []
        self._held = False
        self._compiling: Callable[[], bool] = _never
        self._restore_ask: Callable[[], None] = _nothing

    def attach(self, breakdown: PeakBreakdown) -> None:
        if not self._handles:
            import torch.compiler
            from torch.nn.modules import module as nn_module
            from torch.optim import optimizer as optim

            self._compiling = torch.compiler.is_compiling

            # torch.compile(module) warns that global hooks fire an extra time for its
            # wrapper: these take the wrapper for its module, so only others' hooks count.
            asks = nn_module._has_any_global_hook
            nn_module._has_any_global_hook = self._others_have_global_hooks
            self._restore_ask = lambda: setattr(nn_module, "_has_any_global_hook", asks)
            self._handles = [
                nn_module.register_module_forward_pre_hook(self._pre_forward),
                nn_module.register_module_forward_hook(self._post_forward, always_call=True),
                # A model that runs only compiled meets no forward hook: its parameters are
                # known as they are set on their module.
                nn_module.register_module_parameter_registration_hook(self._registered),
                optim.register_optimizer_step_pre_hook(self._pre_step),
                optim.register_optimizer_step_post_hook(self._post_step),
            ]
        self.breakdowns = (*self.breakdowns, breakdown)

    def detach(self, breakdown: PeakBreakdown) -> None:
        self.breakdowns = tuple(b for b in self.breakdowns if b is not breakdown)
        if not self.breakdowns and not self._held:
            self._remove()

    def hold(self, held: bool) -> None:
        """Keep the hooks registered between breakdowns (True), until released (False)."""
        self._held = held
        if not held and not self.breakdowns:
            self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        restore, self._restore_ask = self._restore_ask, _nothing
        restore()

    def _others_have_global_hooks(self) -> bool:
        from torch.nn.modules import module as nn_module

        ours = (self._pre_forward, self._post_forward)
        return any(
            hook not in ours
            for hooks in (
                nn_module._global_backward_pre_hooks,
                nn_module._global_backward_hooks,
                nn_module._global_forward_pre_hooks,
                nn_module._global_forward_hooks,  # the flags' tables hold no hooks
            )
            for hook in hooks.values()
        )

    # Inside a graph torch.compile traces, the hooks do nothing: traced, they would end up in
    # the graph or break it, and the compiled code runs without them. The wrapper that
    # torch.compile(module) makes stands for its module, whose own call runs compiled.

    def _pre_forward(self, module: Any, args: Any) -> None:
        if self._compiling():
            return
        if type(module).__name__ == _COMPILED_WRAPPER:
            module = module._orig_mod
        for breakdown in self.breakdowns:
            breakdown._pre_forward(module, args)

    def _post_forward(self, module: Any, args: Any, output: Any) -> None:
        if self._compiling():
            return
        if type(module).__name__ == _COMPILED_WRAPPER:
            module = module._orig_mod
        for breakdown in self.breakdowns:
            breakdown._post_forward(module, args, output)

    def _registered(self, module: Any, name: str, param: Any) -> None:
        if param is None or not self.breakdowns or self._compiling():
            return
        for breakdown in self.breakdowns:
            breakdown._note_parameter(param, None)

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for breakdown in self.breakdowns:
            breakdown._pre_step(optimizer, args, kwargs)

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for breakdown in self.breakdowns:
            breakdown._post_step(optimizer, args, kwargs)


GLOBAL_HOOKS = _GlobalHooks()


class PeakBreakdown:
    """Logs a test's allocations on ``tracker`` and, from :meth:`result`, breaks its peak down.

    ``tracker`` is a storage tracker, or what offers its listeners the same (the cpu allocator
    counter's :class:`~pytest_vram.backends.cpu.allocatorlog.AllocatorLog`).
    :meth:`start` attaches the listener and the global hooks, :meth:`stop` removes them. With
    ``modules=False`` only the category totals are taken: no module is named, none listed.
    """

    def __init__(self, tracker: StorageTracker | AllocatorLog, modules: bool = True) -> None:
        self.tracker = tracker
        self.modules = modules
        # (bytes added, tag, size after; 0 when freed) for every event, in order.
        self._events: list[tuple[int, int | None, int]] = []
        # tag -> (phase, module unit) where it was allocated.
        self._where: dict[int, tuple[int | None, str | None]] = {}
        # Storages alive since before the test that a hook met: tag -> bytes.
        self._adopted: dict[int, int] = {}
        self._now: tuple[int | None, str | None] = (_OUTSIDE, None)
        # How deep in making broader-scoped fixtures, and the first event after the last one
        # was made: what making it cost is not the test's peak.
        self._making = 0
        self._peak_from = 0
        self._stack: list[Any] = []
        self._optimizer_depth = 0
        self._unit_of_module: dict[int, str] = {}
        self._unit_of_param: dict[int, str | None] = {}
        self._roots: list[weakref.ref[Any]] = []
        self._named: set[int] = set()
        self._hooked: set[int] = set()
        # tag -> (category, module unit) of each storage a hook met (see _know).
        self.known: dict[int, tuple[str, str | None]] = {}
        self._handles: list[Any] = []
        self._note_place: Any = None
        self._replay: Any = None

    # -- the tracker's listener -----------------------------------------------------------

    def allocated(self, tag: int, size: int, handle: Any) -> None:
        self._events.append((size, tag, size))
        self._where[tag] = self._now

    def resized(self, tag: int | None, old: int, new: int, handle: Any) -> None:
        self._events.append((new - old, tag, new))

    def freed(self, tag: int | None, size: int, handle: Any) -> None:
        self._events.append((-size, tag, 0))

    def adopted(self, tag: int, size: int, handle: Any) -> None:
        self._adopted[tag] = size

    def named(self, tag: int, name: str) -> None:
        # Memory of no module, a cuBLAS workspace (the one storage the simulated device
        # names): its own category, listed under its name.
        self._know(tag, "cublas_workspaces", name)

    def making_fixture(self, started: bool) -> None:
        self._making += 1 if started else -1
        self._set_now()
        if not self._making:  # the peak is looked for from here on
            if self._replay is None:
                self._peak_from = len(self._events)
            else:
                self.tracker.peak_from_here()

    # -- hooks ----------------------------------------------------------------------------

    def start(self) -> None:
        self.tracker.add_listener(self)
        # A source that learns where allocations are made only from us, and replays itself to
        # its peak (the allocator log).
        self._note_place = getattr(self.tracker, "note_place", None)
        self._replay = getattr(self.tracker, "live_at_peak", None)
        self._set_now()
        GLOBAL_HOOKS.attach(self)

    def stop(self) -> None:
        GLOBAL_HOOKS.detach(self)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        # What is freed after the result is no one's: a tracker applies its queued releases as it
        # lets the listener go, the allocator log drops what it holds.
        self.tracker.remove_listener(self)
        self._stack.clear()

    def _set_now(self) -> None:
        if self._making:
            self._now = _HELD
        elif self._stack:
            self._now = (_FORWARD, self._unit_of_module.get(id(self._stack[-1])))
        elif self._optimizer_depth:
            self._now = (_OPTIMIZER, None)
        else:
            self._now = (_OUTSIDE, None)
        if self._note_place is not None:
            self._note_place(self._now)

    def _pre_forward(self, module: Any, args: Any) -> None:
        if not self._stack and id(module) not in self._named:
            self._name_root(module)
        self._stack.append(module)
        self._set_now()

    def _post_forward(self, module: Any, args: Any, output: Any) -> None:
        if self._stack and self._stack[-1] is module:
            self._stack.pop()
        elif module in self._stack:
            del self._stack[self._stack.index(module) :]
        self._set_now()

    def _name_root(self, root: Any) -> None:
        self._roots.append(weakref.ref(root))
        if not self.modules:  # the categories need the tensors, not the names
            self._named.update(id(module) for module in root.modules())
            self._note_module_tensors(root)
            return
        import torch

        nn = torch.nn
        containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
        label = type(root).__name__
        # The children of a bare container are named after it: "Sequential.0".
        prefix = f"{label}." if isinstance(root, containers) else ""
        for name, module in root.named_modules(remove_duplicate=False):
            self._named.add(id(module))
            parts = name.split(".") if name else []
            if not parts:
                unit = label
            elif len(parts) > 1 and isinstance(root.get_submodule(parts[0]), containers):
                unit = prefix + ".".join(parts[:2])
            else:
                unit = prefix + parts[0]
            self._unit_of_module.setdefault(id(module), unit)
        self._note_module_tensors(root)

    def _note_module_tensors(self, root: Any) -> None:
        tag_of = self.tracker.tag_of
        for module in root.modules():
            unit = self._unit_of_module.get(id(module))
            for param in module._parameters.values():
                if param is not None:
                    self._note_parameter(param, unit)
            for buffer in module._buffers.values():
                if buffer is not None:
                    tag = tag_of(buffer)
                    if tag is not None:
                        self._know(tag, "other", unit, replace=False)

    def _note_parameter(self, param: Any, unit: str | None) -> None:
        from torch.nn.parameter import is_lazy

        # A lazy module's parameter has no storage before its first forward: it is noted when
        # the result is taken, as what it became.
        if is_lazy(param):
            return
        self._unit_of_param[id(param)] = unit
        self._note("parameters", param, unit)
        if param.grad is not None:
            self._note("gradients", param.grad, unit)
        if param.requires_grad and id(param) not in self._hooked:
            self._hooked.add(id(param))
            try:
                hook = param.register_post_accumulate_grad_hook(self._grad_ready)
            except RuntimeError:  # not a leaf
                return
            self._handles.append(hook)

    def _note(self, category: str, tensor: Any, unit: str | None) -> None:
        tag = self.tracker.tag_of(tensor)
        if tag is not None:
            self._know(tag, category, unit)

    def _know(self, tag: int, category: str, unit: str | None, replace: bool = True) -> None:
        # A storage that is more than one of these is the first of parameters, gradients,
        # optimizer state and other; within one, the latest unit noted stands (replace) or
        # the first.
        old = self.known.get(tag)
        if old is None or _RANK[category] < _RANK[old[0]] or (replace and old[0] == category):
            self.known[tag] = (category, unit)

    def _grad_ready(self, param: Any) -> None:
        if param.grad is not None:
            self._note("gradients", param.grad, self._unit_of_param.get(id(param)))

    def _optimizer_tensors(self, optimizer: Any) -> None:
        from torch import Tensor

        for group in optimizer.param_groups:
            for param in group["params"]:
                unit = self._unit_of_param.get(id(param))
                self._note("parameters", param, unit)
                if param.grad is not None:
                    self._note("gradients", param.grad, unit)
                for value in optimizer.state.get(param, {}).values():
                    if isinstance(value, Tensor):
                        self._note("optimizer", value, unit)

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._optimizer_tensors(optimizer)
        self._optimizer_depth += 1
        self._set_now()

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._optimizer_depth = max(0, self._optimizer_depth - 1)
        self._set_now()
        self._optimizer_tensors(optimizer)

    # -- the result -----------------------------------------------------------------------

    def result(self, peak: int | None = None) -> dict[str, Any]:
        """The breakdown at the peak of the logged allocations: ``total``, ``categories`` (every
        category, bytes) and ``modules`` (the largest first, with their categories).
        ``peak`` (the test's measured peak) makes ``other`` take up what the log cannot
        attribute."""
        self.tracker.flush()
        for ref in self._roots:  # gradients a backward left that no hook saw
            root = ref()
            if root is not None:
                self._note_module_tensors(root)
        if self._replay is not None:
            # Only the places matter when no storage was met by a hook.
            live = self._replay(by_place=not self.known)
        else:
            live = self._live_at_peak()
        categories = dict.fromkeys(CATEGORIES, 0)
        modules: dict[str, dict[str, int]] = {}
        known = self.known
        for tag, size, place in live:
            category, unit = known.get(tag) or by_place(place)
            categories[category] += size
            if unit is not None and self.modules:
                per = modules.setdefault(unit, dict.fromkeys(CATEGORIES, 0))
                per[category] += size
        attributed = sum(categories.values())
        total = max(attributed, peak or 0)
        categories["other"] += total - attributed
        if not modules:
            return {"total": total, "categories": categories, "modules": []}
        ranked = sorted(modules.items(), key=lambda item: (-sum(item[1].values()), item[0]))
        return {
            "total": total,
            "categories": categories,
            "modules": [
                {
                    "name": name,
                    "bytes": sum(per.values()),
                    "categories": {k: v for k, v in per.items() if v},
                }
                for name, per in ranked[:MODULES_SHOWN]
            ],
        }

    def _live_at_peak(self) -> list[tuple[int, int, Any]]:
        """Replays the logged events to the peak: (tag, bytes, where it was allocated) of each
        storage alive then."""
        events = self._events
        start = self._peak_from
        running = sum(delta for delta, _tag, _size in events[:start])
        best, best_index = running, start - 1
        for index in range(start, len(events)):
            running += events[index][0]
            if running > best:
                best, best_index = running, index
        live: dict[int, int] = dict(self._adopted)
        for _delta, tag, size in events[: best_index + 1]:
            if tag is None:
                continue
            if size:
                live[tag] = size
            else:
                live.pop(tag, None)
        where = self._where
        return [(tag, size, where.get(tag)) for tag, size in live.items()]


def by_place(place: tuple[int | None, str | None] | None) -> tuple[str, str | None]:
    """The category and module unit of a storage no hook met, from where it was allocated
    (phase, unit), None when unknown."""
    phase, unit = place or _HELD
    if phase == _FORWARD:
        return "activations", unit
    if isinstance(phase, str):  # a place that is its category: the op counter's workspaces
        return phase, unit
    if phase is None:
        return "other", None
    return "temporaries", None
