"""The simulated device against a real CUDA allocator trace, by running the code that made it.

A trace here is a ``torch.cuda.memory._dump_snapshot()`` pickle that CS336 assignment 2's
memory profiling wrote on one real GPU (``cs336_systems/benchmark.py``,
``run_memory_foward_fullstep``, in https://github.com/kkaitlyn111/cs336-a2-systems): the
Transformer LM of https://github.com/kkaitlyn111/cs336-assignment1 (``cs336_basics``) at the
2.7B shape (d_model 2560, d_ff 10240, 32 layers, 32 heads, vocabulary 10,000, RoPE theta
10,000), a batch of 4 sequences, float32 weights (each made on the host by the assignment's
``Linear``, then moved by ``model.to("cuda")``), then with history
recorded either a forward pass (``forward``) or a training step (``fullstep``: ``zero_grad``,
forward, the repository's cross-entropy, backward, its AdamW step), in float32 or under
``torch.autocast("cuda", torch.bfloat16)`` (``mixed``). The file name says which:
``memory_ctx{N}_{forward|fullstep}_{mixed|}.pickle``.

This script runs the same code on the simulated device, shape-only as users' CI does, and
compares with the trace:

- the requests: the sizes (rounded as the allocator rounds them) of the blocks asked for while
  history was recorded, aligned in order with ``difflib``; the first differences are listed
  with the trace's frames and the simulated run's;
- peak allocated: the real allocator's (blocks handed out, the weights that were on the device
  before recording included; found by replaying the trace on
  :class:`~pytest_vram.backends.segments.CachingAllocatorModel` from the snapshot's segments,
  which ``tests/test_trace_replay.py`` shows exact) against the simulated device's
  ``peak_allocated``, as a user's test reads it (the model built on the simulated device);
- the same peak with the weights as the snapshot shows them: the simulated run's requests and
  frees replayed from the real allocator's state when recording started, which tells the
  forward's and the step's own fidelity apart from how the weights were laid out.

The benchmark ran context lengths 128, 256 and 512 in one process: a later run found the cuBLAS
workspaces of the earlier one (one per thread that multiplied matrices, autograd's included)
and made none. Where a trace makes fewer than its run needs, the simulated run makes the
missing ones before recording too.

The third-party code is not part of this repository: ``--source`` is a checkout of
cs336-assignment1 (its ``cs336_basics`` package is imported from there; it needs ``einops`` and
``jaxtyping``). The trace pickle is read with an unpickler that refuses every global. Run from
the repository root::

    python benchmarks/sim_against_trace.py --source ../cs336-assignment1 \\
        --trace tests/data/traces/cs336_ctx128_forward.pickle [--json out.json] \\
        [--sim-host-tensors device]

The simulated device runs with ``--vram-sim-host-tensors=host`` unless told otherwise: the
assignment's ``Linear`` makes its weight on the host, and ``model.to("cuda")`` copies it.

The traces were made with torch 2.6.0, and the simulated device runs the torch it is installed
with: run the script under torch 2.6.0 (PyPI's build runs on the CPU) to compare like with
like. Under a later torch the training steps differ by what that torch does differently (its
einsum's weight gradients are transposed, and ``AccumulateGrad`` copies them; docs/sim.md).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import json
import pickle
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pytest_vram.backends import create_backend  # noqa: E402
from pytest_vram.backends.segments import Block, CachingAllocatorModel, round_request  # noqa: E402
from pytest_vram.backends.traces import (  # noqa: E402
    blocks_before_recording,
    load_snapshot,
    trace_of,
)

#: The 2.7B row of ``get_model_config`` in the assignment's benchmark.py, and the settings of
#: ``profile_memory_forward_fullstep``.
CONFIG = dict(d_model=2560, d_ff=10240, num_layers=32, num_heads=32)
BATCH = 4
VOCAB = 10_000
THETA = 10_000
NAME = re.compile(r"ctx(\d+)_(forward|fullstep)_?(mixed)?\.pickle$")
#: How many differing requests to list.
SHOWN = 12


# -- the trace -------------------------------------------------------------------------------


@dataclass
class Request:
    """One block asked for while history was recorded: its size as the allocator rounds it,
    and where it was asked for (the innermost frames of the traced code, and the op)."""

    size: int
    where: str
    op: str = ""


@dataclass
class Run:
    """What one side did while history was recorded."""

    requests: list[Request] = field(default_factory=list)
    #: ("alloc", id, bytes) and ("free", id, 0) in order: what a replay needs.
    events: list[tuple[str, int, int]] = field(default_factory=list)
    weights: int = 0  # allocated when recording started
    peak: int = 0  # peak allocated, the weights included
    peak_reserved: int = 0  # on a replay: the segments' peak, those before recording included
    end: int = 0  # allocated at the end


_OP = re.compile(r"at::_ops::(\w+)::")
_NATIVE = re.compile(r"at::native::(?:\(anonymous namespace\)::)?(\w+)")
_NODE = re.compile(r"torch::autograd::(?:generated::)?(\w+)::apply")


def _trace_where(frames: list[dict[str, Any]]) -> tuple[str, str]:
    """The innermost Python frames outside torch and einops, and the op: the innermost ATen
    op (or kernel) and, in the backward pass, the autograd node that ran it."""
    python = [
        f"{Path(f['filename']).name}:{f['line']}"
        for f in frames
        if f["filename"].endswith(".py") and "site-packages" not in f["filename"]
    ]
    op = node = ""
    for frame in frames:
        name = frame["name"]
        if "getNewWorkspace" in name:
            op = "cuBLAS workspace"
        if "reduce_grad" in name and not node:
            node = "sum_to (a broadcast input's gradient)"
        if not op:
            found = _OP.search(name) or _NATIVE.search(name)
            if found:
                op = found.group(1)
        found = _NODE.search(name)
        if found and not node:
            node = found.group(1)
    return " < ".join(python[:2]), f"{op} in {node}" if node else op


class _Replay(CachingAllocatorModel):
    """The segment model, each new segment at the address the driver gave the real one."""

    def __init__(self) -> None:
        super().__init__()
        self.driver: list[int] = []

    def segment_address(self, size: int) -> int:
        return self.driver.pop(0)


def real_run(snapshot: dict[str, Any]) -> Run:
    """The trace's requests and its allocated bytes as the real allocator counted them."""
    trace = trace_of(snapshot)
    model = _Replay()
    # Blocks of an earlier step that the recorded one frees are there from the start.
    live: dict[int, Block] = blocks_before_recording(snapshot, model)
    run = Run(weights=model.allocated)
    for event in trace:
        action = event["action"]
        if action == "segment_alloc":
            model.driver.append(event["addr"])
        elif action == "alloc":
            block = model.malloc(event["size"])
            assert block is not None
            live[event["addr"]] = block
            where, op = _trace_where(event.get("frames", []))
            run.requests.append(Request(round_request(event["size"]), where, op))
        elif action == "free_completed":
            model.free(live.pop(event["addr"]))
    run.peak, run.end = model.peak_allocated, model.allocated
    run.peak_reserved = model.peak_reserved
    return run


