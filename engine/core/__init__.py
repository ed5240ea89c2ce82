"""Rank 0 only: the scheduler and its components, the KV manager, the step recorder and its records."""
