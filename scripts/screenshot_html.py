"""Render a sample HTML report and take a screenshot of it in headless Chromium.

    python scripts/screenshot_html.py [--output docs/html-report.png] [--html sample.html]

The sample document holds a realistic mix: a regression, a leak, a new test, an improved one,
tests within their baselines and a node id full of HTML metacharacters. It makes the picture in
docs/ci.md and lets a test check that the page renders in a real browser.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

GiB = 1024**3
MiB = 1024**2
DEVICE = "NVIDIA H100 80GB HBM3"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _test(
    nodeid: str,
    peak: int,
    status: str,
    baseline: int | None = None,
    start: int = GiB,
    scenarios: dict[str, Any] | None = None,
    messages: list[str] | None = None,
) -> dict[str, Any]:
    change = peak - baseline if baseline is not None else None
    return {
        "nodeid": nodeid,
        "backend": "cuda",
        "device": DEVICE,
        "peak_allocated": peak,
        "start_allocated": start,
        "end_allocated": start,
        "peak_increment": peak - start,
        "leftover": 0,
        "peak_reserved": peak + 512 * MiB,
        "peak_device": peak + 1100 * MiB,
        "counters": {"num_ooms": 0, "num_alloc_retries": 0},
        "budgets": [],
        "scenarios": scenarios or {},
        "baseline": {"peak_allocated": baseline} if baseline is not None else None,
        "outcome": "failed" if status in ("regression", "leak") else "passed",
        "status": status,
        "messages": messages or [],
        "change": change,
        "change_percent": round(100 * change / baseline, 2) if change is not None else None,
    }


def sample_document() -> dict[str, Any]:
    """A report document like the one ``pytest --vram-json`` writes, worst test first."""
    leaking = [1200 * MiB + step * 8 * MiB for step in range(1, 41)]
    # A loop that frees what it allocates: flat, with the odd transient buffer still alive.
    steady = [768 * MiB + (24 * MiB if step in (9, 10, 23) else 0) for step in range(1, 41)]
    tests = [
        _test(
            "suites/test_training.py::test_train_step[llama-1b-bf16]",
            19 * GiB,
            "regression",
            baseline=17 * GiB,
            start=2 * GiB,
            messages=[
                "peak allocated 19.00 GiB exceeds the baseline 17.00 GiB by +2.00 GiB "
                "(+11.8%); tolerance 5%"
            ],
        ),
        _test(
            "suites/test_leaks.py::test_cache_per_request",
            leaking[-1] + 256 * MiB,
            "leak",
            baseline=1536 * MiB,
            start=1200 * MiB,
            scenarios={
                "leak_check": {
                    "per_step": leaking,
                    "growth": leaking[-1] - 1200 * MiB,
                    "growth_per_step": 8 * MiB,
                    "steps": len(leaking),
                    "warmup": 3,
                    "tolerance": "0 B",
                    "leaked": True,
                }
            },
            messages=["memory grew by 320.00 MiB over 40 steps (8.00 MiB per step); tolerance 0 B"],
        ),
        _test("suites/test_inference.py::test_generate[kv4096]", 9 * GiB + 96 * MiB, "ok", 9 * GiB),
        _test("suites/test_model.py::test_forward[bf16]", 3 * GiB + 512 * MiB, "improved", 4 * GiB),
        _test("suites/test_model.py::test_forward[fp8]", 2 * GiB, "new"),
        _test(
            "suites/test_leaks.py::test_dataloader_loop",
            1 * GiB,
            "ok",
            baseline=1 * GiB,
            start=512 * MiB,
            scenarios={
                "leak_check": {
                    "per_step": steady,
                    "growth": 0,
                    "growth_per_step": 0.0,
                    "steps": len(steady),
                    "warmup": 3,
                    "tolerance": "0 B",
                    "leaked": False,
                }
            },
        ),
        _test(
            'suites/test_tokenizer.py::test_encode[prompt="<s> fish & chips"]',
            300 * MiB,
            "ok",
            baseline=300 * MiB,
            start=0,
        ),
    ]
    return {
        "pytest_vram": "0.1.0",
        "created": "2026-11-30T04:00:00+00:00",
        "environments": {
            "cuda": {
                "backend": "cuda",
                "device": DEVICE,
                "gpu": DEVICE,
                "torch": "2.13.0+cu128",
                "cuda": "12.8",
                "driver": "570.124.06",
                "total_memory": 85_045_231_616,
            }
        },
        "totals": {
            "measured": len(tests),
            "leak": 1,
            "regression": 1,
            "new": 1,
            "improved": 1,
            "ok": 3,
        },
        "tests": tests,
    }


def find_chromium() -> str | None:
    """The path of a Chromium or Chrome binary on ``PATH``, or None."""
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(
    html_path: str | os.PathLike[str],
    png_path: str | os.PathLike[str],
    *,
    chromium: str | None = None,
    window: str = "1200,1600",
    timeout: float = 90,
) -> None:
    """Screenshot a local HTML file with headless Chromium; raise RuntimeError on failure."""
    binary = chromium or find_chromium()
    if binary is None:
        raise RuntimeError("no chromium binary on PATH (apt-get install chromium)")
    png_path = Path(png_path).resolve()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pytest-vram-chromium-") as profile:
        command = [
            binary,
            "--headless",
            # Root in a container has no user namespace for the sandbox.
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--screenshot={png_path}",
            f"--window-size={window}",
            Path(html_path).resolve().as_uri(),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0 or not png_path.is_file():
        raise RuntimeError(f"chromium failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="docs/html-report.png", help="the PNG to write")
    parser.add_argument("--html", help="also keep the rendered HTML here")
    parser.add_argument("--window-size", default="1200,1600", help="WIDTH,HEIGHT in pixels")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from pytest_vram.report import render_html

    page = render_html(sample_document())
    with tempfile.TemporaryDirectory() as tmp:
        html_path = Path(args.html) if args.html else Path(tmp) / "vram.html"
        html_path.write_text(page, encoding="utf-8")
        try:
            screenshot(html_path, args.output, window=args.window_size)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"screenshot_html: {exc}", file=sys.stderr)
            return 1
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
