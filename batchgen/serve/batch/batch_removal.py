"""Removing a batch: its record, its places in the indexes, its output and error files
(records and bytes), its line in the dashboard's tok/s samples. The sweep does it when an ended batch expires; ``batchgen
delete BATCH_ID`` does it at once (with the batch's job). Its input file is the
user's own object (``DELETE /v1/files/ID``), kept.
"""

from __future__ import annotations

import contextlib

import redis

from batchgen.jobs.redis.keys import Keys, text_hash
from batchgen.jobs.schema.errors import BatchgenError
from batchgen.serve.batch.batch_record import BatchRecord
from batchgen.serve.files import FileStore
from batchgen.serve.series import forget_job


def remove_batch(conn: redis.Redis, keys: Keys, batch_id: str, files_dir: str = "") -> int:
    """Remove the batch and its output files; how many files went (0 if it is gone).
    ``files_dir``: where its files are when its record does not say (older records)."""
    raw = conn.hgetall(keys.batch(batch_id))
    if not raw:
        _unindex(conn, keys, batch_id, "", files_dir)
        return 0
    record = BatchRecord.from_hash(text_hash(raw))
    store_dir = record.store or files_dir
    removed = 0
    if store_dir:
        store = FileStore(conn, keys, store_dir)
        for file_id in (record.output_file_id, record.error_file_id):
            obj = store.record(file_id) if file_id else None
            if obj is not None:
                with contextlib.suppress(BatchgenError):  # its bytes may be gone already
                    store.remove(obj)
                    removed += 1
    _unindex(conn, keys, batch_id, record.tenant, store_dir)
    forget_job(conn, keys, batch_id)
    return removed


def _unindex(conn: redis.Redis, keys: Keys, batch_id: str, tenant: str, store_dir: str) -> None:
    pipe = conn.pipeline(transaction=True)
    pipe.delete(keys.batch(batch_id), keys.batch_lock(batch_id))
    pipe.zrem(keys.batches, batch_id)
    pipe.srem(keys.open_batches, batch_id)
    if tenant:
        pipe.zrem(keys.tenant_batches(tenant), batch_id)
    if store_dir:
        pipe.zrem(keys.expiring_batches(store_dir), batch_id)
    pipe.execute()
