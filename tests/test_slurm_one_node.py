"""Issue 41 item 6: SLURM on one machine is a recipe (docs/deploy.md "SLURM on one machine"), not only a test.

deploy/slurm/one-node.sh prints the slurm.conf of a one-node cluster on this machine; tests/slurmcluster.py
starts its cluster from that same script (tests/test_slurm.py runs the submit scripts on it, slow), so the
conf a user is given is the one CI runs. Here, cheaply: the conf describes this machine, the test cluster's conf is
the script's (only the ports, KillWait and partition name set), the GPU variant, and the docs' block names
the script and what it prints. Was: the conf existed only inside tests/slurmcluster.py.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.slurmcluster import ONE_NODE, SlurmCluster
from tests.waiting import scaled

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- checked by tests/test_slurm_one_node.py -->"


def conf(tmp: Path, **env) -> dict[str, str]:
    out = subprocess.run(["bash", str(ONE_NODE), str(tmp)], capture_output=True, text=True, check=True, timeout=scaled(30),
                         env={**os.environ, **env})
    lines = [line for line in out.stdout.splitlines() if line and not line.startswith("#")]
    return {line.split("=", 1)[0]: line.split("=", 1)[1] for line in lines}


def test_the_one_node_conf_describes_this_machine(tmp_path):
    c = conf(tmp_path / "slurm")
    node = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()
    assert c["SlurmctldHost"] == f"{node}(127.0.0.1)" and (c["SlurmctldPort"], c["SlurmdPort"]) == ("6817", "6818")
    fields = dict(kv.split("=", 1) for kv in f"NodeName={c['NodeName']}".split())
    assert fields["NodeName"] == node and int(fields["CPUs"]) == os.cpu_count() and "Gres" not in fields
    mem_total_mb = int(next(x for x in Path("/proc/meminfo").read_text().splitlines()
                            if x.startswith("MemTotal")).split()[1]) / 1024
    assert 0.7 * mem_total_mb < int(fields["RealMemory"]) <= 0.8 * mem_total_mb
    assert c["PartitionName"].split()[0] == "local" and "Default=YES" in c["PartitionName"]
    assert c["KillWait"] == "30" and c["AuthType"] == "auth/none"
    for sub in ("state", "spool", "log"):
        assert (tmp_path / "slurm" / sub).is_dir()
    assert c["StateSaveLocation"] == str(tmp_path / "slurm" / "state")


def test_the_test_cluster_runs_the_conf_the_docs_give(tmp_path):
    cluster = SlurmCluster(tmp_path / "cluster")
    cluster.write_conf()
    ours = cluster.conf.read_text().splitlines()
    theirs = subprocess.run(["bash", str(ONE_NODE), str(tmp_path / "cluster")], capture_output=True, text=True,
                            check=True).stdout.splitlines()
    differ = {a.split("=", 1)[0] for a, b in zip(ours, theirs, strict=True) if a != b}
    assert differ <= {"SlurmctldPort", "SlurmdPort", "KillWait", "PartitionName"}, differ


def test_gpus_are_offered_with_a_gres_conf(tmp_path):
    c = conf(tmp_path / "slurm", HSX_SLURM_CONF_GPUS="4", HSX_SLURM_CONF_PORTS="7001 7002",
             HSX_SLURM_CONF_KILL_WAIT="45", HSX_SLURM_CONF_PARTITION="gpus")
    assert c["GresTypes"] == "gpu" and " Gres=gpu:4 " in c["NodeName"]
    assert (tmp_path / "slurm" / "gres.conf").read_text() == "Name=gpu File=/dev/nvidia[0-3]\n"
    assert (c["SlurmctldPort"], c["SlurmdPort"], c["KillWait"]) == ("7001", "7002", "45")
    assert c["PartitionName"].startswith("gpus ")


def test_the_docs_recipe_uses_the_script():
    page = (ROOT / "docs" / "deploy.md").read_text()
    [block] = re.findall(re.escape(MARK) + r"\n```sh\n(.*?)\n```", page, re.S)
    assert "apt-get install -y slurm-wlm" in block
    assert "deploy/slurm/one-node.sh /var/lib/hsx-slurm > /etc/slurm/slurm.conf" in block
    assert "slurmctld && slurmd" in block and "deploy/slurm/submit.sh run" in block
    assert 'partition "local"' in block
