"""Compiling the native kernels: a C source built with the system compiler at first use and
cached under the user cache dir, keyed by everything that can change the binary. None, with one
warning line, when there is no working compiler: callers then run on torch.

Builds run on a small thread pool: a load starts every source's build at once (start_build),
so that the compiles run beside each other and beside reading the model, and a caller that
needs the library joins the build under way rather than starting a second one."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

_log = logging.getLogger(__name__)

# The CPU that each instruction set the integer matmul can be forced down to (TOLLWAY_ISA) stands for.
# x86-64-v3 is AVX2, FMA, F16C and BMI2: the AVX2 kernels' own.
_FORCED_MARCH = {"portable": ["-march=x86-64"], "avx2": ["-march=x86-64-v3"], "avxvnni": ["-march=x86-64-v3", "-mavxvnni"]}
_BUILDERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tollway-cc")  # one per source
_building: dict[tuple, Future] = {}  # the builds under way, by what they build
_built: dict[tuple, Path] = {}  # the libraries this process has built or found, by what they build
_building_lock = threading.RLock()  # a done future runs its callback at once, under the lock


def native_code_enabled() -> bool:
    """False with TOLLWAY_NATIVE=0: every native part then gives way to its fallback (torch, the
    `tokenizers` library), to compare against or to rule the native code out."""
    return os.environ.get("TOLLWAY_NATIVE", "1") != "0"


def native_flags(forced_isa: str | None = None) -> list[str]:
    """Flags for the sources built for one machine (row_ops.c, sampling.c): for this CPU, or for
    the kind of CPU that `forced_isa` stands for where the integer kernels are forced below this
    one's best (Q8Library.forced), so that a forced run measures all the native code as that CPU
    would run it. No -ffast-math: linking with it would switch the whole process to flush-to-zero.
    Without trapping math, loops with float compares can vectorize."""
    march = [*_FORCED_MARCH[forced_isa], "-mtune=native"] if forced_isa else ["-march=native"]
    return ["-O3", *march, "-fno-math-errno", "-fno-trapping-math", "-std=gnu11", "-shared", "-fPIC"]


def compiled_library(source: Path | tuple[Path, ...], folder: Path, flags: list[str], headers: tuple[Path, ...] = (),
                     fallback: str = "torch") -> Path | None:
    """`source` (including `headers`) built with `flags` for this machine, reusing a build of
    the same sources, flags, compiler and CPU; `fallback` says what runs instead in the warning.
    Several sources make one library, named after the first."""
    return start_build(source, folder, flags, headers, fallback).result()


def start_build(source: Path | tuple[Path, ...], folder: Path, flags: list[str], headers: tuple[Path, ...] = (),
                fallback: str = "torch") -> Future:
    """compiled_library's answer, to come: the build starts now in the background, or is the
    one of the same library already under way."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    sources = (source,) if isinstance(source, Path) else tuple(source)
    key = (cc, sources, folder, tuple(flags), tuple(headers))
    with _building_lock:
        future = _building.get(key)
        if future is None and key in _built and _built[key].is_file():
            future = Future()  # found by this process already: not hashed again (each engine asks)
            future.set_result(_built[key])
        elif future is None:
            future = _building[key] = _BUILDERS.submit(_build, cc, sources, folder, flags, headers, fallback)
            future.add_done_callback(lambda _: _forget(key))
        return future


def _forget(key: tuple) -> None:
    # A build under way is shared; one done is remembered by its library, checked again if that is gone.
    with _building_lock:
        future = _building.pop(key)
        if future.exception() is None and future.result() is not None:
            _built[key] = future.result()


def _build(cc: str | None, sources: tuple[Path, ...], folder: Path, flags: list[str], headers: tuple[Path, ...],
           fallback: str) -> Path | None:
    source, name = sources[0], sources[0].stem
    if not cc:
        _warn_no_compiler()
        return None
    try:
        parts = [p.read_bytes() for p in (*sources, *headers)]
        key = hashlib.sha256(b"\0".join([*parts, " ".join(flags).encode(), _compiler_identity(cc),
                                         platform.machine().encode(), _cpu_flags()])).hexdigest()[:16]
        lib = folder / f"{name}-{key}.so"
        if lib.is_file():
            return lib
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=folder)
        os.close(fd)
        try:
            errors = _compile(cc, sources, flags, tmp, folder)
            if errors is not None:
                _log.warning("compiling %s failed, using %s:\n%s", source.name, fallback, errors)
                return None
            os.replace(tmp, lib)  # atomic: a concurrent start sees the old state or a whole library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return lib
    except (OSError, subprocess.SubprocessError) as exc:
        _log.warning("could not build %s (%s): using %s", source.name, exc, fallback)
        return None


def _compile(cc: str, sources: tuple[Path, ...], flags: list[str], out: str, folder: Path) -> str | None:
    """`sources` into the library `out`; the compiler's errors, or None. Several sources are
    compiled side by side, an object each, then linked: a first start waits for the slowest one
    instead of their sum."""
    if len(sources) == 1:
        built = subprocess.run([cc, *flags, "-o", out, str(sources[0])], capture_output=True, text=True, timeout=120)
        return built.stderr.strip() if built.returncode else None
    with tempfile.TemporaryDirectory(prefix=".objects-", dir=folder) as objects:
        paths = [os.path.join(objects, f"{i}.o") for i in range(len(sources))]
        compiles = [subprocess.Popen([cc, *flags, "-c", "-o", o, str(s)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True) for o, s in zip(paths, sources)]
        failed = []
        try:
            for c in compiles:
                errors = c.communicate(timeout=120)[1]  # read as it runs: a full pipe would stall it
                if c.returncode:
                    failed.append(errors.strip())
        finally:
            for c in compiles:
                if c.poll() is None:
                    c.kill()
                    c.wait()
        if failed:
            return "\n".join(failed)
        linked = subprocess.run([cc, *flags, "-o", out, *paths], capture_output=True, text=True, timeout=120)
        return linked.stderr.strip() if linked.returncode else None


@functools.lru_cache(maxsize=None)
def _compiler_identity(cc: str) -> bytes:
    """`cc --version`, asked once a process: each start builds several sources, and forking the
    compiler from a process holding the model's pages is slow."""
    return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.encode()


@functools.lru_cache(maxsize=None)
def _warn_no_compiler() -> None:
    # Said once for all the native kernels, not once per source.
    _log.warning("no C compiler found (set CC to one): the native kernels run on torch, which is slower")


def _cpu_flags() -> bytes:
    # -march=native, and the instruction sets a library may pick at run time: a cached build is
    # only valid on a CPU with the same ones.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return platform.processor().encode()
