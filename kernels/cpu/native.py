"""The CPU path's C functions, compiled once per machine and cached.

- paged decode attention over its pool of threads: ``decode_attention.c``;
- RMSNorm with an optional residual add, neox rotary, SiLU-and-multiply and
  the K/V store into their cache slots: ``elementwise.c``;
- ``exp8``, e^x eight floats at a time, which the attention's softmax and
  SiLU share: ``exp8.h``; bf16 to and from fp32 (round to nearest even, as
  torch): ``bf16.h``.

The C files ship beside this module (package data). The attention is fp32
with a K/V cache of fp32 or bf16 (its sums in fp32); ``elementwise.c`` has
each function for fp32 (``_f32``) and for bf16 (``_bf16``: bf16 tensors but
for the rotary's fp32 cos/sin, computed in fp32 and rounded to bf16 where
``reference.py``'s bf16 path rounds). The callers (``decode_native.py``,
``elementwise.py``) check what the C code trusts. The two files are compiled
into one library with the machine's C compiler (``$CC``, else cc, gcc or
clang; well under a second) and called through ctypes, which releases the
GIL. Where there is no compiler, or the
build fails, ``load()`` returns None and the callers keep to torch.

The library is kept in ``$XDG_CACHE_HOME/batchgen/kernels`` (else
``~/.cache/batchgen/kernels``) under a key: the hash of the sources, the
compiler, its flags, the CPU (``-march=native``) and the Python/platform
tag. A process that finds its key there loads it without compiling. Each
entry is a folder holding the library and its SHA-256, built under a
temporary name and renamed into place whole, so processes building the same
key at once never see each other's half-written files (the first rename
wins; the others load the winner's). An entry whose library does not match
its digest (truncated, partly written by a crash) is moved aside and built
again, never loaded. Where the cache cannot be written, the library is built
in a temporary folder as if there were no cache. The cache keeps the ``KEEP``
entries used last (a load touches its entry): each new build removes the
others, so upgrades and other compilers do not pile up libraries forever.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.kernels.kernel_errors import BuildFailed

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
# compiled together into one library; bf16.h (which includes exp8.h) by both
SOURCES = ("decode_attention.c", "elementwise.c")
HEADERS = ("exp8.h", "bf16.h")
LIBRARY = "cpu_native.so"
DIGEST = "cpu_native.so.sha256"
KEEP = 8  # cache entries kept: the ones used last

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
# name -> (argument types, return type)
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "paged_decode_attention": (
        [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64,
         _I64, _F32, _I64, _I64, _F32, _PTR, _I64], ctypes.c_int,
    ),
    **{
        f"{name}_{dtype}": signature
        for dtype in ("f32", "bf16")
        for name, signature in (
            ("add_rms_norm", ([_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _F32], None)),
            ("rotary", (
                [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64,
                 _I64, _I64], ctypes.c_int,
            )),
            ("silu_and_mul", ([_PTR, _I64, _PTR, _I64, _I64], None)),
            ("store_kv", (
                [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64],
                ctypes.c_int,
            )),
        )
    },
}  # fmt: skip
# -march=native where the compiler knows it; -fopenmp-simd vectorises the
# reductions without OpenMP's runtime (torch has its own thread pool).
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp-simd"],
    ["-O3", "-fopenmp-simd"],
    ["-O2"],
)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/batchgen/kernels``, else ``~/.cache/batchgen/kernels``."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "batchgen" / "kernels"


def _cpu() -> str:
    """The CPU ``-march=native`` compiles for (a cache in a home folder shared by
    machines of different CPUs must not hand one the other's instructions): the first
    processor's model and features, where Linux says them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    fields = ("vendor_id", "model name", "flags", "CPU implementer", "CPU part", "Features")
    first = text.split("\n\n")[0]
    return "\n".join(line for line in first.splitlines() if line.split(":")[0].strip() in fields)


def cache_key(cc: str) -> str:
    """The library's name in the cache: what the compiled code depends on, hashed."""
    digest = hashlib.sha256()
    for name in (*HEADERS, *SOURCES):
        digest.update(f"{name}\0".encode() + (HERE / name).read_bytes() + b"\0")
    compiler = os.stat(cc)  # a reinstalled or upgraded compiler builds afresh
    digest.update(
        repr((
            os.path.realpath(cc), compiler.st_size, compiler.st_mtime_ns, _FLAG_SETS, _cpu(),
            sys.implementation.cache_tag, sysconfig.get_platform(),
        )).encode()
    )  # fmt: skip
    return digest.hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Native:
    """The compiled functions, called as ``native.paged_decode_attention(...)``."""

    paged_decode_attention: Any
    add_rms_norm_f32: Any
    rotary_f32: Any
    silu_and_mul_f32: Any
    store_kv_f32: Any
    add_rms_norm_bf16: Any
    rotary_bf16: Any
    silu_and_mul_bf16: Any
    store_kv_bf16: Any


@functools.cache
def load() -> Native | None:
    """The compiled library, or None (no compiler, or it failed: said once in the log)."""
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found ($CC, cc, gcc, clang): the CPU path uses torch only")
        return None
    try:
        try:
            return _bind(ctypes.CDLL(str(_cached_library(cc))))
        except OSError as exc:
            log.warning(
                "the kernel cache %s cannot be used (%s): compiling for this process only",
                cache_dir(), exc,
            )  # fmt: skip
            with tempfile.TemporaryDirectory(prefix="batchgen-kernel-") as tmp:
                library = Path(tmp, LIBRARY)
                _compile(cc, library)
                return _bind(ctypes.CDLL(str(library)))  # stays loaded after the file is gone
    except BuildFailed as exc:
        log.warning("compiling the CPU path's C functions failed (%s); using torch", exc)
        return None


def _cached_library(cc: str) -> Path:
    """The library of this key in the cache, compiled first where it is missing or
    damaged. Raises OSError where the cache cannot be written or read."""
    root = cache_dir()
    entry = root / cache_key(cc)
    if _intact(entry):
        _touch(entry)
        return entry / LIBRARY
    root.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=root))
    try:
        _compile(cc, building / LIBRARY)
        digest = hashlib.sha256((building / LIBRARY).read_bytes()).hexdigest()
        (building / DIGEST).write_text(digest + "\n")
        if os.path.lexists(entry) and not _intact(entry):
            log.warning("the cached library %s is damaged: replacing it", entry / LIBRARY)
            _set_aside(entry)
        try:
            os.rename(building, entry)
        except OSError:
            if not os.path.lexists(entry):
                raise
            # another process renamed its build into place first: that one is loaded
    finally:
        shutil.rmtree(building, ignore_errors=True)
    if not _intact(entry):
        raise OSError(f"{entry} is not a whole library after it was built")
    _prune(root, keep=entry)
    return entry / LIBRARY


