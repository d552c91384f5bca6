"""The speculators follow sampler as speculators resumes it, run in the peer's own venv: a script for ``-c``.

argv: Redis URL, run, state folder, first step. Prints {"steps": [...], "length": N}, or {"refused": message}.
"""

SCRIPT = """
import json, sys
from hsx_peers.speculators_follow import FollowLog, FollowSampler
from hsx_reader import ReaderError, RunFollower
url, run, state_dir, start = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sampler = FollowSampler(RunFollower(url, run, timeout_seconds=5), 256, state_dir, FollowLog(None))
try:
    steps = [[list(at) for at in step] for step in sampler._generate_batches(0)[start:]]   # as speculators resumes
except ReaderError as exc:
    print(json.dumps({"refused": str(exc)}))
else:
    print(json.dumps({"steps": steps, "length": len(sampler)}))
"""