def replay(snapshot: dict[str, Any], events: list[tuple[str, int, int]]) -> Run:
    """``events`` (another run's) from the state the snapshot's allocator was in when
    recording started: what that run's requests and frees give with the real weights' blocks.
    A free of a block from before recording (``free_before``, by its size) frees the block of
    that size the real run freed first; other blocks from before recording are kept."""
    model = CachingAllocatorModel()
    before = blocks_before_recording(snapshot, model)
    run = Run(weights=model.allocated)
    traced: set[int] = set()
    freed_first: list[Block] = []
    for event in trace_of(snapshot):
        if event["action"] == "alloc":
            traced.add(event["addr"])
        elif event["action"] == "free_completed" and event["addr"] not in traced:
            freed_first.append(before[event["addr"]])
    live: dict[int, Block | None] = {}
    for action, key, nbytes in events:
        if action == "alloc":
            live[key] = model.malloc(nbytes)
        elif action == "free_before":
            found = next((b for b in freed_first if b.size == nbytes), None)
            if found is not None:
                freed_first.remove(found)
                model.free(found)
        elif key in live:
            model.free(live.pop(key))
    run.peak, run.end = model.peak_allocated, model.allocated
    run.peak_reserved = model.peak_reserved
    return run


# -- the simulated run -----------------------------------------------------------------------


