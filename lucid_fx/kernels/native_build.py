"""Building the native kernels (``native*.c``) into one shared library, once per machine.

The first process compiles the C files with the machine's C compiler, the files side by side (7.4 s
one after another on the AVX2 EPYC these figures come from, which every new process paid before
any model converted or loaded: a CLI call, a test's subprocess, a server's cold start), and keeps
the library in a private cache; later processes load it (milliseconds). What the library was built
from is its name: a SHA-256 over the sources and headers, the compiler and its ``--version``, the
flags, and what ``-march=native`` compiles for (the CPU's model and feature flags), so a changed
source, compiler or CPU (a home directory shared by several machines) builds a library of its own.

The cache is ``$LUCID_FX_CACHE_DIR`` (an absolute path), else ``$XDG_CACHE_HOME/lucid_fx``, else
``~/.cache/lucid_fx``, as ``torch.compile`` keeps its compiled kernels; without a home directory,
nothing is kept. A new build removes the libraries past the :data:`KEEP` most recently built or
loaded. A shared library runs code when it loads, so a
file is loaded only where it and its directory belong to this user and no one else may write
them; otherwise, or with ``LUCID_FX_NATIVE_CACHE=0``, each process compiles in a temporary
directory of its own and nothing is kept.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

__all__ = ["cache_dir", "is_private", "library_key", "built", "capped", "with_fallbacks", "compiler", "AVX2_CAP", "KEEP"]


def compiler(variables: Sequence[str], default: str) -> Optional[str]:
    """The compiler the first set of ``variables`` names (else ``default``), where its program is on the PATH."""
    name = next((os.environ[v] for v in variables if os.environ.get(v)), default)
    words = shlex.split(name)
    return name if words and shutil.which(words[0]) else None


def is_private(path: Path) -> bool:
    """Owned by this user and writable by no one else (a file another user could swap is never loaded);
    False where the system has no user ids to compare (nothing is kept there)."""
    getuid = getattr(os, "getuid", None)
    try:
        st = path.stat()
    except OSError:
        return False
    return getuid is not None and st.st_uid == getuid() and not st.st_mode & 0o022


def cache_dir() -> Optional[Path]:
    """The private cache directory (made if missing), or None: turned off, not writable, or not private."""
    if os.environ.get("LUCID_FX_NATIVE_CACHE", "1") == "0":
        return None
    home = os.path.expanduser("~")
    base = os.environ.get("XDG_CACHE_HOME") or (os.path.join(home, ".cache") if os.path.isabs(home) else None)
    chosen = os.environ.get("LUCID_FX_CACHE_DIR") or (os.path.join(base, "lucid_fx") if base else None)
    if chosen is None or not os.path.isabs(chosen):
        return None  # no home directory: never a cache relative to wherever the process runs
    path = Path(chosen)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    return path if is_private(path) and os.access(path, os.W_OK) else None


def _machine() -> List[str]:
    """What ``-march=native`` compiles for: the CPU's model and feature flags (Linux's /proc/cpuinfo)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    fields = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU part")
    return [platform.machine(), platform.processor(), *dict.fromkeys(line for line in lines if line.startswith(fields))]


# Under ONEDNN_MAX_CPU_ISA=AVX2 oneDNN runs its AVX2 kernels on any x86 CPU; the library then leaves out AVX-512
# and AVX-VNNI too (tests/kernels/conftest.py's "no AVX-512" build), so its kernels are an AVX2 CPU's, and where
# they copy oneDNN's float steps they copy those of the kernels oneDNN runs (built with AVX-512 on a VNNI CPU,
# the native engine's hardswish took other float steps than oneDNN's AVX2 convolution: 1 ulp apart).
AVX2_CAP = ("-mno-avx512f", "-mno-avxvnni")


def capped(flag_sets: Sequence[Sequence[str]]) -> Tuple[Tuple[str, ...], ...]:
    """``flag_sets``, the first (``-march=native``) without AVX-512 and AVX-VNNI where oneDNN is capped at AVX2
    on an x86 CPU (:data:`AVX2_CAP`)."""
    sets = tuple(tuple(f) for f in flag_sets)
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).upper()
    if sets and cap == "AVX2" and platform.machine().lower() in ("x86_64", "amd64") and "-march=native" in sets[0]:
        return (sets[0] + AVX2_CAP, *sets[1:])
    return sets


def with_fallbacks(flag_sets: Sequence[Sequence[str]]) -> Tuple[Tuple[str, ...], ...]:
    """``flag_sets``, then each again without ``-fopenmp``, for a compiler without OpenMP (the GEMM then
    runs on one thread)."""
    sets = tuple(tuple(f) for f in flag_sets)
    return sets + tuple(tuple(f for f in s if f != "-fopenmp") for s in sets if "-fopenmp" in s)


