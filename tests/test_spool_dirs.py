"""Workers and uploaders refuse to start on a directory they cannot write (a bind-mounted host folder
that Docker created as root), naming the path, the user id and the fix, instead of dead-lettering
every batch while they look alive. The real case (uid 10001 in a container, a root-owned bind mount)
runs in tests/test_compose_docker.py; here root without its file capabilities meets a folder of uid 10001.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.threads import thread_env
from tests.waiting import scaled

HSX_BIN = Path(sys.executable).with_name("hsx")
IMAGE_UID = 10001  # the user of the Docker images (Dockerfile): owner of the folder in the test


def _without_root_file_powers():
    """Drop CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER from the bounding set before exec:
    the child (still uid 0) then obeys file modes like any user, as uid 10001 does in the images."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root (to drop its file capabilities for the child)")
@pytest.mark.parametrize("role", [["upload"], ["worker", "--device", "cpu"]])
def test_role_exits_with_the_fix_on_a_spool_of_another_owner(tmp_path, redis_server, role):
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o755)
    os.chown(spool, IMAGE_UID, IMAGE_UID)  # someone else's folder, like the root-owned one Docker creates
    env = {"PATH": f"{HSX_BIN.parent}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "HSX_REDIS_URL": redis_server.url, "HSX_HOST": "testbox", "HSX_RUN": "fs-check", **thread_env()}
    proc = subprocess.run([str(HSX_BIN), *role, "--burst", "--spool-dir", str(spool)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=scaled(120), preexec_fn=_without_root_file_powers)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    uid = os.getuid()
    assert str(spool) in err and f"uid {uid}" in err and f"install -d -o {uid}" in err, err
    assert "Traceback" not in err, err
