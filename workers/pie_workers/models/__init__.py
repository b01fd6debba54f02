"""Model definitions driven by a ``BatchPlan`` over a paged KV pool."""
