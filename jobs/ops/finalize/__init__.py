"""Finalize: a finished job's final dataset and manifest, and the rq task that makes it."""
