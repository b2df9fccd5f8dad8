"""``batchgen serve``: OpenAI's Files and Batches API, and a live dashboard, over the queue.

It sits on top of ``batchgen.jobs`` like the CLI does: a batch is a batchgen job
with the same id (submit's validator, the job lifecycle, cancel and the Parquet
result are the jobs' own); this package adds the uploaded files, the batch
records and their OpenAI shapes, the output files, and the dashboard. It never
imports torch or ``batchgen.worker``.
"""
