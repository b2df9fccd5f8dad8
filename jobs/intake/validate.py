"""Pass 1 of submit: every line parsed and checked, valid entries spooled to disk.

A big file is cut at line boundaries into ranges validated by parallel
processes (``BATCHGEN_SUBMIT_PROCS``, default: the CPU count, at most 8): at
80k lines/s a core, a 300M-line file would otherwise take an hour. The result
does not depend on how the file was cut: line numbers are absolute, and the
fingerprint is the sha256 of the entries in input order.

Memory is bounded whatever the file holds. A line is read up to the line limit
(the rest of a longer one is skipped in chunks, never held); parsing it costs at
most ~12 times its size (UTF-8 text that Python must hold 4 bytes a character,
the parsed prompt, the entry's encoding) plus ~20 MB for its values, which
``strictjson.MAX_VALUES`` caps. Lines over BIG_LINE_BYTES are parsed one at a
time across all processes; the others wait holding only their line's bytes. So
at 8 processes and 8 MiB lines: one ~120 MB parse, seven of at most ~12 MB or a
waiting 8 MiB line, and each process's interpreter.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import hashlib
import itertools
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from batchgen.jobs.environment import SPOOL_DIR, SUBMIT_PROCS
from batchgen.jobs.intake.duplicate_ids import DuplicateIds, IdLog, find_duplicates
from batchgen.jobs.intake.inputs import parse_line
from batchgen.jobs.intake.lines import MAX_LINE_BYTES, InputError, LineError, read_lines
from batchgen.jobs.schema.entry import QueuedRequest

SHOWN_ERRORS = 20
PARALLEL_MIN_BYTES = 32 << 20  # below this, one process is quicker than starting more
_COUNT_CHUNK = 8 << 20
_SKIP_CHUNK = 1 << 20
BIG_LINE_BYTES = 256 << 10  # parsed under _big_line_gate when processes share the work
# Set in each validator process of a pool (a multiprocessing lock); None alone.
_big_line_gate: Any = None
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


E = TypeVar("E", bound=InputError)
RangeResult = tuple[int, int, list[E]]  # (lines, invalid, first errors) of one range


@dataclass(slots=True)
class Validation(Generic[E]):
    total: int = 0  # lines (or rows), invalid ones included: each has an entry in the spool
    error_count: int = 0  # of them, invalid (their entries are QueuedRequest.rejected)
    errors: list[E] = field(default_factory=list)  # the first SHOWN_ERRORS
    sha256: str = ""  # of the spooled entries, in order: the job's fingerprint
    spools: list[Path] = field(default_factory=list)  # entry files, in input order
    duplicates: DuplicateIds = field(default_factory=DuplicateIds)  # ids given twice

    @property
    def valid(self) -> int:
        return self.total - self.error_count

    def entries(self) -> Iterator[bytes]:
        """Each entry (compact JSON), in input order; an invalid line's is its error."""
        for spool in self.spools:
            with open(spool, "rb") as f:
                for line in f:
                    yield line[:-1]


def _validate_range(
    path: str, start: int, end: int, first_number: int, defaults: dict[str, Any],
    max_line_bytes: int, spool: str, vocab_size: int | None = None,
) -> tuple[int, int, list[LineError]]:  # fmt: skip
    """(lines, invalid, first errors) of one range; entries written to ``spool``, an
    invalid line's as its error (``QueuedRequest.rejected``), so every line keeps its index."""
    total = error_count = 0
    errors: list[LineError] = []
    ids = IdLog(ids_log(Path(spool)))
    with open(path, "rb") as src, open(spool, "wb") as out:
        src.seek(start)
        write = out.write
        for number, line in read_lines(src, max_line_bytes, first_number, end - start):
            if isinstance(line, LineError):
                entry: bytes | LineError = line
            elif _big_line_gate is None or len(line) <= BIG_LINE_BYTES:
                entry = parse_line(number, line, defaults, vocab_size)
            else:
                with _big_line_gate:
                    entry = parse_line(number, line, defaults, vocab_size)
            total += 1
            if isinstance(entry, LineError):
                error_count += 1
                if len(errors) < SHOWN_ERRORS:
                    errors.append(entry)
                entry = QueuedRequest.rejected(str(entry), entry.row_id).encode()
            else:
                ids.add(entry, number)
            write(entry + b"\n")
    ids.close()
    return total, error_count, errors


