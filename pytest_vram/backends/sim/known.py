"""Tensor values the simulated device knows without computing them.

Shape-only, a fake tensor has no data, and code that reads a value (``bool(mask.all())``,
``.item()``) fails, or, when a library sees a fake tensor and assumes it is being traced,
takes a path a real run does not take. Some values are knowable all the same, and this
module keeps them, for small tensors and for tensors of one repeated value:

- **Sources.** ``ones``, ``zeros``, ``full``, ``scalar_tensor`` and their ``_like`` / ``new_``
  forms, and ``fill_`` / ``zero_``, make a tensor of one value, known whatever its size (kept
  as a 0-d real tensor expanded to the shape: no memory). ``arange`` and real tensors
  (``torch.tensor(data)``, a tensor made before the test) are known up to :data:`LIMIT`
  elements. ``normal_`` and ``uniform_`` give no values but bounds: a normal sample lies
  within :data:`NORMAL_SIGMAS` standard deviations of its mean (a Box-Muller draw from 53-bit
  uniforms reaches 8.6), which is enough to know that ``trunc_normal_``'s rejection test
  rejects nothing when its bounds lie farther out.
- **Propagation.** A deterministic, non-mutating op whose tensor inputs are all known runs for
  real on the known values when its inputs and outputs have at most :data:`LIMIT` elements;
  on inputs of one value, an elementwise op, a view, ``any`` and ``all`` give one value of any
  size. Comparisons with a number are decided from bounds where the bounds decide them.
- **Soundness.** A known value holds for the storage it was computed for, as long as nothing
  writes to that storage: every op that writes to a tensor (by its schema: in-place, ``out=``)
  counts a write on the tensor's storage, which every view shares, and a value recorded
  before the write is forgotten. A tensor whose data is swapped (``.data =``) no longer has
  the storage its value was recorded for. Anything else is unknown, as before: reading it
  needs values (and values on demand computes the test).

``.item()`` (``bool(t)``, ``.tolist()``) of a known tensor answers from its value.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._mode_utils import no_dispatch

__all__ = ["LIMIT", "NORMAL_SIGMAS", "KnownValues", "known_value"]

#: The most elements of a tensor whose values are kept in full (a 0-d value of a tensor of
#: one repeated value does not count): 65,536 (an attention mask of 16 x 4096 tokens).
LIMIT = 1 << 16
#: How far from its mean, in standard deviations, a sample of ``normal_`` can lie, with room.
NORMAL_SIGMAS = 9.0

_KEY = "_pytest_vram_known"
_WRITES = "_pytest_vram_writes"

aten = torch.ops.aten
_LOCAL_SCALAR = aten._local_scalar_dense.default

# Factories of one value whatever their size: (position of the size argument or None, of the
# template tensor or None).
_UNIFORM_FACTORIES: dict[Any, tuple[int | None, int | None]] = {
    aten.ones.default: (0, None),
    aten.zeros.default: (0, None),
    aten.full.default: (0, None),
    aten.scalar_tensor.default: (None, None),
    aten.ones_like.default: (None, 0),
    aten.zeros_like.default: (None, 0),
    aten.full_like.default: (None, 0),
    aten.new_ones.default: (1, 0),
    aten.new_zeros.default: (1, 0),
    aten.new_full.default: (1, 0),
}
_SMALL_FACTORIES = frozenset({aten.arange.default, aten.arange.start, aten.arange.start_step})
_FILLS = frozenset({aten.fill_.Scalar, aten.zero_.default})
# Not tagged pointwise, but every element of the result is the op of one element of the input.
_ELEMENTWISE = frozenset({aten._to_copy.default, aten.clone.default})
_BOUNDED_FILLS = frozenset({aten.normal_.default, aten.uniform_.default})
_REDUCE_ONE_VALUE = frozenset(
    {
        aten.any.default, aten.all.default, aten.any.dim, aten.all.dim,
        aten.any.dims, aten.all.dims, aten.amax.default, aten.amin.default,
    }
)  # fmt: skip
_COMPARE = {
    aten.lt.Scalar: lambda lo, hi, c: True if hi < c else False if lo >= c else None,
    aten.le.Scalar: lambda lo, hi, c: True if hi <= c else False if lo > c else None,
    aten.gt.Scalar: lambda lo, hi, c: True if lo > c else False if hi <= c else None,
    aten.ge.Scalar: lambda lo, hi, c: True if lo >= c else False if hi < c else None,
}

_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}
_PLAIN: dict[Any, bool] = {}


def _written(func: Any) -> tuple[tuple[int, str], ...]:
    """The arguments an op writes to, by its schema: (position, name)."""
    try:
        return _WRITTEN[func]
    except (KeyError, TypeError):
        pass
    schema = getattr(func, "_schema", None)
    written = (
        tuple(
            (i, arg.name)
            for i, arg in enumerate(schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
        if schema is not None
        else ()
    )
    with contextlib.suppress(TypeError):  # unhashable callables are not remembered
        _WRITTEN[func] = written
    return written


def _plain(func: Any) -> bool:
    """Whether an op may run on known values: deterministic, no randomness, no writes."""
    try:
        return _PLAIN[func]
    except (KeyError, TypeError):
        pass
    tags = getattr(func, "tags", ())
    plain = (
        hasattr(func, "_schema")
        and not _written(func)
        and torch.Tag.nondeterministic_seeded not in tags
        and torch.Tag.dynamic_output_shape not in tags
        and torch.Tag.data_dependent_output not in tags
    )
    with contextlib.suppress(TypeError):  # unhashable callables are not remembered
        _PLAIN[func] = plain
    return plain


class _Known:
    """A tensor's known value (``value``, real) or bounds (``lo``, ``hi``), for one storage."""

    __slots__ = ("hi", "lo", "storage", "value", "writes")

    def __init__(
        self,
        storage: torch.UntypedStorage,
        value: torch.Tensor | None = None,
        lo: float | None = None,
        hi: float | None = None,
    ) -> None:
        self.storage = weakref.ref(storage)
        self.writes = getattr(storage, _WRITES, 0)
        self.value = value
        self.lo = lo
        self.hi = hi


