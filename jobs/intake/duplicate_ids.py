"""Ids that repeat in an input, found in bounded memory for submit's warning.

A row is told apart by its ``index``, never by its id, so a repeated id is
allowed; but it is usually a mistake (two files concatenated, a key column that
is not one), so submit says so. Each validating process logs, for every valid
entry with an id, a 64-bit hash of the id and where it is (a line number, or a
table's row number) to a file beside the spool: 16 bytes an entry. The files are
then read back in buckets by hash, each sorted on its own, so what this holds
at once stays within ``memory_bytes`` whatever the input holds (a sort holds
about four times its pairs' bytes: the buckets are sized for that). A hash collision could report
a repeat that is none (for 300 million ids, about one chance in 400); never the
reverse.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PAIR = np.dtype([("hash", "<u8"), ("where", "<i8")])
_PREFIX = b'{"id":"'  # an entry with an id starts so (QueuedRequest.encode writes it first)
_FLUSH = 1 << 16  # pairs held before they are written
MEMORY_BYTES = 64 << 20  # what finding the repeats may hold at once (docs/input.md says it)
# bytes a bucket's sort holds per byte of its pairs: 3.8 measured with tracemalloc, and a
# bucket may come out a little larger than the mean
_SORT_COST = 5


def id_token(entry: bytes) -> bytes | None:
    """The JSON text of an encoded request's string id (equal ids: equal text, since one
    encoder writes them all), or None when it has none."""
    if not entry.startswith(_PREFIX):
        return None
    start = at = len(_PREFIX)
    while True:
        end = entry.find(b'"', at)
        if end < 0:
            return None
        slashes = end
        while entry[slashes - 1] == 0x5C:  # backslashes before the quote
            slashes -= 1
        if (end - slashes) % 2 == 0:  # not escaped: the string ends here
            return entry[start:end]
        at = end + 1


class IdLog:
    """One validating process's (hash, where) pairs, appended to ``path``."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.pairs = array("Q")

    def add(self, entry: bytes, where: int) -> None:
        token = id_token(entry)
        if token is None:
            return
        digest = hashlib.blake2b(token, digest_size=8).digest()
        self.pairs.append(int.from_bytes(digest, "little"))
        self.pairs.append(where)
        if len(self.pairs) >= 2 * _FLUSH:
            self._flush()

    def _flush(self) -> None:
        self.pairs.tofile(self.file)
        del self.pairs[:]

    def close(self) -> None:
        self._flush()
        self.file.close()


@dataclass(slots=True)
class DuplicateIds:
    count: int = 0  # entries whose id an earlier entry has
    first: tuple[int, int] | None = None  # (where the id first is, its first repeat)


def find_duplicates(
    logs: list[Path], work_dir: Path, memory_bytes: int = MEMORY_BYTES
) -> DuplicateIds:
    """Count the repeats the ``logs`` (IdLog files) hold; ``work_dir`` takes the buckets."""
    size = sum(path.stat().st_size for path in logs)
    buckets = max(1, -(-size * _SORT_COST // memory_bytes))
    if buckets == 1:
        return _in_memory(
            np.concatenate([np.fromfile(p, PAIR) for p in logs] or [np.empty(0, PAIR)])
        )
    paths = [work_dir / f"ids-bucket-{k:04d}" for k in range(buckets)]
    # unbuffered: hundreds of buckets' write buffers would count against the bound
    outs = [open(p, "wb", buffering=0) for p in paths]  # noqa: SIM115 (closed below)
    chunk_pairs = max(1, min(_FLUSH, memory_bytes // (_SORT_COST * PAIR.itemsize)))
    try:
        for log in logs:
            with open(log, "rb") as src:
                while (chunk := np.fromfile(src, PAIR, count=chunk_pairs)).size:
                    which = chunk["hash"] % buckets
                    for k in range(buckets):
                        chunk[which == k].tofile(outs[k])
    finally:
        for out in outs:
            out.close()
    found = DuplicateIds()
    for path in paths:
        part = _in_memory(np.fromfile(path, PAIR))
        path.unlink()
        found.count += part.count
        if part.first is not None and (found.first is None or part.first[1] < found.first[1]):
            found.first = part.first
    return found


def _in_memory(pairs: np.ndarray) -> DuplicateIds:
    order = np.lexsort((pairs["where"], pairs["hash"]))  # by hash, then by place
    hashes, where = pairs["hash"][order], pairs["where"][order]
    repeat = np.flatnonzero(hashes[1:] == hashes[:-1]) + 1  # positions repeating the one before
    if repeat.size == 0:
        return DuplicateIds()
    starts = np.ones(len(hashes), dtype=bool)
    starts[repeat] = False
    group_start = np.maximum.accumulate(np.where(starts, np.arange(len(hashes)), 0))
    later = repeat[np.argmin(where[repeat])]
    return DuplicateIds(int(repeat.size), (int(where[group_start[later]]), int(where[later])))
