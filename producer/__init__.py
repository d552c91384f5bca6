"""The producer role: plans a run and enqueues one extract job per batch not yet done."""
