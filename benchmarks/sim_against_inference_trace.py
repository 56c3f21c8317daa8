"""The simulated device against real inference traces, by running the code that made them.

The traces are ``torch.cuda.memory._dump_snapshot()`` pickles that another CS336 assignment 2
solution wrote on one real GPU with torch 2.11 (``cs336_systems/nsys_profile.py``,
``memory_profile(pattern="forward-only")``, in https://github.com/Wedsonlin/assignment2-systems
at commit 8630bcf): the course's reference ``BasicsTransformerLM`` (``cs336-basics`` in the same
repository) at the "medium" shape (d_model 1024, d_ff 4096, 24 layers, 16 heads, vocabulary
10,000), float32, built on the host and moved with ``model.to("cuda")``; in ``model.eval()``
and under ``torch.inference_mode()``, five warm-up forward passes of a batch of 4 sequences,
then one more with history recorded. The file name says the context length:
``medium_{N}_inference_memory_snapshot.pickle``.

This script runs the same code on the simulated device, shape-only, and compares requests in
order and the peaks as ``sim_against_trace.py`` does (which see). ``--source`` is the
``cs336-basics`` folder of a checkout of that commit (it needs ``einx``, ``einops`` and
``jaxtyping``)::

    python benchmarks/sim_against_inference_trace.py --source ../assignment2-systems/cs336-basics \\
        --trace medium_128_inference_memory_snapshot.pickle [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_against_trace import (
    Run,
    _Recorder,
    _recording,
    compare,
    real_run,
    replay,
    report,
)

from pytest_vram.backends import create_backend
from pytest_vram.backends.traces import load_snapshot

#: ``scripts/run_profile_configs.sh``'s "medium" row and ``memory_profile``'s settings.
CONFIG = dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16, vocab_size=10_000)
BATCH = 4
WARMUP = 5
#: A GPU before Hopper: the traces' cuBLAS workspace, made in the warm-up, is 8,519,680 bytes.
GPU = "NVIDIA GeForce RTX 4090"
NAME = re.compile(r"_(\d+)_inference_memory_snapshot\.pickle$")


def import_model(source: Path) -> type:
    """``BasicsTransformerLM`` from the checkout's ``cs336-basics`` folder ``source``; its
    package ``__init__`` only reads its installed version, so the package is made without it."""
    package_dir = source / "cs336_basics"
    if not (package_dir / "model.py").is_file():
        raise SystemExit(f"{source}: no cs336_basics/model.py (the cs336-basics folder?)")
    package = types.ModuleType("cs336_basics")
    package.__path__ = [str(package_dir)]
    sys.modules["cs336_basics"] = package
    try:
        return importlib.import_module("cs336_basics.model").BasicsTransformerLM
    except ImportError as exc:  # einx, einops and jaxtyping are the assignment's, not ours
        raise SystemExit(f"{package_dir}: cannot import it: {exc}") from None


def sim_run(
    source: Path, context: int, gpu: str, autocast: bool = False, host_tensors: str = "host"
) -> Run:
    """``memory_profile(pattern="forward-only")`` on the simulated device standing for
    ``gpu`` (``--vram-sim-gpu``: it sets the cuBLAS workspace the warm-up makes), under
    ``torch.autocast("cuda", torch.bfloat16)`` if ``autocast``."""
    model_class = import_model(source)
    backend = create_backend("sim", sim_host_tensors=host_tensors, sim_gpu=gpu)
    recorder = _Recorder(source, backend.own_segments)
    run = Run()
    backend.begin_test()
    try:
        device = torch.device("cuda")
        model = model_class(context_length=context, **CONFIG)
        model.to(device)
        shape = (BATCH, context)
        warmup = torch.randint(0, CONFIG["vocab_size"], (WARMUP, *shape), device=device)
        inputs = torch.randint(0, CONFIG["vocab_size"], (1, *shape), device=device)
        model.eval()
        casting = torch.autocast("cuda", torch.bfloat16, enabled=autocast)
        with torch.inference_mode():
            for step in range(WARMUP):
                with casting:
                    model(warmup[step])
            with _recording(backend, recorder, run):
                torch.cuda.reset_peak_memory_stats()
                with casting:
                    model(inputs[0])
    finally:
        backend.end_test()
    run.requests, run.events = recorder.requests, recorder.events
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="cs336-basics of a checkout")
    parser.add_argument("--trace", type=Path, required=True, action="append")
    parser.add_argument("--json", type=Path, help="write the figures and differences here")
    parser.add_argument(
        "--sim-gpu",
        default=GPU,
        help=f"the simulated device's --vram-sim-gpu (default: {GPU}, as the traces' workspace)",
    )
    parser.add_argument(
        "--autocast",
        action="append",
        default=[],
        metavar="TRACE",
        help="a trace (its file name) recorded under bfloat16 autocast (repeatable)",
    )
    args = parser.parse_args(argv)
    results = {}
    for path in args.trace:
        found = NAME.search(path.name)
        if found is None:
            raise SystemExit(f"{path}: not named <size>_<N>_inference_memory_snapshot.pickle")
        snapshot = load_snapshot(path)
        real = real_run(snapshot)
        autocast = path.name in args.autocast
        sim = sim_run(args.source, int(found[1]), args.sim_gpu, autocast)
        results[path.name] = result = compare(real, sim, replay(snapshot, sim.events))
        print(report(path.name, result), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
