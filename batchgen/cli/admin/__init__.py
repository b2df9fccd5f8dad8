"""Commands that look after a deployment rather than a job: tenants, the embedded Redis, the
result cache, toy checkpoints."""