def import_source(source: Path) -> types.SimpleNamespace:
    """The assignment's model, optimizer and loss, imported from the checkout ``source``.

    The package's ``__init__`` only reads its installed version, which a checkout does not
    have: the package is made without it and its modules imported from their files.
    """
    package_dir = source / "cs336_basics"
    if not (package_dir / "transformer.py").is_file():
        raise SystemExit(
            f"{source}: no cs336_basics/transformer.py (a cs336-assignment1 checkout?)"
        )
    package = types.ModuleType("cs336_basics")
    package.__path__ = [str(package_dir)]
    sys.modules["cs336_basics"] = package
    try:
        return types.SimpleNamespace(
            TransformerLM=importlib.import_module("cs336_basics.transformer").TransformerLM,
            AdamW=importlib.import_module("cs336_basics.optimizers").AdamW,
            cross_entropy_loss=importlib.import_module("cs336_basics.training").cross_entropy_loss,
        )
    except ImportError as exc:  # einops and jaxtyping are the assignment's, not ours
        raise SystemExit(f"{package_dir}: cannot import it: {exc}") from None


class _Recorder:
    """Sees each request the simulated device's allocator gets (the tracker asks it for the
    rounded storage size before it counts the block handed out), with the code that made it:
    what the real allocator's history records for an ``alloc``."""

    def __init__(self, source: Path, allocator: Any) -> None:
        self.source = str(source.resolve())
        self.allocator = allocator
        self.requests: list[Request] = []
        self.events: list[tuple[str, int, int]] = []
        self._held: dict[int, Any] = {}

    def __enter__(self) -> _Recorder:
        malloc = self.allocator.malloc

        free = self.allocator.free

        def recording_malloc(nbytes: int) -> Any:
            self.requests.append(Request(round_request(nbytes), *self._where()))
            block = malloc(nbytes)
            if block is not None:  # None: zero bytes, nothing to free
                self.events.append(("alloc", id(block), nbytes))
                self._held[id(block)] = block  # its id stays its own until it is freed
            return block

        def recording_free(block: Any) -> None:
            if self._held.pop(id(block), None) is not None:
                self.events.append(("free", id(block), 0))
            else:  # made before recording: known to a replay by its size
                self.events.append(("free_before", 0, block.size))
            free(block)

        self.allocator.malloc = recording_malloc
        self.allocator.free = recording_free
        return self

    def __exit__(self, *exc: object) -> None:
        del self.allocator.malloc  # the class's own again
        del self.allocator.free

    def _where(self) -> tuple[str, str]:
        frames = []
        op = ""
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            filename = code.co_filename
            if len(frames) < 2 and (filename.startswith(self.source) or filename == __file__):
                frames.append(f"{Path(filename).name}:{frame.f_lineno}")
            elif code.co_name == "__torch_dispatch__" and "func" in frame.f_locals:
                # The outermost: the op the program (or autograd) called.
                op = getattr(frame.f_locals["func"], "__name__", str(frame.f_locals["func"]))
            frame = frame.f_back
        node = torch._C._current_autograd_node()
        if node is not None:
            op = f"{op} in {node.name()}"
        return " < ".join(frames), op


