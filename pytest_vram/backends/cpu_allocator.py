"""Count the bytes PyTorch's CPU allocator hands out, from inside the allocator.

``cpu_allocator.cpp`` wraps the CPU allocator with one that counts, per watched thread, the bytes
of the blocks it hands out and frees, with their peak. Counting there costs a few atomic adds per
allocation, where watching every op from Python (a ``TorchDispatchMode``) costs microseconds per
op; it also sees what kernels allocate for themselves, as the CUDA allocator's figures do.

The library is compiled once per torch build with the system's C++ compiler (about a second) and
kept in a cache directory: ``$PYTEST_VRAM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pytest-vram``, else
``~/.cache/pytest-vram``. It only needs torch's headers and ``libc10``, which every torch wheel
ships. Where it cannot be built or loaded, :func:`load` raises :class:`CounterUnavailable` with
the reason, and the cpu backend falls back to counting from Python.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

__all__ = [
    "AllocatorCounter",
    "CounterUnavailable",
    "cache_dir",
    "find_compiler",
    "library_path",
    "load",
    "open_library",
]

SOURCE = Path(__file__).with_name("cpu_allocator.cpp")
_COMPILE_TIMEOUT_S = 300


class CounterUnavailable(Exception):
    """The counting allocator cannot be built or loaded here; the message says why."""


def cache_dir() -> Path:
    explicit = os.environ.get("PYTEST_VRAM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pytest-vram"


def _torch_dirs() -> tuple[Path, Path]:
    root = Path(torch.__file__).parent
    return root / "include", root / "lib"


def find_compiler() -> str | None:
    """The C++ compiler the library is built with: ``$CXX``, else the first on ``PATH``."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _library_name(source: bytes, compiler: str) -> str:
    _, lib = _torch_dirs()
    key = "\0".join(
        [
            hashlib.sha256(source).hexdigest(),
            str(torch.__version__),
            str(lib),
            str(torch.compiled_with_cxx11_abi()),
            compiler,
            sys.platform,
        ]
    )
    return f"cpu_allocator-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    include, lib = _torch_dirs()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several pytest-xdist workers may build at once: each writes its own file, the last
    # rename wins, and every one of them is a complete library.
    fd, partial = tempfile.mkstemp(prefix=target.stem + "-", suffix=".so", dir=target.parent)
    os.close(fd)
    command = [
        compiler,
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
        f"-I{include}",
        str(SOURCE),
        "-o",
        partial,
        f"-L{lib}",
        "-lc10",
        f"-Wl,-rpath,{lib}",
    ]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["(no output)"]
            first_error = next((line for line in lines if "error" in line), lines[0])
            raise CounterUnavailable(
                f"{Path(compiler).name} could not build {SOURCE.name}: {first_error}"
            )
        os.replace(partial, target)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CounterUnavailable(f"building {SOURCE.name} failed: {exc}") from exc
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def library_path() -> Path:
    """The built library for this torch, built first if the cache has none."""
    if sys.platform == "win32":
        raise CounterUnavailable("building the counting allocator is not supported on Windows")
    compiler = find_compiler()
    if compiler is None:
        raise CounterUnavailable("no C++ compiler found (set CXX, or install g++ or clang++)")
    target = cache_dir() / _library_name(SOURCE.read_bytes(), compiler)
    if not target.exists():
        _build(compiler, target)
    return target


_library: ctypes.CDLL | None = None


def open_library() -> tuple[ctypes.CDLL, Path]:
    """The built library, loaded but not installed, and its path. A cached library that no
    longer loads (a torch reinstalled in place, a damaged file) is built anew, once."""
    target = library_path()
    try:
        return ctypes.CDLL(str(target)), target
    except OSError:
        target.unlink(missing_ok=True)
    target = library_path()
    try:
        return ctypes.CDLL(str(target)), target
    except OSError as exc:
        raise CounterUnavailable(f"could not load {target}: {exc}") from exc


def load() -> ctypes.CDLL:
    """The counting allocator's library, installed as PyTorch's CPU allocator (once a process)."""
    global _library
    if _library is not None:
        return _library
    library, target = open_library()
    handle = ctypes.c_void_p
    for name, restype, argtypes in [
        ("pytest_vram_install", ctypes.c_int, []),
        ("pytest_vram_installed", ctypes.c_int, []),
        ("pytest_vram_new_counter", handle, []),
        ("pytest_vram_watch", ctypes.c_int, [handle]),
        ("pytest_vram_unwatch", None, [handle]),
        ("pytest_vram_counter_layout", ctypes.c_int, []),
        ("pytest_vram_reset_peak", None, [handle]),
    ]:
        function = getattr(library, name)
        function.restype = restype
        function.argtypes = argtypes
    if library.pytest_vram_counter_layout() != 0:
        raise CounterUnavailable(f"{target} lays its counters out unlike this module reads them")
    if library.pytest_vram_install() != 0:
        raise CounterUnavailable(
            "another CPU allocator was installed with a higher priority; it is left in place"
        )
    _library = library
    return library


class AllocatorCounter:
    """Bytes of the CPU blocks allocated on the watching thread and still alive, and their peak.

    :meth:`watch` counts the calling thread's allocations from then on, until :meth:`unwatch`;
    frees of counted blocks are counted on any thread, watched or not. Several counters may
    watch at once (up to four), each with its own figures.
    """

    name = "allocator"

    def __init__(self) -> None:
        self._library = load()
        address = self._library.pytest_vram_new_counter()
        self._handle = ctypes.c_void_p(address)
        # Read in place: a ctypes call per read would cost a microsecond, several per test.
        self._current = ctypes.c_int64.from_address(address)
        self._peak = ctypes.c_int64.from_address(address + 8)

    def watch(self) -> None:
        if not self._library.pytest_vram_installed():
            raise CounterUnavailable(
                "PyTorch's CPU allocator was replaced after pytest-vram installed its counter"
            )
        if self._library.pytest_vram_watch(self._handle) != 0:
            raise CounterUnavailable("four counters already watch CPU allocations")

    def unwatch(self) -> None:
        self._library.pytest_vram_unwatch(self._handle)

    def __del__(self) -> None:
        # A counter nobody can read any more must not hold one of the four watching slots.
        with contextlib.suppress(Exception):
            self.unwatch()

    @property
    def current(self) -> int:
        return self._current.value

    @property
    def peak(self) -> int:
        return self._peak.value

    def reset_peak(self) -> None:
        self._library.pytest_vram_reset_peak(self._handle)
