"""Token preparation: reading a dataset's rows, rendering and tokenising them, cutting batches.

Never imports run state (`hsx.run`), the batch format (`hsx.batch`) or a store (tests/test_house.py).
"""
