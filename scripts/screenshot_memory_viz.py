"""Screenshot PyTorch's memory viewer showing a snapshot that the sim backend wrote.

    python scripts/screenshot_memory_viz.py --viewer-js MemoryViz.js --d3 node_modules \
        [--output docs/memory-viz-trace.png] [--keep DIR]

It runs a simulated training step of the repository's GPT as a failing measured test with
``--vram-snapshot-on-fail``, renders the snapshot with ``python -m torch.cuda._memory_viz
trace_plot``, and takes a picture of the page in headless Chromium. That page loads PyTorch's
``MemoryViz.js`` and d3 from CDNs; on a machine that cannot reach them, pass local copies:
``--viewer-js`` (``torch/utils/viz/MemoryViz.js`` of PyTorch's source) and ``--d3`` (the
``node_modules`` of ``npm install d3@5``), which an import map puts in their place.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VIEWER_URL = "https://cdn.jsdelivr.net/gh/pytorch/pytorch@main/torch/utils/viz/MemoryViz.js"
SKYPACK = "https://cdn.skypack.dev/"

TEST = """
import torch
from gpt import GPT, GPTConfig, training_step
from pytest_vram import max_vram

CONFIG = GPTConfig(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2)


@max_vram("32MB")
def test_training_step(vram):
    model = GPT(CONFIG).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 129), device="cuda")
    for _ in range(2):
        training_step(model, optimizer, tokens[:, :-1], tokens[:, 1:])
"""


def write_snapshot(workdir: Path) -> Path:
    """Run the failing simulated step; the snapshot pickle it leaves."""
    (workdir / "test_step.py").write_text(TEST)
    shutil.copy(ROOT / "suites" / "gpt.py", workdir / "gpt.py")
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--vram-backend=sim",
         "--vram-snapshot-on-fail=snaps", "test_step.py"],
        cwd=workdir, capture_output=True, text=True, check=False,
    )  # fmt: skip
    (snapshot,) = (workdir / "snaps").glob("*.pickle")
    return snapshot


def local_viewer(source: str) -> str:
    """The viewer with its d3 imports taken from the d3 bundle the page loads first: d3@5's
    ES modules import each other without file extensions, which only a bundler resolves."""
    lines = []
    for line in source.splitlines():
        match = re.match(r"import (.+) from \"" + re.escape(SKYPACK) + r"[^\"]+\";", line)
        if match is None:
            lines.append(line)
        elif match.group(1).startswith("* as "):
            lines.append(f"const {match.group(1)[5:]} = window.d3;")
        else:
            names = match.group(1).replace("{", "").replace("}", "").strip()
            lines.append(f"const {{{names}}} = window.d3;")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--viewer-js", type=Path, required=True, help="a local MemoryViz.js")
    parser.add_argument("--d3", type=Path, required=True, help="node_modules holding d3@5")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "memory-viz-trace.png")
    parser.add_argument("--window-size", default="1400,600")
    parser.add_argument("--keep", type=Path, help="keep the snapshot and page in this folder")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "scripts"))
    from screenshot_html import find_chromium

    chromium = find_chromium()
    if chromium is None:
        print("no chromium on PATH (apt-get install chromium)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="pytest-vram-viz-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        snapshot = write_snapshot(work)
        site = work / "site"
        site.mkdir(exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(snapshot),
             "-o", str(site / "trace.html")],
            check=True, capture_output=True,
        )  # fmt: skip
        (site / "MemoryViz.js").write_text(local_viewer(args.viewer_js.read_text()))
        shutil.copy(args.d3 / "d3" / "dist" / "d3.js", site / "d3.js")
        mapping = json.dumps({"imports": {VIEWER_URL: "/MemoryViz.js"}})
        page = (site / "trace.html").read_text()
        page = page.replace(
            "<head>",
            f'<head><script type="importmap">{mapping}</script><script src="/d3.js"></script>',
            1,
        )
        (site / "trace.html").write_text(page)
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}/trace.html"
            with tempfile.TemporaryDirectory(prefix="pytest-vram-chromium-") as profile:
                done = subprocess.run(
                    [chromium, "--headless", "--no-sandbox", "--disable-gpu",
                     "--hide-scrollbars", "--no-first-run", f"--user-data-dir={profile}",
                     "--virtual-time-budget=15000", f"--window-size={args.window_size}",
                     f"--screenshot={args.output.resolve()}", url],
                    capture_output=True, text=True, timeout=180, check=False,
                )  # fmt: skip
        finally:
            server.shutdown()
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