def _touch(entry: Path) -> None:
    """Marks an entry used now (its folder's mtime), where the cache lets it."""
    with contextlib.suppress(OSError):
        os.utime(entry)


def _prune(root: Path, keep: Path) -> None:
    """Removes all but the ``KEEP`` entries used last (``keep`` among them); a library a
    process has loaded stays mapped in it after its file is gone."""
    used = {}
    for p in root.iterdir():
        try:  # another process may be removing it
            if len(p.name) == 32 and p.is_dir() and p != keep:
                used[p] = p.stat().st_mtime
        except OSError:
            continue
    for old in sorted(used, key=used.__getitem__, reverse=True)[KEEP - 1 :]:
        _set_aside(old, "pruned")


def _compile(cc: str, library: Path) -> None:
    """Compiles the sources into ``library`` with the first flags the compiler takes."""
    log.info("compiling the CPU path's C functions into %s", library)
    errors = ""
    for flags in _FLAG_SETS:
        cmd = [
            cc,
            *flags,
            "-shared",
            "-fPIC",
            *(str(HERE / name) for name in SOURCES),
            "-o",
            str(library),
            "-lm",
            "-pthread",
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            errors = repr(exc)
            continue
        if proc.returncode == 0:
            return
        errors = proc.stderr.strip()[-500:]
    raise BuildFailed(errors)


def _intact(entry: Path) -> bool:
    """Whether the entry's library is there, whole: the bytes its digest was taken of."""
    try:
        expected = (entry / DIGEST).read_text().strip()
        return hashlib.sha256((entry / LIBRARY).read_bytes()).hexdigest() == expected
    except OSError:
        return False


def _set_aside(entry: Path, why: str = "damaged") -> None:
    """Moves an entry (damaged, or pruned) out of its name first (one rename: no process
    finds half of it), then removes it."""
    aside = Path(tempfile.mkdtemp(prefix=f".{entry.name}.{why}.", dir=entry.parent))
    try:
        os.rename(entry, aside / "entry")
    except FileNotFoundError:
        pass  # another process set it aside first
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _bind(handle: ctypes.CDLL) -> Native:
    functions = {}
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(handle, name)
        function.argtypes, function.restype = argtypes, restype
        functions[name] = function
    return Native(**functions)
