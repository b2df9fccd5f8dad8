"""Fair share: who a job is for (tenants, weights, quotas), what it asks of the scheduler
(priority, deadline), its backlog, and the index that keeps a model's jobs in dispatch order."""
