"""The counting allocator's cache: a damaged or foreign library in it is never loaded but built
anew, a rebuild never writes over a library in place, a library another user could have planted
is never loaded (the bytes loaded are the ones checked), and a cache that cannot be written or is
refused falls back to one under the temporary directory, or to the dispatch counter with a note
that says why.

The end-to-end cases run pytest in a subprocess: what they guard against killed the process
(SIGBUS in dlopen) or failed every test, which no in-process check would survive to report.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pytest_vram.backends import BackendUnavailable
from pytest_vram.backends.cpu import allocator as cpu_allocator
from pytest_vram.backends.cpu import build as cpu_build
from pytest_vram.backends.cpu.allocator import CounterUnavailable
from pytest_vram.backends.cpu.backend import CpuBackend

pytestmark = pytest.mark.skipif(
    cpu_build.find_compiler() is None, reason="no C++ compiler to build the counter"
)

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away needs root")
PR_CAPBSET_DROP = 24  # from <linux/prctl.h>, and the capabilities from <linux/capability.h>
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2


def _key() -> str:
    compiler = cpu_build.find_compiler()
    assert compiler is not None
    return cpu_build._build_key(cpu_build.SOURCE.read_bytes(), compiler)


def _name() -> str:
    compiler = cpu_build.find_compiler()
    assert compiler is not None
    return cpu_build._library_name(cpu_build.SOURCE.read_bytes(), compiler)


@pytest.fixture(scope="module")
def built() -> Path:
    """One library built for this torch, with its stamp, for tests to copy instead of building:
    the one in the session's cache (see conftest.py), built there once if it is not yet."""
    path = cpu_build.library_path()
    assert cpu_build.check_library(path, _key()) is None
    return path


@pytest.fixture(scope="module")
def foreign_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid shared library that is not the counter: it lacks every symbol the counter has."""
    directory = tmp_path_factory.mktemp("foreign")
    source = directory / "foreign.cpp"
    source.write_text('extern "C" int not_the_counter(void) { return 1; }\n')
    compiler = cpu_build.find_compiler()
    assert compiler is not None
    target = directory / "foreign.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", str(source), "-o", str(target)], check=True, timeout=120
    )
    return target


def _libc() -> Path:
    for candidate in (
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/lib/aarch64-linux-gnu/libc.so.6",
        "/lib64/libc.so.6",
        "/usr/lib/libc.so.6",
    ):
        if Path(candidate).is_file():
            return Path(candidate)
    pytest.skip("no libc.so.6 found to stand in for the library")


def _truncate(path: Path, foreign: Path) -> None:
    # Headers intact, the end gone: dlopen maps past the end of the file and dies of SIGBUS.
    with path.open("r+b") as file:
        file.truncate(path.stat().st_size // 2)


def _garbage(path: Path, foreign: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


def _libc_copy(path: Path, foreign: Path) -> None:
    shutil.copyfile(_libc(), path)


def _foreign(path: Path, foreign: Path) -> None:
    shutil.copyfile(foreign, path)


def _empty(path: Path, foreign: Path) -> None:
    path.write_bytes(b"")


def _stamp_removed(path: Path, foreign: Path) -> None:
    cpu_build.stamp_path(path).unlink()


def _stamp_garbage(path: Path, foreign: Path) -> None:
    cpu_build.stamp_path(path).write_text("{not json")


def _stamp_for_another_key(path: Path, foreign: Path) -> None:
    stamp = cpu_build.stamp_path(path)
    fields = json.loads(stamp.read_text())
    fields["key"] = "0" * 64
    stamp.write_text(json.dumps(fields))


def _foreign_with_a_matching_stamp_of_its_own(path: Path, foreign: Path) -> None:
    # Someone copied another library there and its size in: the sha256 still tells them apart.
    shutil.copyfile(foreign, path)
    stamp = cpu_build.stamp_path(path)
    fields = json.loads(stamp.read_text())
    fields["size"] = path.stat().st_size
    stamp.write_text(json.dumps(fields))


DAMAGES: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "truncated": (_truncate, "not the file its build stamp describes"),
    "garbage": (_garbage, "not the file its build stamp describes"),
    "libc": (_libc_copy, "not the file its build stamp describes"),
    "foreign": (_foreign, "not the file its build stamp describes"),
    "empty": (_empty, "not the file its build stamp describes"),
    "no-stamp": (_stamp_removed, "no build stamp"),
    "stamp-garbage": (_stamp_garbage, "build stamp cannot be read"),
    "stamp-other-key": (_stamp_for_another_key, "built for another torch"),
    "foreign-same-size": (
        _foreign_with_a_matching_stamp_of_its_own,
        "not the file its build stamp describes",
    ),
}


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A library another user could plant in the cache: a real shared object whose constructor
    writes a marker file the moment anything loads it. The library and the marker's path."""
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (cc) to build a planted library")
    directory = tmp_path_factory.mktemp("planted")
    marker = directory / "constructor-ran"
    source = directory / "planted.c"
    source.write_text(
        "#include <stdio.h>\n"
        "__attribute__((constructor)) static void planted(void) {\n"
        f'    FILE *marker = fopen({json.dumps(str(marker))}, "w");\n'
        "    if (marker) fclose(marker);\n"
        "}\n"
    )
    library = directory / "planted.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", str(source), "-o", str(library)], check=True, timeout=120
    )
    # The marker works: loading the library, in a process of its own, writes it.
    load = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"
    subprocess.run([sys.executable, "-c", load, str(library)], check=True, timeout=120)
    assert marker.exists()
    marker.unlink()
    return library, marker


