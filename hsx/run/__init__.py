"""A run's state in Redis: keys, the ledger, a batch's life (batchlife), leases, queues, progress, reconciling and repair.

May read the batch format and the store (to rebuild or verify); never imports token preparation
(tests/test_house.py).
"""
