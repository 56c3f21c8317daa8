"""The counting allocator's library: built once per torch build, cached, and checked before it
is loaded.

``allocator.cpp`` is compiled with the system's C++ compiler (about a second) and kept in a
cache directory: ``$PYTEST_VRAM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pytest-vram``, else
``~/.cache/pytest-vram``. It only needs torch's headers and ``libc10``, which every torch wheel
ships. Beside it a build stamp records its size and sha256 and what it was built for; a library
that does not match its stamp (damaged, truncated, or another file at that name) is never
loaded but built anew, into a new file renamed over the old. Only a library that this user owns
and no other can write is loaded, in a cache directory that no other user owns or can write:
a library planted there runs its constructors in this process the moment it is loaded. The
file loaded is the one that was checked, through the descriptor it was checked by, not
whatever its name points at by then. Where the cache directory cannot be written, or is
refused, the library is built into a cache of this user's under the temporary directory.
Where it cannot be built or loaded, :func:`open_library` raises :class:`CounterUnavailable`
with the reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from pytest_vram.atomic import write_atomic
from pytest_vram.locking import held

__all__ = [
    "CounterUnavailable",
    "cache_dir",
    "check_library",
    "find_compiler",
    "library_path",
    "open_library",
    "stamp_path",
]

SOURCE = Path(__file__).with_name("allocator.cpp")
_COMPILE_TIMEOUT_S = 300
_STAMP_VERSION = 1
# Why the last _find_library() built outside the configured cache: the note the cpu backend
# gives for the library it loads.
_cache_note: str | None = None


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


def _build_key(source: bytes, compiler: str) -> str:
    """What a library is built from: a library built for another key is not this one."""
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
    return hashlib.sha256(key.encode()).hexdigest()


def _library_name(source: bytes, compiler: str) -> str:
    return f"cpu_allocator-{_build_key(source, compiler)[:16]}.so"


def stamp_path(library: Path) -> Path:
    """The build stamp beside ``library``: its size and sha256, and the key it was built for."""
    return library.with_suffix(".stamp")


class _CacheUnusable(Exception):
    """A cache directory that cannot hold a new library, or that another user could have
    written to; another cache may do."""


class _Stale(Exception):
    """A library that is not the one its stamp describes: it is built anew where it is."""


def _reason(exc: OSError | ValueError) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


def _others_could_write(path: Path, info: os.stat_result) -> str | None:
    """Why another user could have written ``path`` (as ``info`` found it), or None. Root is
    this user where pytest runs as root, as in most CI containers."""
    if info.st_uid != os.geteuid():
        return f"{path} belongs to uid {info.st_uid}, and this process runs as uid {os.geteuid()}"
    if info.st_mode & 0o022:
        who = "other users" if info.st_mode & 0o002 else "its group"
        return f"{path} is mode {stat.S_IMODE(info.st_mode):04o}: {who} can write it"
    return None


def _check_directory(directory: Path) -> None:
    """Refuse a cache directory that another user owns or could write to: they could put a
    library and a stamp to match in it. One that is missing or not a directory is left to the
    build, which says so."""
    try:
        info = os.stat(directory)
    except OSError:
        return
    if stat.S_ISDIR(info.st_mode):
        problem = _others_could_write(directory, info)
        if problem:
            raise _CacheUnusable(problem)


def _open_own(path: Path) -> int:
    """``path`` opened for reading, and checked through what was opened: a regular file of this
    user's that no other user can write. A symbolic link is not followed, and a FIFO does not
    block the open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):
            raise _CacheUnusable(f"{path} is a symbolic link") from None
        raise
    try:
        info = os.fstat(fd)
        problem = (
            _others_could_write(path, info)
            if stat.S_ISREG(info.st_mode)
            else f"{path} is not a regular file"
        )
        if problem:
            raise _CacheUnusable(problem)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_stamp(library: Path) -> dict[str, object]:
    try:
        fd = _open_own(stamp_path(library))
    except FileNotFoundError:
        raise _Stale("it has no build stamp") from None
    except OSError as exc:
        raise _Stale(f"its build stamp cannot be read ({_reason(exc)})") from None
    try:
        with os.fdopen(fd, "rb") as file:
            stamp = json.loads(file.read().decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise _Stale(f"its build stamp cannot be read ({_reason(exc)})") from None
    if not isinstance(stamp, dict) or stamp.get("version") != _STAMP_VERSION:
        raise _Stale("its build stamp is not one this version of pytest-vram writes")
    return stamp


def _verified(library: Path, key: str) -> bytes:
    """The content of ``library``, read through the one descriptor that was checked, and
    checked against its stamp: :func:`_dlopen` loads these bytes, so a file put at that name
    after the check is never loaded. Raises :class:`_Stale` where the library is to be built
    anew, and :class:`_CacheUnusable` where another user could have written it or its stamp."""
    try:
        fd = _open_own(library)
    except FileNotFoundError:
        raise _Stale("it has not been built") from None
    except OSError as exc:
        raise _Stale(f"it cannot be read ({_reason(exc)})") from None
    replaced = "it is not the file its build stamp describes (damaged or replaced)"
    try:
        stamp = _read_stamp(library)
        if stamp.get("key") != key:
            raise _Stale("it was built for another torch, compiler or source")
        if os.fstat(fd).st_size != stamp.get("size"):  # read and hash only what may match
            raise _Stale(replaced)
        with open(fd, "rb", closefd=False) as file:
            data = file.read()
    except OSError as exc:
        raise _Stale(f"it cannot be read ({_reason(exc)})") from None
    finally:
        os.close(fd)
    if (len(data), hashlib.sha256(data).hexdigest()) != (stamp.get("size"), stamp.get("sha256")):
        raise _Stale(replaced)
    return data


def check_library(library: Path, key: str) -> str | None:
    """Why ``library`` is not the complete library its stamp says was built for ``key``, or is
    not safe to load, or None when it is. Only a library that passes is loaded: dlopen of a
    truncated file kills the process with SIGBUS, another file at that name lacks the counter's
    symbols, and a file another user could write runs their code in this process."""
    try:
        _verified(library, key)
    except (_Stale, _CacheUnusable) as exc:
        return str(exc)
    return None


def _private_temp_cache() -> Path:
    """A cache of this user's own under the temporary directory, for when the configured one
    cannot be written. A directory there that another user could write is not used: a library
    planted in it would run in this process."""
    directory = Path(tempfile.gettempdir()) / f"pytest-vram-{os.geteuid()}"
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(directory)
    except OSError as exc:
        raise _CacheUnusable(f"cannot create {directory} ({_reason(exc)})") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise _CacheUnusable(f"{directory} is not a directory of this user's")
    if info.st_mode & 0o022:
        raise _CacheUnusable(f"{directory} can be written by other users")
    return directory


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Held while a library and its stamp are replaced: pytest-xdist workers that find none
    wait for the first to build it instead of each building their own."""
    if directory.exists() and not directory.is_dir():
        raise _CacheUnusable(f"{directory} is a file, not a directory")
    lock_path = directory / "cpu_allocator.lock"
    try:
        # Never group-writable, whatever the umask: such a cache would be refused.
        directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        if lock_path.is_symlink():  # the directory is this user's alone: nobody else put it
            raise _CacheUnusable(f"{lock_path} is a symbolic link")
        lock = contextlib.ExitStack()
        lock.enter_context(held(lock_path))
    except OSError as exc:
        raise _CacheUnusable(f"cannot write to {directory} ({_reason(exc)})") from None
    with lock:
        yield


def _write_stamp(library: Path, key: str, size: int, sha256: str) -> None:
    stamp = {"version": _STAMP_VERSION, "key": key, "size": size, "sha256": sha256}
    write_atomic(stamp_path(library), json.dumps(stamp), mode=0o644)  # as readable as the library


def _build(compiler: str, target: Path, key: str) -> None:
    """Build ``target`` and then its stamp, each into a new file renamed into place: a library
    that a running process has mapped is never written over (that process would die of SIGBUS
    when it next touched the changed pages), and a reader sees a whole file or none."""
    include, lib = _torch_dirs()
    try:
        fd, partial = tempfile.mkstemp(prefix=target.stem + "-", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise _CacheUnusable(f"cannot write to {target.parent} ({_reason(exc)})") from None
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
        "-ltorch_cpu",
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
        # mkstemp made the file private; a cache that users share needs it readable, as a
        # compiler's own output is.
        os.chmod(partial, 0o755)
        data = Path(partial).read_bytes()
        os.replace(partial, target)
        _write_stamp(target, key, len(data), hashlib.sha256(data).hexdigest())
    except (OSError, subprocess.SubprocessError) as exc:
        raise CounterUnavailable(f"building {SOURCE.name} failed: {exc}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)


def _library_in(directory: Path, name: str, key: str, compiler: str) -> bytes:
    """The library in ``directory``, read and checked against its stamp, built anew when it
    fails. Raises :class:`_CacheUnusable` where another user could have written the directory,
    the library or its stamp: nothing of theirs is loaded, and nothing is built beside it."""
    target = directory / name
    _check_directory(directory)
    try:
        return _verified(target, key)  # the common case: read only, no lock, nothing written
    except _Stale:
        pass
    with _build_lock(directory):
        _check_directory(directory)  # made just now, by this process or another
        # Another process may have built it while this one waited for the lock.
        try:
            return _verified(target, key)
        except _Stale:
            _build(compiler, target, key)
        try:
            return _verified(target, key)
        except _Stale as exc:
            raise CounterUnavailable(
                f"{target} fails its check right after its build: {exc}"
            ) from None


def _find_library() -> tuple[Path, bytes]:
    """The built library for this torch and its content, checked against its build
    stamp, and built first if the cache has no library that passes. Where the cache directory
    cannot be written or is refused, the library is built into a cache of this user's under the
    temporary directory."""
    global _cache_note
    _cache_note = None
    if sys.platform == "win32":
        raise CounterUnavailable("building the counting allocator is not supported on Windows")
    compiler = find_compiler()
    if compiler is None:
        raise CounterUnavailable("no C++ compiler found (set CXX, or install g++ or clang++)")
    source = SOURCE.read_bytes()
    key, name = _build_key(source, compiler), _library_name(source, compiler)
    configured = cache_dir()
    try:
        return configured / name, _library_in(configured, name, key, compiler)
    except _CacheUnusable as exc:
        problem = str(exc)
    hint = "(set PYTEST_VRAM_CACHE_DIR to a directory of your own that only you can write)"
    try:
        directory = _private_temp_cache()
        data = _library_in(directory, name, key, compiler)
    except _CacheUnusable as exc:
        raise CounterUnavailable(
            f"no cache directory to build the counting allocator into: {problem}; {exc} {hint}"
        ) from None
    _cache_note = (
        f"the cpu counter's cache {configured} is not usable ({problem}); it was built into "
        f"{directory} instead {hint}"
    )
    return directory / name, data


def library_path() -> Path:
    """The built library for this torch, checked against its build stamp, and built first if
    the cache has no library that passes. Where the cache directory cannot be written or is
    refused, the library is built into a cache of this user's under the temporary directory."""
    return _find_library()[0]


def _dlopen(data: bytes, target: Path) -> ctypes.CDLL:
    """Load ``data``, the checked content of ``target``, and not whatever ``target`` names by
    now: from a copy in a new directory only this user can enter (mode 0700), removed once
    loaded (the mapping keeps it). The copy goes beside ``target``, where a library could be
    mapped executable before, else under the temporary directory. A new name each time also
    keeps dlopen from handing back a library it loaded before under the same name. Raises
    OSError where the copy does not load."""
    problems = []
    for parent in (target.parent, Path(tempfile.gettempdir())):
        try:
            private = Path(tempfile.mkdtemp(prefix=".pytest-vram-load-", dir=parent))
        except OSError as exc:
            problems.append(f"{parent} ({_reason(exc)})")
            continue
        try:
            copy = private / target.name
            try:
                fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o700)
                with os.fdopen(fd, "wb") as file:
                    file.write(data)
            except OSError as exc:
                problems.append(f"{private} ({_reason(exc)})")
                continue
            try:
                return ctypes.CDLL(str(copy))
            except OSError as exc:
                raise OSError(str(exc).replace(str(copy), str(target))) from None
        finally:
            shutil.rmtree(private, ignore_errors=True)
    raise CounterUnavailable(
        f"cannot copy {target} to load it into a directory of its own: {'; '.join(problems)}"
    )


def open_library() -> tuple[ctypes.CDLL, Path]:
    """The built library, loaded but not installed, and its path. A library that matches its
    stamp and still does not load (a torch reinstalled in place) is built anew, once."""
    target, data = _find_library()
    try:
        return _dlopen(data, target), target
    except OSError:
        # Unlinked, never truncated: a process that has it mapped keeps its copy.
        with contextlib.suppress(OSError):
            stamp_path(target).unlink()
    target, data = _find_library()
    try:
        return _dlopen(data, target), target
    except OSError as exc:
        raise CounterUnavailable(f"could not load {target}: {exc}") from exc
