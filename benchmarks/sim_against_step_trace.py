"""The simulated device against a real trace of a forward and backward pass.

The trace is the ``torch.cuda.memory._dump_snapshot()`` pickle that a third CS336 assignment 2
solution wrote on one real GPU with torch 2.11 (``cs336_systems/benchmarking_script.py`` and
``memory_snapshot.pickle`` in https://github.com/MAGMA27/assignment2-systems at commit
15883f2): the course's reference ``BasicsTransformerLM`` (``cs336-basics`` in the same
repository) at d_model 768, d_ff 3072, 12 layers, 12 heads, a 10,000-token vocabulary and
context 256, float32, built on the host and moved with ``model.to("cuda")``; five warm-up
steps of forward, the course's ``cross_entropy`` and backward on a batch of 32 sequences
(the gradients are never zeroed), then one more with history recorded.

This script runs the same code on the simulated device, shape-only, and compares requests in
order and the peaks as ``sim_against_trace.py`` does (which see). ``--source`` is the
``cs336-basics`` folder of a checkout of that commit (it needs ``einx``, ``einops`` and
``jaxtyping``)::

    python benchmarks/sim_against_step_trace.py --source ../assignment2-systems/cs336-basics \\
        --trace memory_snapshot.pickle [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_against_inference_trace import import_model
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

#: The script's ``config``.
CONFIG = dict(
    vocab_size=10_000, context_length=256, d_model=768, num_layers=12, num_heads=12, d_ff=3072
)
BATCH = 32
WARMUP = 5
#: A GPU before Hopper: the trace's two cuBLAS workspaces are 8,519,680 bytes each.
GPU = "NVIDIA GeForce RTX 4090"


def sim_run(source: Path, gpu: str, host_tensors: str = "host") -> Run:
    """The script's warm-up and recorded step on the simulated device standing for ``gpu``."""
    model_class = import_model(source)
    cross_entropy = importlib.import_module("cs336_basics.nn_utils").cross_entropy
    backend = create_backend("sim", sim_host_tensors=host_tensors, sim_gpu=gpu)
    recorder = _Recorder(source, backend.own_segments)
    run = Run()
    backend.begin_test()
    try:
        device = torch.device("cuda")
        model = model_class(**CONFIG).to(device)
        shape = (BATCH, CONFIG["context_length"])
        data = torch.randint(0, CONFIG["vocab_size"], shape).to(device)
        target = torch.randint(0, CONFIG["vocab_size"], shape).to(device)
        # As the script does: the last warm-up's logits and loss are held while the recorded
        # step runs, until its own replace them.
        for _ in range(WARMUP):
            lm_head = model(data)
            loss = cross_entropy(lm_head, target)
            loss.backward()
        with _recording(backend, recorder, run):
            lm_head = model(data)
            loss = cross_entropy(lm_head, target)
            loss.backward()
        del lm_head, loss
    finally:
        backend.end_test()
    run.requests, run.events = recorder.requests, recorder.events
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="cs336-basics of a checkout")
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--json", type=Path, help="write the figures and differences here")
    parser.add_argument("--sim-gpu", default=GPU, help=f"--vram-sim-gpu (default: {GPU})")
    args = parser.parse_args(argv)
    snapshot = load_snapshot(args.trace)
    real = real_run(snapshot)
    sim = sim_run(args.source, args.sim_gpu)
    result = compare(real, sim, replay(snapshot, sim.events))
    print(report(args.trace.name, result), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({args.trace.name: result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
