"""A batch's and a run's life in Redis."""