def _plant(path: Path, planted: Path) -> None:
    """Put ``planted`` at ``path``, with the stamp there copied and edited to match it: only the
    file's owner and who else can write it tell it apart from the library."""
    path.unlink(missing_ok=True)
    shutil.copy(planted, path)
    stamp = cpu_build.stamp_path(path)
    fields = json.loads(stamp.read_text())
    data = path.read_bytes()
    fields.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    stamp.write_text(json.dumps(fields))


def _seed_temporary_cache(built: Path) -> Path:
    """The cache under the temporary directory that a refused cache falls back to, holding a
    good library already (so that no test here waits for a build)."""
    directory = Path(tempfile.gettempdir()) / f"pytest-vram-{os.geteuid()}"
    directory.mkdir(mode=0o700)
    for source in (built, cpu_build.stamp_path(built)):
        shutil.copy2(source, directory / source.name)
    return directory


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, built: Path) -> Path:
    """A cache holding a good library, nothing loaded yet, and a temporary directory of the
    test's own (for the fallback cache)."""
    monkeypatch.setattr(cpu_allocator, "_library", None)
    monkeypatch.setattr(cpu_build, "_cache_note", None)  # restored after the test
    monkeypatch.setattr(cpu_allocator, "_loaded_note", None)
    directory = tmp_path / "cache"
    directory.mkdir()
    shutil.copy2(built, directory / built.name)
    shutil.copy2(cpu_build.stamp_path(built), cpu_build.stamp_path(directory / built.name))
    monkeypatch.setenv("PYTEST_VRAM_CACHE_DIR", str(directory))
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    return directory