def sim_run(
    source: Path,
    context: int,
    fullstep: bool,
    mixed: bool,
    workspaces_before: int,
    host_tensors: str = "host",
) -> Run:
    """``run_memory_foward_fullstep`` of the assignment's benchmark.py on the simulated device.

    ``workspaces_before``: how many of the step's cuBLAS workspaces the traced process held
    when recording started (made by an earlier run in the same process; the forward thread's
    first, then the autograd thread's), made here before recording too. ``host_tensors`` is
    ``--vram-sim-host-tensors``: the assignment builds its weights on the host and moves them.
    """
    code = import_source(source)
    # As the plugin makes it: cuBLAS workspaces included.
    backend = create_backend("sim", sim_host_tensors=host_tensors)
    recorder = _Recorder(source, backend.own_segments)
    run = Run()
    backend.begin_test()
    try:
        device = torch.device("cuda")
        dtype = torch.bfloat16 if mixed else torch.float32
        if not mixed:
            torch.set_float32_matmul_precision("high")
        model = code.TransformerLM(
            context_length=context,
            vocab_size=VOCAB,
            theta=THETA,
            device=device,
            dtype=dtype,
            **CONFIG,
        )
        model.to(device)
        optimizer = code.AdamW(
            model.parameters(), lr=1e-4, weight_decay=0.01, eps=1e-8, betas=(0.9, 0.95)
        )
        batch = torch.randint(low=0, high=VOCAB, size=(BATCH, context)).to(device)
        if workspaces_before:
            _make_workspaces(device, backward=workspaces_before > 1)
        casting = (
            torch.autocast(device_type="cuda", dtype=dtype) if mixed else contextlib.nullcontext()
        )
        with casting, _recording(backend, recorder, run):
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.empty_cache()
            if fullstep:
                optimizer.zero_grad()
                logits = model(batch)
                loss = code.cross_entropy_loss(logits, batch)
                loss.backward()
                optimizer.step()
            else:
                logits = model(batch)
        del logits
    finally:
        backend.end_test()
    run.requests, run.events = recorder.requests, recorder.events
    return run


def _make_workspaces(device: torch.device, backward: bool) -> None:
    """A small matrix product on this thread (and in a backward pass, on autograd's)."""
    a = torch.ones(2, 2, device=device, requires_grad=backward)
    product = a @ a
    if backward:
        product.sum().backward()


@contextlib.contextmanager
def _recording(backend: Any, recorder: _Recorder, run: Run) -> Iterator[None]:
    """``torch.cuda.memory._record_memory_history`` to ``_dump_snapshot``, on the sim."""
    backend.tracker.flush()
    run.weights = backend.allocated()
    backend.reset_peak()
    try:
        with recorder:
            yield
    finally:
        backend.tracker.flush()
        run.peak, run.end = backend.peak_allocated(), backend.allocated()


# -- the comparison --------------------------------------------------------------------------


def _peak(real: Run, peak: int) -> dict[str, Any]:
    return {
        "real": real.peak,
        "sim": peak,
        "ratio": peak / real.peak,
        "percent": 100 * (peak - real.peak) / real.peak,
    }


def compare(real: Run, sim: Run, sim_on_real_weights: Run) -> dict[str, Any]:
    real_sizes = [r.size for r in real.requests]
    sim_sizes = [r.size for r in sim.requests]
    matcher = difflib.SequenceMatcher(None, real_sizes, sim_sizes, autojunk=False)
    matched = sum(block.size for block in matcher.get_matching_blocks())
    differences = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        differences.append(
            {
                "kind": tag,
                "real": [vars(r) | {"index": i} for i, r in enumerate(real.requests[i1:i2], i1)],
                "sim": [vars(r) | {"index": j} for j, r in enumerate(sim.requests[j1:j2], j1)],
            }
        )
    return {
        "requests": {"real": len(real_sizes), "sim": len(sim_sizes), "matched": matched},
        "requested_bytes": {"real": sum(real_sizes), "sim": sum(sim_sizes)},
        "weights": {"real": real.weights, "sim": sim.weights},
        "peak_allocated": _peak(real, sim.peak),
        # The simulated run's requests and frees from the real allocator's state at the start.
        "peak_allocated_on_real_weights": _peak(real, sim_on_real_weights.peak),
        # Reserved, both from the real segments when recording started.
        "peak_reserved": {"real": real.peak_reserved, "sim": sim_on_real_weights.peak_reserved},
        "peak_over_weights": {"real": real.peak - real.weights, "sim": sim.peak - sim.weights},
        "end_allocated": {"real": real.end, "sim": sim.end},
        "differences": differences,
    }


