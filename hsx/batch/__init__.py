"""The batch-file format: the bytes of one batch (header, tensors, codec, dtypes) and their checks.

Never imports run state (`hsx.run`), token preparation (`hsx.prep`) or a store (tests/test_house.py).
"""