@functools.lru_cache(maxsize=None)
def _version(cc: str) -> bytes:
    try:
        return subprocess.run([*shlex.split(cc), "--version"], capture_output=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return b""


def library_key(cc: str, flags: Sequence[str], files: Sequence[Path], generated: Sequence[Tuple[str, str]] = ()) -> str:
    """The name of what ``cc flags files`` (and the ``generated`` (name, text) sources) builds on this machine."""
    digest = hashlib.sha256(b"lucid_fx native library\0")
    for part in (cc.encode(), _version(cc), *(f.encode() for f in flags), *(m.encode() for m in _machine())):
        digest.update(part + b"\0")
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for name, text in generated:
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    return digest.hexdigest()[:32]


def _run(command: List[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def _compile(cc: str, flags: Sequence[str], sources: Sequence[Path], into: Path) -> Tuple[Optional[Path], str]:
    """Each source to an object file, side by side, then one library: (its path, "") or (None, the error)."""
    words = shlex.split(cc)
    objects = [into / f"{source.stem}.o" for source in sources]
    commands = [[*words, *flags, "-fPIC", "-c", "-o", str(o), str(s)] for s, o in zip(sources, objects)]
    with ThreadPoolExecutor(max_workers=max(1, min(len(commands), os.cpu_count() or 1))) as pool:
        done = list(pool.map(_run, commands))
    so = into / "lucid_fx_native.so"
    if all(d.returncode == 0 for d in done):
        done.append(_run([*words, *flags, "-shared", "-o", str(so), *map(str, objects)]))
    failed = next((d for d in done if d.returncode != 0), None)
    if failed is not None:
        return None, _first_error(failed.stderr) or f"exit {failed.returncode}"
    return so, ""


def _first_error(stderr: str) -> str:
    """The compiler's first ``error:`` line (a C++ compiler's last line is a caret under the code), else its last."""
    lines = stderr.strip().splitlines()
    return next((line.strip() for line in lines if "error:" in line), lines[-1] if lines else "")


def _drop_abandoned(cache: Path, older_than_s: float = 3600.0) -> None:
    """Build directories a killed process left in the cache (a build takes seconds, not an hour)."""
    for leftover in cache.glob("lucid_fx_native_*"):
        with contextlib.suppress(OSError):
            if time.time() - leftover.stat().st_mtime > older_than_s:
                shutil.rmtree(leftover)


KEEP = 16  # libraries kept in the cache: the ones most recently built or loaded


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile by another process's prune
        return 0.0


def _prune(cache: Path) -> None:
    """Remove the cache's libraries past the :data:`KEEP` most recently built or loaded (a load touches its
    file): each new lucid_fx, compiler, flag set or CPU builds a library of its own, and the old ones
    piled up (48 files, 7.3 MB, in one day of development). A process that has one loaded keeps its
    mapping (POSIX); one that looks for it later builds it again (seconds)."""
    libraries = sorted(cache.glob("native-*.so"), key=_mtime, reverse=True)
    for old in libraries[KEEP:]:
        with contextlib.suppress(OSError):
            old.unlink()


def _find_or_build(cc, flag_sets, sources, headers,
                   generated) -> Tuple[Optional[Path], str, Optional[tempfile.TemporaryDirectory]]:
    cache = cache_dir()
    errors = []
    kept_by_set = [cache / f"native-{library_key(cc, flags, [*sources, *headers], generated)}.so" if cache is not None else None
                   for flags in flag_sets]
    # A library kept for any flag set first: an earlier set this compiler refuses (-fopenmp without OpenMP)
    # is not compiled again in every process.
    for flags, kept in zip(flag_sets, kept_by_set):
        if kept is not None and kept.exists() and is_private(kept):
            with contextlib.suppress(OSError):
                os.utime(kept)  # recently used: a prune keeps it
            return kept, f"compiled with {cc} {' '.join(flags)} (loaded from {kept})", None
    for flags, kept in zip(flag_sets, kept_by_set):
        described = f"compiled with {cc} {' '.join(flags)}"
        if cache is not None:
            _drop_abandoned(cache)
        tmp = tempfile.TemporaryDirectory(prefix="lucid_fx_native_", dir=cache)  # beside the cache: an atomic rename
        written = [Path(tmp.name, name) for name, _ in generated]
        for path, (_, text) in zip(written, generated):
            path.write_text(text)
        so, error = _compile(cc, flags, [*sources, *written], Path(tmp.name))
        if so is None:
            tmp.cleanup()
            errors.append(error)
            continue
        if kept is None:
            return so, described, tmp
        os.replace(so, kept)  # a process loading it meanwhile sees the old file or the new
        tmp.cleanup()
        _prune(cache)
        return kept, f"{described} (kept in {kept})", None
    return None, f"{cc} failed ({errors[-1]}): the torch kernels run", None


@contextlib.contextmanager
def built(cc: str, flag_sets: Sequence[Sequence[str]], sources: Sequence[Path],
          headers: Sequence[Path] = (), generated: Sequence[Tuple[str, str]] = ()) -> Iterator[Tuple[Optional[Path], str]]:
    """``(library, how)`` for the first flag set that compiles (kept in the cache, or found there), or
    ``(None, why not)``. ``generated``: more sources, as (file name, text), written beside the objects. The
    library is there to load inside the ``with`` block."""
    try:
        so, how, tmp = _find_or_build(cc, flag_sets, sources, headers, tuple(generated))
    except (OSError, subprocess.TimeoutExpired) as error:
        so, how, tmp = None, f"{cc} could not run ({error}): the torch kernels run", None
    try:
        yield so, how
    finally:
        if tmp is not None:
            tmp.cleanup()