def _describe(requests: list[dict[str, Any]]) -> str:
    shown = ", ".join(
        f"#{r['index']} {r['size']} B at {r['where'] or '?'}" + (f" ({r['op']})" if r["op"] else "")
        for r in requests[:4]
    )
    more = len(requests) - 4
    return shown + (f", and {more} more" if more > 0 else "") if requests else "none"


def report(name: str, result: dict[str, Any]) -> str:
    requests, peak = result["requests"], result["peak_allocated"]
    on_real = result["peak_allocated_on_real_weights"]
    lines = [
        f"{name}",
        f"  requests: real {requests['real']}, sim {requests['sim']},"
        f" {requests['matched']} matched in order",
        f"  requested bytes: real {result['requested_bytes']['real']:,},"
        f" sim {result['requested_bytes']['sim']:,}",
        f"  allocated before recording (weights): real {result['weights']['real']:,},"
        f" sim {result['weights']['sim']:,}",
        f"  peak allocated: real {peak['real']:,}, sim {peak['sim']:,},"
        f" ratio {peak['ratio']:.6f} ({peak['percent']:+.4f}%)",
        "  peak allocated, the sim's requests and frees from the real weights' blocks:"
        f" {on_real['sim']:,}, ratio {on_real['ratio']:.6f} ({on_real['percent']:+.4f}%)",
        f"  peak reserved, from the real segments: real {result['peak_reserved']['real']:,},"
        f" sim {result['peak_reserved']['sim']:,}",
        f"  peak over the weights: real {result['peak_over_weights']['real']:,},"
        f" sim {result['peak_over_weights']['sim']:,}",
        f"  allocated at the end: real {result['end_allocated']['real']:,},"
        f" sim {result['end_allocated']['sim']:,}",
    ]
    differences = result["differences"]
    if differences:
        lines.append(f"  {len(differences)} differing stretches; the first {SHOWN}:")
        for difference in differences[:SHOWN]:
            lines.append(f"    {difference['kind']}")
            lines.append(f"      real: {_describe(difference['real'])}")
            lines.append(f"      sim:  {_describe(difference['sim'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="a cs336-assignment1 checkout")
    parser.add_argument(
        "--trace",
        type=Path,
        required=True,
        action="append",
        help="a memory_ctx*_*.pickle (repeatable)",
    )
    parser.add_argument("--json", type=Path, help="write the figures and differences here")
    parser.add_argument(
        "--sim-host-tensors",
        choices=("device", "host"),
        default="host",
        help="the simulated device's --vram-sim-host-tensors (default: host, as on a GPU)",
    )
    args = parser.parse_args(argv)
    results = {}
    for path in args.trace:
        found = NAME.search(path.name)
        if found is None:
            raise SystemExit(
                f"{path}: not named as the benchmark names its traces"
                " (memory_ctx<N>_<forward|fullstep>_[mixed].pickle)"
            )
        context, kind, mixed = int(found[1]), found[2], found[3] is not None
        try:
            snapshot = load_snapshot(path)
            real = real_run(snapshot)
        except (OSError, pickle.UnpicklingError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(
                f"{path}: not a memory snapshot with one device's trace: {exc}"
            ) from None
        # A process that had run the benchmark before kept its cuBLAS workspaces: one per
        # thread that multiplied matrices (the autograd engine's too, in a training step).
        made = sum(r.op.startswith("cuBLAS workspace") for r in real.requests)
        expected = 2 if kind == "fullstep" else 1
        sim = sim_run(
            args.source,
            context,
            kind == "fullstep",
            mixed,
            max(expected - made, 0),
            args.sim_host_tensors,
        )
        results[path.name] = result = compare(real, sim, replay(snapshot, sim.events))
        print(report(path.name, result), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
