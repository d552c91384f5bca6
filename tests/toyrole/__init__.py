"""A third role, for tests/test_role_skeleton.py: this folder plus one entry in hsx_cli's COMMANDS is all of it.

`hsx tally` adds numbers: each job on tally:<run> adds one to the run's tally. Slot, heartbeat, progress log,
rq worker, name claim and stop come from hsx/fleet/role.py.
"""