def _record(tensor: torch.Tensor) -> _Known | None:
    record = tensor.__dict__.get(_KEY) if isinstance(tensor, FakeTensor) else None
    if record is None:
        return None
    try:
        storage = tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None
    if record.storage() is not storage or getattr(storage, _WRITES, 0) != record.writes:
        del tensor.__dict__[_KEY]
        return None
    return record


def known_value(tensor: torch.Tensor) -> torch.Tensor | None:
    """The real value of ``tensor`` when it is known: a real tensor of the same shape."""
    if not isinstance(tensor, FakeTensor):
        return tensor
    record = _record(tensor)
    if record is not None:
        return record.value
    constant = tensor.constant
    return constant if constant is not None else None


def _one_value(value: torch.Tensor) -> bool:
    return value.numel() <= 1 or all(s == 0 for s in value.stride())


def _set(fake: torch.Tensor, value: torch.Tensor | None, lo: Any = None, hi: Any = None) -> None:
    if value is not None and (value.shape != fake.shape or value.dtype != fake.dtype):
        return
    try:
        storage = fake.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return
    fake.__dict__[_KEY] = _Known(storage, value, lo, hi)


def _real_args(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[torch.Tensor]] | None:
    """``args`` and ``kwargs`` with every tensor replaced by its known value; None when one is
    unknown."""
    reals: list[torch.Tensor] = []

    def convert(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            real = known_value(value)
            if real is None:
                raise LookupError
            reals.append(real)
            return real
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(convert(v) for v in value)
        return value

    try:
        new_args = tuple(convert(a) for a in args)
        new_kwargs = {k: convert(v) for k, v in kwargs.items()}
    except LookupError:
        return None
    return new_args, new_kwargs, reals


def _fake_outputs(out: Any) -> list[torch.Tensor] | None:
    if isinstance(out, FakeTensor):
        return [out]
    if isinstance(out, (tuple, list)) and out and all(isinstance(o, FakeTensor) for o in out):
        return list(out)
    return None


class KnownValues:
    """Keeps and propagates the known values of one fake mode's tensors (see the module)."""

    def __init__(self) -> None:
        self._decisions: list[bool] | None = None

    @contextlib.contextmanager
    def deciding(self, answers: list[bool]) -> Iterator[None]:
        """In the block, a boolean read that the known values cannot answer (``bool(t)``,
        ``if mask.any()``) takes the next of ``answers``; the last one repeats. For a loop
        whose course is known in advance (``simops.trunc_normal_decided``)."""
        saved, self._decisions = self._decisions, list(answers)
        try:
            yield
        finally:
            self._decisions = saved

    def item(self, tensor: Any) -> Any:
        """``tensor.item()`` when its value is known (or decided), else None."""
        if not isinstance(tensor, FakeTensor):
            return None
        record = _record(tensor)
        if record is None or record.value is None or record.value.numel() != 1:
            return self._decide(tensor)
        with no_dispatch():
            return record.value.item()

    def _decide(self, tensor: torch.Tensor) -> bool | None:
        decisions = self._decisions
        if not decisions or tensor.dtype != torch.bool or tensor.numel() != 1:
            return None
        return decisions.pop(0) if len(decisions) > 1 else decisions[0]

    def after(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Note what the op ``func`` wrote, and what is known of what it returned."""
        written = _written(func)
        if written:
            self._count_writes(written, args, kwargs)
            if func in _FILLS or func in _BOUNDED_FILLS:
                self._fill(func, args, kwargs)
            return
        outs = _fake_outputs(out)
        if outs is None or outs[0].fake_device.type == "meta":
            return
        try:
            if func in _UNIFORM_FACTORIES:
                self._uniform_factory(func, args, kwargs, outs[0])
            elif func in _SMALL_FACTORIES:
                if outs[0].numel() <= LIMIT:
                    with no_dispatch():
                        _set(outs[0], func(*args, **kwargs))
            elif func in _COMPARE and isinstance(args[0], FakeTensor):
                self._compare(func, args, outs[0])
            elif _plain(func):
                self._propagate(func, args, kwargs, outs)
        except Exception:  # a value that cannot be worked out stays unknown
            return

    # -- writes -------------------------------------------------------------------------------

    @staticmethod
    def _count_writes(written: tuple[tuple[int, str], ...], args: tuple, kwargs: dict) -> None:
        for position, name in written:
            value = args[position] if position < len(args) else kwargs.get(name)
            for tensor in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(tensor, torch.Tensor):
                    try:
                        storage = tensor.untyped_storage()
                    except (NotImplementedError, RuntimeError):
                        continue
                    setattr(storage, _WRITES, getattr(storage, _WRITES, 0) + 1)

    @staticmethod
    def _fill(func: Any, args: tuple, kwargs: dict) -> None:
        tensor = args[0]
        if not isinstance(tensor, FakeTensor):
            return
        if func is aten.zero_.default or func is aten.fill_.Scalar:
            fill = 0 if func is aten.zero_.default else args[1]
            with no_dispatch():
                value = torch.full((), fill, dtype=tensor.dtype).expand(tensor.shape)
            _set(tensor, value)
        elif func is aten.normal_.default:
            mean = args[1] if len(args) > 1 else kwargs.get("mean", 0.0)
            std = args[2] if len(args) > 2 else kwargs.get("std", 1.0)
            if tensor.is_floating_point() and math.isfinite(mean) and math.isfinite(std):
                spread = NORMAL_SIGMAS * abs(std)
                _set(tensor, None, mean - spread, mean + spread)
        else:
            low = args[1] if len(args) > 1 else kwargs.get("from", 0.0)
            high = args[2] if len(args) > 2 else kwargs.get("to", 1.0)
            if tensor.is_floating_point():
                _set(tensor, None, min(low, high), max(low, high))

    # -- values ------------------------------------------------------------------------------

    @staticmethod
    def _uniform_factory(func: Any, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        size_at, template_at = _UNIFORM_FACTORIES[func]
        args = list(args)
        with no_dispatch():
            if template_at is not None:
                template = args[template_at]
                args[template_at] = torch.empty((), dtype=template.dtype)
            if size_at is not None:
                args[size_at] = []
            kwargs = {k: v for k, v in kwargs.items() if k not in ("memory_format", "device")}
            value = func(*args, **kwargs)
            _set(out, value.reshape(()).expand(out.shape))

    @staticmethod
    def _compare(func: Any, args: tuple, out: torch.Tensor) -> None:
        record = _record(args[0])
        if record is None or record.lo is None or not isinstance(args[1], (int, float)):
            return
        answer = _COMPARE[func](record.lo, record.hi, args[1])
        if answer is not None:
            with no_dispatch():
                _set(out, torch.tensor(answer).expand(out.shape))

    @staticmethod
    def _propagate(func: Any, args: tuple, kwargs: dict, outs: list[torch.Tensor]) -> None:
        # Most ops have an unknown first tensor: leave before converting anything.
        for arg in args:
            if isinstance(arg, FakeTensor):
                if _KEY not in arg.__dict__ and arg.constant is None:
                    return
                break
        converted = _real_args(args, kwargs)
        if converted is None:
            return
        real_args, real_kwargs, reals = converted
        if not reals:
            return
        if all(r.numel() <= LIMIT for r in reals) and all(o.numel() <= LIMIT for o in outs):
            with no_dispatch():
                result = func(*real_args, **real_kwargs)
            results = [result] if isinstance(result, torch.Tensor) else list(result)
            for fake, value in zip(outs, results, strict=True):
                _set(fake, value)
            return
        if len(outs) != 1 or not all(_one_value(r) for r in reals):
            return
        out = outs[0]
        first = reals[0]
        with no_dispatch():
            if func in _REDUCE_ONE_VALUE:
                if first.numel() == 0:
                    return
                value = first.reshape(-1)[:1].reshape(())
                if func is not aten.amax.default and func is not aten.amin.default:
                    value = value.bool()
                _set(out, value.expand(out.shape))
            elif torch.Tag.pointwise in func.tags or func in _ELEMENTWISE:
                # Every element is the op of the one values: compute it on a single element.
                def shrink(value: Any) -> Any:
                    if isinstance(value, torch.Tensor):
                        return value.reshape(-1)[:1].reshape([1] * value.dim())
                    return value

                small = func(
                    *(shrink(a) for a in real_args),
                    **{k: shrink(v) for k, v in real_kwargs.items()},
                )
                if isinstance(small, torch.Tensor) and small.numel() == 1:
                    _set(out, small.reshape(()).expand(out.shape))
            elif out.untyped_storage() is first_storage(args):
                # A view of a tensor of one value has that value.
                _set(out, first.reshape(-1)[:1].reshape(()).expand(out.shape))


def first_storage(args: tuple) -> Any:
    """The storage of the first tensor argument, for views."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            try:
                return arg.untyped_storage()
            except (NotImplementedError, RuntimeError):
                return None
    return None