def _start_validator(gate: Any) -> None:
    """Pool initializer: the shared big-line gate, and big blocks handed back to the
    system when freed (glibc otherwise raises its mmap threshold to the largest block
    freed and keeps up to twice that in each process after a big line)."""
    global _big_line_gate
    _big_line_gate = gate
    with contextlib.suppress(OSError, AttributeError, TypeError):  # not glibc: looser
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, 1 << 20)


def _ranges(path: str, parts: int) -> list[tuple[int, int, int]]:
    """(start byte, end byte, first line number) of ``parts`` ranges cut at newlines."""
    size = os.path.getsize(path)
    cuts = [0]
    with open(path, "rb") as f:
        for k in range(1, parts):
            f.seek(max(size * k // parts, cuts[-1]))
            while (skipped := f.readline(_SKIP_CHUNK)) and not skipped.endswith(b"\n"):
                pass  # on to the next line boundary, a bounded read at a time
            cuts.append(f.tell())
        cuts.append(size)
        ranges, number = [], 1
        for start, end in itertools.pairwise(cuts):
            if end <= start:
                continue
            ranges.append((start, end, number))
            f.seek(start)
            remaining = end - start
            while remaining > 0:  # newlines in the range give the next range's first line
                number += f.read(min(_COUNT_CHUNK, remaining)).count(b"\n")  # one chunk held
                remaining -= _COUNT_CHUNK
    return ranges


def procs_for(size: int) -> int:
    if size < PARALLEL_MIN_BYTES:
        return 1
    configured = SUBMIT_PROCS.get()
    return max(1, configured if configured is not None else min(os.cpu_count() or 1, 8))


def validate_file(
    path: str, defaults: dict[str, Any], spool_dir: Path, max_line_bytes: int = MAX_LINE_BYTES,
    procs: int | None = None, vocab_size: int | None = None,
) -> Validation[LineError]:  # fmt: skip
    """Validate ``path`` into spool files under ``spool_dir`` (the caller removes it);
    ``vocab_size``: the model's, when submit can read it (``parse_line``)."""
    procs = procs or procs_for(os.path.getsize(path))
    ranges = _ranges(path, procs)
    spools = [spool_dir / f"entries-{i:04d}" for i in range(len(ranges))]
    jobs = [(path, s, e, n, defaults, max_line_bytes, str(spool), vocab_size)
            for (s, e, n), spool in zip(ranges, spools)]  # fmt: skip
    results = run_ranges(_validate_range, jobs, big_line_gate=True)
    result = Validation[LineError](spools=spools)
    result.sha256 = gather(result, results).hexdigest()
    result.duplicates = find_duplicates([ids_log(s) for s in spools], spool_dir)
    return result


def ids_log(spool: Path) -> Path:
    """Where the validator writing ``spool`` logs its entries' ids (duplicate_ids.py)."""
    return spool.with_name(spool.name + ".ids")


def run_ranges(
    validate: Callable[..., RangeResult[E]],
    jobs: list[tuple[Any, ...]],
    big_line_gate: bool = False,
) -> list[RangeResult[E]]:
    """``validate(*job)`` for each range, in this process for one, else in a pool of
    forked processes (one per range); with ``big_line_gate``, they share the gate that
    parses big lines one at a time."""
    if len(jobs) <= 1:
        return [validate(*job) for job in jobs]
    context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
    gate = context.Lock() if big_line_gate else None
    gc.freeze()  # forked validators' collections then leave the parent's pages shared
    try:
        with ProcessPoolExecutor(
            len(jobs), mp_context=context, initializer=_start_validator, initargs=(gate,)
        ) as pool:
            return list(pool.map(validate, *zip(*jobs)))
    finally:
        gc.unfreeze()


def gather(result: Validation[E], results: list[RangeResult[E]]) -> hashlib._Hash:
    """Add the ranges' counts and first errors to ``result`` (whose ``spools`` are the
    ranges' entry files, in order); the sha256 of the entries so far, to finish."""
    digest = hashlib.sha256()
    for (total, error_count, errors), spool in zip(results, result.spools):
        result.total += total
        result.error_count += error_count
        result.errors += errors[: SHOWN_ERRORS - len(result.errors)]
        with open(spool, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest


class SpoolDir:
    """A private temp dir for the entry spools ($BATCHGEN_SPOOL_DIR or the system's)."""

    def __enter__(self) -> Path:
        base = SPOOL_DIR.get()
        self.path = Path(tempfile.mkdtemp(prefix="batchgen-submit-", dir=base))
        return self.path

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