@pytest.fixture
def checked_dlopen(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The sha256 of every library cpu_allocator loads, which should be a private copy (in a
    directory of mode 0700) of bytes checked against a stamp. A damaged library must never
    reach dlopen, where it could kill this process, and a swapped one must not either."""
    loaded: list[str] = []
    real = cpu_build.ctypes.CDLL

    def cdll(name: str, *args: object, **kwargs: object) -> object:
        path = Path(name)
        if stat.S_IMODE(path.parent.stat().st_mode) == 0o700:
            loaded.append(hashlib.sha256(path.read_bytes()).hexdigest())
        else:
            # The file itself, which can change after a check: at least it must pass one now.
            assert cpu_build.check_library(path, _key()) is None, f"{path} loaded unchecked"
            loaded.append(f"{path} itself, not a private copy")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(cpu_build.ctypes, "CDLL", cdll)
    return loaded


def _stamped_sha256(library: Path) -> str:
    return json.loads(cpu_build.stamp_path(library).read_text())["sha256"]


# -- in this process ---------------------------------------------------------------------------


def test_the_build_stamp_records_the_library_and_what_it_was_built_for(cache: Path) -> None:
    path = cpu_build.library_path()
    stamp = json.loads(cpu_build.stamp_path(path).read_text())
    data = path.read_bytes()
    assert stamp["key"] == _key()
    assert stamp["size"] == len(data)
    assert stamp["sha256"] == hashlib.sha256(data).hexdigest()
    assert cpu_build.check_library(path, _key()) is None
    assert not list(cache.glob("*.tmp"))


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_library_fails_its_stamp_check_with_the_reason(
    cache: Path, foreign_library: Path, damage: str
) -> None:
    path = cache / _name()
    spoil, reason = DAMAGES[damage]
    spoil(path, foreign_library)
    assert reason in (cpu_build.check_library(path, _key()) or "")


# Each rebuild compiles the library (seconds). By default the check above tells each damage
# apart, test_the_library_loaded_is_the_file_that_was_checked loads only what was checked, and
# test_cpu_allocator.py builds the library into an empty cache.
@pytest.mark.slow
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_library_that_fails_its_stamp_is_rebuilt_not_loaded(
    cache: Path, foreign_library: Path, checked_dlopen: list[str], damage: str
) -> None:
    path = cache / _name()
    spoil, reason = DAMAGES[damage]
    spoil(path, foreign_library)
    assert reason in (cpu_build.check_library(path, _key()) or "")
    library, opened = cpu_build.open_library()
    assert opened == path and checked_dlopen == [_stamped_sha256(path)]
    assert library.pytest_vram_counter_layout() == 0  # loaded apart, never installed
    assert cpu_build.check_library(path, _key()) is None
    assert not list(cache.glob("*.tmp"))
    assert cpu_build._cache_note is None  # the cache itself was fine


@pytest.mark.slow  # builds the library
def test_a_rebuild_replaces_the_file_and_never_writes_into_the_old_one(cache: Path) -> None:
    # A process that has the old library mapped would die of SIGBUS if its pages changed.
    path = cache / _name()
    before = path.read_bytes()
    cpu_build.stamp_path(path).unlink()
    with path.open("rb") as old:
        old_inode = os.fstat(old.fileno()).st_ino
        cpu_build.library_path()
        assert os.fstat(old.fileno()).st_nlink == 0  # renamed over, not rewritten
        assert old.read() == before
    assert path.stat().st_ino != old_inode
    assert cpu_build.check_library(path, _key()) is None


def test_a_missing_symbol_is_a_counter_unavailable_not_an_attribute_error(
    cache: Path, foreign_library: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Were a foreign library ever loaded (say a stamp forged to match it), say so plainly.
    monkeypatch.setattr(
        cpu_build,
        "_find_library",
        lambda: (foreign_library, foreign_library.read_bytes()),
    )
    with pytest.raises(CounterUnavailable, match="is not pytest-vram's counter: no pytest_vram_"):
        cpu_allocator.load()
    backend = CpuBackend("auto")
    assert backend.counter.name == "dispatch"
    assert "is not pytest-vram's counter" in backend.notes()[0]


# Builds the library; the fallback to the temporary cache runs by default, on a seeded one, in
# test_a_library_another_user_could_have_planted_is_never_loaded.
@pytest.mark.slow
def test_a_cache_dir_that_is_a_file_builds_into_the_temporary_cache(
    cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("PYTEST_VRAM_CACHE_DIR", str(blocked))
    path = cpu_build.library_path()
    assert path.parent == Path(tempfile.gettempdir()) / f"pytest-vram-{os.geteuid()}"
    assert cpu_build.check_library(path, _key()) is None
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    note = cpu_build._cache_note or ""
    assert f"{blocked} is a file, not a directory" in note
    assert "built into" in note and str(path.parent) in note
    assert blocked.read_text() == "not a directory"


@pytest.mark.slow  # builds the library
def test_a_cache_dir_under_a_file_builds_into_the_temporary_cache(
    cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("PYTEST_VRAM_CACHE_DIR", str(blocked / "cache"))
    path = cpu_build.library_path()
    assert path.parent.name == f"pytest-vram-{os.geteuid()}"
    note = cpu_build._cache_note or ""
    assert "Not a directory" in note


def test_a_read_only_cache_with_a_good_library_is_used_as_it_is(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reading needs no lock and writes nothing: a cache baked into a read-only image works.
    def no_writes(*args: object, **kwargs: object) -> None:
        raise AssertionError("wrote to a cache that has a good library")

    monkeypatch.setattr(cpu_build, "_build_lock", no_writes)
    assert cpu_build.library_path() == cache / _name()
    assert cpu_build._cache_note is None


def test_a_temporary_cache_that_others_can_write_is_not_used(
    cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("PYTEST_VRAM_CACHE_DIR", str(blocked))
    shared = Path(tempfile.gettempdir()) / f"pytest-vram-{os.geteuid()}"
    shared.mkdir()
    shared.chmod(0o777)  # mkdir's mode is masked; chmod's is not
    with pytest.raises(CounterUnavailable, match="can be written by other users"):
        cpu_build.library_path()
    assert list(shared.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_a_temporary_cache_of_another_user_is_not_used(
    cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("PYTEST_VRAM_CACHE_DIR", str(blocked))
    theirs = Path(tempfile.gettempdir()) / f"pytest-vram-{os.geteuid()}"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(CounterUnavailable, match="not a directory of this user's"):
        cpu_build.library_path()


def test_with_no_cache_to_build_into_auto_counts_from_python_and_names_the_problem(
    cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("PYTEST_VRAM_CACHE_DIR", str(blocked))
    monkeypatch.setattr(tempfile, "tempdir", str(blocked))  # the temporary directory too
    with pytest.raises(CounterUnavailable) as info:
        cpu_build.library_path()
    message = str(info.value)
    assert f"{blocked} is a file, not a directory" in message
    assert f"cannot create {blocked}/pytest-vram-" in message
    assert "PYTEST_VRAM_CACHE_DIR" in message

    backend = CpuBackend("auto")
    assert backend.counter.name == "dispatch"
    (note,) = backend.notes()
    assert "counts from Python" in note and "is a file, not a directory" in note
    with pytest.raises(BackendUnavailable, match="allocator counter: no cache directory"):
        CpuBackend("allocator")


def _world_writable_cache(library: Path) -> str:
    library.parent.chmod(0o777)  # chmod's mode is not masked
    return f"{library.parent} is mode 0777: other users can write it"


def _group_writable_cache(library: Path) -> str:
    library.parent.chmod(0o775)
    return f"{library.parent} is mode 0775: its group can write it"


def _group_writable_library(library: Path) -> str:
    library.chmod(0o775)
    return f"{library} is mode 0775: its group can write it"


def _world_writable_stamp(library: Path) -> str:
    stamp = cpu_build.stamp_path(library)
    stamp.chmod(0o666)
    return f"{stamp} is mode 0666: other users can write it"


def _symlinked_library(library: Path) -> str:
    # The file the link leads to is this user's and only theirs to write: the link is refused
    # as such, since whoever can write the link chooses what it leads to.
    elsewhere = library.parent.parent / "elsewhere.so"
    library.rename(elsewhere)
    library.symlink_to(elsewhere)
    return f"{library} is a symbolic link"


def _cache_of_another_user(library: Path) -> str:
    os.chown(library.parent, NOBODY, NOBODY)
    return f"{library.parent} belongs to uid {NOBODY}, and this process runs as uid {os.geteuid()}"


def _library_of_another_user(library: Path) -> str:
    os.chown(library, NOBODY, NOBODY)
    return f"{library} belongs to uid {NOBODY}, and this process runs as uid {os.geteuid()}"


def _stamp_of_another_user(library: Path) -> str:
    stamp = cpu_build.stamp_path(library)
    os.chown(stamp, NOBODY, NOBODY)
    return f"{stamp} belongs to uid {NOBODY}, and this process runs as uid {os.geteuid()}"


EXPOSURES: list[object] = [
    pytest.param(_world_writable_cache, id="cache-world-writable"),
    pytest.param(_group_writable_cache, id="cache-group-writable"),
    pytest.param(_group_writable_library, id="library-group-writable"),
    pytest.param(_world_writable_stamp, id="stamp-world-writable"),
    pytest.param(_symlinked_library, id="library-symlink"),
    pytest.param(_cache_of_another_user, id="cache-of-another-user", marks=needs_root),
    pytest.param(_library_of_another_user, id="library-of-another-user", marks=needs_root),
    pytest.param(_stamp_of_another_user, id="stamp-of-another-user", marks=needs_root),
]


@pytest.mark.parametrize("expose", EXPOSURES)
def test_a_library_another_user_could_have_planted_is_never_loaded(
    cache: Path,
    built: Path,
    planted: tuple[Path, Path],
    checked_dlopen: list[str],
    expose: Callable[[Path], str],
) -> None:
    planted_library, marker = planted
    path = cache / _name()
    _plant(path, planted_library)
    reason = expose(path)
    before = {entry.name: entry.read_bytes() for entry in cache.iterdir()}
    fallback = _seed_temporary_cache(built)

    library, opened = cpu_build.open_library()
    assert not marker.exists(), "the planted library's constructor ran"
    assert opened == fallback / _name()
    assert library.pytest_vram_counter_layout() == 0  # the real counter, loaded apart
    assert checked_dlopen == [_stamped_sha256(built)]
    note = cpu_build._cache_note or ""
    assert f"the cpu counter's cache {cache} is not usable ({reason}); " in note
    assert f"it was built into {fallback} instead" in note
    # Refused, not rebuilt: nothing is written into a cache another user could write.
    assert {entry.name: entry.read_bytes() for entry in cache.iterdir()} == before


def test_the_library_loaded_is_the_file_that_was_checked(
    cache: Path,
    planted: tuple[Path, Path],
    checked_dlopen: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A library swapped in between the check and dlopen, with a stamp to match, is not loaded.
    planted_library, marker = planted
    path = cache / _name()
    genuine = _stamped_sha256(path)
    real = cpu_build._verified

    def then_swap(library: Path, key: str) -> bytes:
        data = real(library, key)
        _plant(library, planted_library)
        return data

    monkeypatch.setattr(cpu_build, "_verified", then_swap)
    library, opened = cpu_build.open_library()
    assert not marker.exists(), "the swapped-in library's constructor ran"
    assert opened == path
    assert library.pytest_vram_counter_layout() == 0
    assert checked_dlopen == [genuine]


def test_a_good_library_is_loaded_from_the_cache_and_reused(
    cache: Path, checked_dlopen: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def must_not_build(*args: object) -> None:
        raise AssertionError("built again although the cache has a good library")

    monkeypatch.setattr(cpu_build, "_build", must_not_build)
    path = cache / _name()
    before = sorted(cache.iterdir())
    for _ in range(2):
        library, opened = cpu_build.open_library()
        assert opened == path
        assert library.pytest_vram_counter_layout() == 0
    assert checked_dlopen == [_stamped_sha256(path)] * 2
    assert cpu_build._cache_note is None
    assert sorted(cache.iterdir()) == before  # the private copies it loaded are gone


@pytest.mark.slow
def test_a_cache_made_under_a_umask_that_lets_the_group_write_is_not_refused(
    cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # umask 002 is the default on distributions with a group per user: the cache made under it
    # must not be one the next run refuses as group-writable.
    fresh = tmp_path / "fresh" / "pytest-vram"
    monkeypatch.setenv("PYTEST_VRAM_CACHE_DIR", str(fresh))
    umask = os.umask(0o002)
    try:
        path = cpu_build.library_path()
    finally:
        os.umask(umask)
    assert path.parent == fresh
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o755
    assert cpu_build.check_library(path, _key()) is None
    assert cpu_build._cache_note is None
    assert cpu_build.library_path() == path and cpu_build._cache_note is None


# -- in a subprocess: pytest itself, as a user runs it -------------------------------------------

TEST_FILE = """
import torch

def test_counted(vram):
    x = torch.ones(256, device=vram.device)
"""


def _workdir(base: Path) -> Path:
    """A directory under ``base`` with one measured test in it."""
    directory = Path(tempfile.mkdtemp(prefix="pytest-vram-run-", dir=base))
    (directory / "test_counted.py").write_text(TEST_FILE)
    return directory


def _run_pytest(
    workdir: Path,
    env: dict[str, str],
    *args: str,
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, **env}
    environment.pop("PYTEST_ADDOPTS", None)
    environment.pop("PYTEST_XDIST_WORKER", None)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"]
    command += ["--vram-backend=cpu", "--vram-report", *args, "test_counted.py"]
    return subprocess.run(
        command,
        cwd=workdir,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        preexec_fn=preexec_fn,
    )


def _assert_no_crash(done: subprocess.CompletedProcess[str]) -> str:
    output = done.stdout + done.stderr
    assert "Fatal Python error" not in output, output
    assert "Traceback" not in output, output
    assert done.returncode >= 0, f"killed by signal {-done.returncode}:\n{output}"
    return output


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "garbage", "libc", "foreign"])
def test_pytest_with_a_damaged_cached_library_rebuilds_it_and_passes(
    cache: Path, foreign_library: Path, tmp_path: Path, damage: str
) -> None:
    path = cache / _name()
    DAMAGES[damage][0](path, foreign_library)
    workdir = _workdir(tmp_path)
    # The run that finds the damage, and for the SIGBUS case also the one after it, which
    # used to die the same way.
    for _ in range(2 if damage == "truncated" else 1):
        done = _run_pytest(
            workdir, {"PYTEST_VRAM_CACHE_DIR": str(cache)}, "--vram-cpu-counter=allocator"
        )
        output = _assert_no_crash(done)
        assert done.returncode == 0, output
        assert "1 passed" in output and "1.00 KiB" in output
        assert "pytest-vram:" not in output  # no note: the cache was rebuilt where it is
        assert cpu_build.check_library(path, _key()) is None


@pytest.mark.slow
def test_pytest_with_a_cache_dir_that_is_a_file_builds_elsewhere_and_says_so(
    tmp_path: Path,
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    temp = tmp_path / "tmp"
    temp.mkdir()
    workdir = _workdir(tmp_path)
    env = {"PYTEST_VRAM_CACHE_DIR": str(blocked), "TMPDIR": str(temp)}
    done = _run_pytest(workdir, env, "--vram-cpu-counter=allocator")
    output = _assert_no_crash(done)
    assert done.returncode == 0, output
    assert "1 passed" in output and "1.00 KiB" in output
    assert f"is a file, not a directory); it was built into {temp}/pytest-vram-" in output
    assert blocked.read_text() == "not a directory"


@pytest.mark.slow
def test_pytest_with_a_library_planted_in_a_shared_cache_does_not_load_it(
    cache: Path, built: Path, planted: tuple[Path, Path], tmp_path: Path
) -> None:
    planted_library, marker = planted
    _plant(cache / _name(), planted_library)
    cache.chmod(0o777)
    # The fallback cache under the temporary directory has a good library already.
    temp = Path(tempfile.gettempdir())
    fallback = _seed_temporary_cache(built)
    workdir = _workdir(tmp_path)
    env = {"PYTEST_VRAM_CACHE_DIR": str(cache), "TMPDIR": str(temp)}
    done = _run_pytest(workdir, env, "--vram-cpu-counter=allocator")
    output = _assert_no_crash(done)
    assert not marker.exists(), "the planted library's constructor ran in pytest"
    assert done.returncode == 0, output
    assert "1 passed" in output and "1.00 KiB" in output
    assert "counts from Python" not in output
    assert (
        f"{cache} is mode 0777: other users can write it); it was built into {fallback}" in output
    )


def _bound_by_permissions() -> Callable[[], None] | None:
    """What makes a subprocess obey a directory's permissions. Root ignores them by way of
    CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH: a root test run drops those from the subprocess's
    capability bounding set, which leaves a root that a read-only directory refuses, as it
    refuses any other user already."""
    if os.geteuid() != 0:
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def drop() -> None:
        for capability in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
            if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

    with tempfile.TemporaryDirectory() as probe:
        os.chmod(probe, 0o555)
        try:
            done = subprocess.run(
                ["sh", "-c", 'test ! -w "$0"', probe],
                preexec_fn=drop,
                capture_output=True,
                timeout=60,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            done = None
        os.chmod(probe, 0o755)
    if done is None or done.returncode != 0:
        pytest.skip("cannot drop root's CAP_DAC_OVERRIDE here to make a directory read-only")
    return drop


@pytest.fixture
def read_only_cache(tmp_path: Path, built: Path, foreign_library: Path) -> Iterator[Path]:
    """A cache holding a damaged library, that the user running pytest cannot write to."""
    directory = tmp_path / "read-only"
    directory.mkdir()
    shutil.copy2(built, directory / built.name)
    shutil.copy2(cpu_build.stamp_path(built), cpu_build.stamp_path(directory / built.name))
    _truncate(directory / built.name, foreign_library)
    for path in [*directory.iterdir(), directory]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    yield directory
    directory.chmod(0o755)  # for pytest to remove it


@pytest.mark.slow
def test_pytest_with_a_read_only_cache_builds_into_the_temporary_cache(
    read_only_cache: Path, tmp_path: Path
) -> None:
    bound = _bound_by_permissions()
    temp = tmp_path / "tmp"
    temp.mkdir()
    temp.chmod(0o1777)  # like /tmp
    before = {path.name: path.read_bytes() for path in read_only_cache.iterdir()}
    workdir = _workdir(tmp_path)
    env = {"PYTEST_VRAM_CACHE_DIR": str(read_only_cache), "TMPDIR": str(temp)}
    done = _run_pytest(workdir, env, "--vram-cpu-counter=allocator", preexec_fn=bound)
    output = _assert_no_crash(done)
    assert done.returncode == 0, output
    assert "1 passed" in output and "1.00 KiB" in output
    assert f"cannot write to {read_only_cache} (Permission denied)" in output
    built_into = temp / f"pytest-vram-{os.geteuid()}"
    assert f"it was built into {built_into} instead" in output
    assert cpu_build.check_library(built_into / _name(), _key()) is None
    assert {path.name: path.read_bytes() for path in read_only_cache.iterdir()} == before

    # The next run loads what it built there, without building again: that cache is
    # read-only now too.
    for path in [*built_into.iterdir(), built_into]:
        path.chmod(0o500 if path.is_dir() else 0o400)
    done = _run_pytest(workdir, env, "--vram-cpu-counter=allocator", preexec_fn=bound)
    output = _assert_no_crash(done)
    assert done.returncode == 0, output
    assert "1.00 KiB" in output and "counts from Python" not in output
    built_into.chmod(0o700)


@pytest.mark.slow
def test_pytest_with_no_writable_cache_counts_from_python_or_names_the_problem(
    read_only_cache: Path, tmp_path: Path
) -> None:
    bound = _bound_by_permissions()
    temp = tmp_path / "tmp"
    temp.mkdir()
    temp.chmod(0o1777)
    # Another user got there first: a directory under the temporary one that another user
    # could write, or owns, is never used (a library planted there would run in pytest).
    squatted = temp / f"pytest-vram-{os.geteuid()}"
    squatted.mkdir()
    squatted.chmod(0o777)
    workdir = _workdir(tmp_path)
    env = {"PYTEST_VRAM_CACHE_DIR": str(read_only_cache), "TMPDIR": str(temp)}

    done = _run_pytest(workdir, env, "--vram-cpu-counter=auto", preexec_fn=bound)
    output = _assert_no_crash(done)
    assert done.returncode == 0, output
    assert "1 passed" in output
    assert "pytest-vram: cpu backend counts from Python" in output
    assert f"cannot write to {read_only_cache} (Permission denied)" in output
    assert f"{squatted} can be written by other users" in output

    done = _run_pytest(workdir, env, "--vram-cpu-counter=allocator", preexec_fn=bound)
    output = done.stdout + done.stderr
    assert "Fatal Python error" not in output
    assert done.returncode == 1, output
    assert (
        "usage error in test_counted.py::test_counted: the cpu backend's allocator counter: "
        "no cache directory to build the counting allocator into"
    ) in output
    assert list(squatted.iterdir()) == []


@pytest.mark.slow
def test_processes_that_find_the_cache_empty_together_build_it_once(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    script = (
        "import sys\n"
        "from pytest_vram.backends.cpu import build as cpu_build\n"
        "builds = []\n"
        "real = cpu_build._build\n"
        "cpu_build._build = lambda *a: (builds.append(1), real(*a))\n"
        "path = cpu_build.library_path()\n"
        "print(len(builds), path)\n"
    )
    env = {**os.environ, "PYTEST_VRAM_CACHE_DIR": str(cache)}
    runs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outputs = [run.communicate(timeout=300)[0].split() for run in runs]
    assert all(run.returncode == 0 for run in runs)
    assert sorted(int(builds) for builds, _ in outputs) == [0, 0, 1]
    assert {path for _, path in outputs} == {str(cache / _name())}
    assert cpu_build.check_library(cache / _name(), _key()) is None
    assert sorted(path.suffix for path in cache.iterdir()) == [".lock", ".so", ".stamp"]
