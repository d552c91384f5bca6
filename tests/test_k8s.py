"""deploy/k8s (issue 32): the manifests render and validate offline, and workers scaled as KEDA would scale them
lose and double nothing.

What is not tested here (no API server can run on this machine): a real kubelet (probes, the native sidecar's
stop order, volume mounts, the termination grace), GPU scheduling (nvidia.com/gpu), KEDA itself, image pulls.
"""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
import yaml

from hsx import defaults as D
from hsx.batch import batchfile
from hsx.life import heartbeat, ledger, queues
from hsx.life.keys import RunKeys
from hsx_tools.demo import sample_dataset
from tests.waiting import scaled, wait_until

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
BIN = Path(sys.executable).parent
KUBERNETES = "1.37.0"  # the schemas kubernetes-validate pins


def render(overlay: str) -> list[dict]:
    out = subprocess.run([str(BIN / "kubectl"), "kustomize", str(K8S / "overlays" / overlay)], capture_output=True,
                         text=True, timeout=scaled(60))
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def validate(doc: dict) -> None:
    """Against the pinned Kubernetes schemas (strict: an unknown field fails), or KEDA's models for its kinds."""
    if doc["apiVersion"].startswith("keda.sh/"):
        keda_validate(doc)
        return
    import kubernetes_validate

    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def _forbid_extra(schema):
    """Make a JSON schema strict: every object with properties refuses the others."""
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for value in schema.values():
            _forbid_extra(value)
    elif isinstance(schema, list):
        for value in schema:
            _forbid_extra(value)
    return schema


def keda_validate(doc: dict) -> None:
    from cloudcoil.models.keda import v1alpha1

    kind = getattr(v1alpha1, doc["kind"])
    schema = _forbid_extra(kind.model_json_schema(by_alias=True))
    jsonschema.validate(doc, schema)
    kind.model_validate(doc)


@pytest.mark.parametrize("overlay", ["gpu", "cpu", "keda"])
def test_manifests_render_and_validate_offline(overlay):
    docs = render(overlay)
    kinds = Counter(d["kind"] for d in docs)
    assert kinds["StatefulSet"] == 2 and kinds["Job"] == 1 and kinds["Deployment"] == 1, kinds
    assert kinds["ScaledObject"] == (1 if overlay == "keda" else 0)
    for doc in docs:
        validate(doc)
    # The checks can fail: one unknown field is refused, in a core kind and in KEDA's.
    bad = copy.deepcopy(next(d for d in docs if d["kind"] == "StatefulSet"))
    bad["spec"]["template"]["spec"]["terminationGracePeriod"] = 300
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)
    if overlay == "keda":
        bad = copy.deepcopy(next(d for d in docs if d["kind"] == "ScaledObject"))
        bad["spec"]["trigger"] = bad["spec"].pop("triggers")
        with pytest.raises(jsonschema.ValidationError):
            validate(bad)


def _by(docs, kind, name):
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def test_what_the_manifests_promise():
    docs = render("keda")
    settings = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("hsx-settings"))["data"]
    worker = _by(docs, "StatefulSet", "hsx-worker")["spec"]["template"]["spec"]
    main, sidecar = worker["containers"][0], worker["initContainers"][0]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar: stopped after the worker
    # The grace covers the worker's (finish or hand back the batch) and then the sidecar's drain.
    assert worker["terminationGracePeriodSeconds"] >= D.DEFAULT_GRACE_SECONDS + 60
    # Worker and uploaders share the spool (both tiers) and name the same host: the pod.
    mounts = lambda c: {m["name"]: m["mountPath"] for m in c["volumeMounts"]}  # noqa: E731
    for tier in ("spool", "spool-memory"):
        assert mounts(main)[tier] == mounts(sidecar)[tier]
    assert mounts(main)["spool"] == settings["HSX_SPOOL_DIR"] and mounts(main)["spool-memory"] == settings["HSX_MEMORY_SPOOL_DIR"]
    for c in (main, sidecar):
        host = next(e for e in c["env"] if e["name"] == "HSX_HOST")
        assert host["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert {v["name"]: v for v in worker["volumes"]}["spool-memory"]["emptyDir"]["medium"] == "Memory"
    # Redis: AOF everysec, noeviction, on a persistent volume.
    redis = _by(docs, "StatefulSet", "hsx-redis")["spec"]
    args = redis["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert redis["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    # The dashboard's token from the Secret, behind a Service.
    dash = _by(docs, "Deployment", "hsx-dashboard")["spec"]["template"]["spec"]["containers"][0]
    token = next(e for e in dash["env"] if e["name"] == "HSX_DASHBOARD_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["name"] == "hsx-secrets"
    assert _by(docs, "Service", "hsx-dashboard")["spec"]["ports"][0]["port"] == 8787
    # KEDA reads the list rq keeps the run's waiting extract jobs in.
    trigger = _by(docs, "ScaledObject", "hsx-worker")["spec"]["triggers"][0]["metadata"]
    assert trigger["listName"] == "rq:queue:" + queues.extract_queue_name(settings["HSX_RUN"])


# ---- the scaling test -----------------------------------------------------------------------------------------
RUN, SAMPLES, TARGET = "k8s", 240, 6   # TARGET: waiting batches per worker (KEDA's listLength)
SIDECAR = K8S / "base" / "uploader-sidecar.sh"


class Pod:
    """One worker pod as the manifests make it: `hsx worker` + the uploader sidecar script, one spool, one host."""

    def __init__(self, name: str, env: dict, root: Path):
        self.name, self.logs = name, root / "logs"
        spool = root / "spool" / name
        env = {**env, "HSX_HOST": name, "HSX_SPOOL_DIR": str(spool), "HSX_UPLOADERS": "1",
               "PATH": f"{BIN}:{env.get('PATH', '')}"}
        self.logs.mkdir(parents=True, exist_ok=True)
        self.worker = subprocess.Popen([str(BIN / "hsx"), "worker", "--run", RUN, "--device", "cpu", "--wait-for-plan",
                                        "--name", f"gpu-{name}"], env=env,
                                       stdout=open(self.logs / f"{name}-worker.log", "w"), stderr=subprocess.STDOUT)
        self.sidecar = subprocess.Popen(["/bin/sh", str(SIDECAR)], env=env, start_new_session=True,
                                        stdout=open(self.logs / f"{name}-sidecar.log", "w"), stderr=subprocess.STDOUT)

    def evict(self, timeout: float) -> None:
        """SIGTERM as the kubelet sends it: the worker first; the native sidecar once the worker has exited."""
        self.worker.send_signal(signal.SIGTERM)
        assert self.worker.wait(timeout=timeout) == 0
        self.sidecar.send_signal(signal.SIGTERM)
        assert self.sidecar.wait(timeout=timeout) == 0

    def kill(self) -> None:
        for proc in (self.worker, self.sidecar):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL) if proc is self.sidecar else proc.kill()


@pytest.mark.slow
def test_workers_scaled_like_keda_lose_and_double_nothing(redis_server, r, tiny_model, tmp_path, artifacts):
    rows = [json.loads(line) for line in sample_dataset().read_text().splitlines()]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({**rows[i % len(rows)], "id": f"s{i:04d}"}) + "\n" for i in range(SAMPLES)))
    env = {**os.environ, "HSX_REDIS_URL": redis_server.url, "HSX_HEARTBEAT_SECONDS": "1", "HSX_GRACE_SECONDS": "10",
           "HSX_TEST_MIN_BATCH_SECONDS": "0.5", "HSX_MEMORY_SPOOL_BUDGET_GB": "0", "HSX_LOG_EVERY_SECONDS": "5"}
    store = tmp_path / "store"
    out = subprocess.run([str(BIN / "hsx"), "produce", "--run", RUN, "--dataset", str(data), "--model", str(tiny_model),
                          "--layers", "dflash:3", "--store", str(store), "--dtype", "float32", "--token-budget", "512",
                          "--max-length", "512", "--overlong", "truncate", "--lease-seconds", "8"],
                         env=env, capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stderr
    keys, listname = RunKeys(RUN), "rq:queue:" + queues.extract_queue_name(RUN)
    pods: list[Pod] = []
    counts = Counter()
    evicted_holding: list[str] = []
    t0 = time.monotonic()

    def desired(most: int) -> int:  # KEDA's rule: ceil(waiting / listLength), 0..most
        return min(most, math.ceil(r.llen(listname) / TARGET))

    def scale_to(n: int) -> None:
        while len(pods) < n:
            pods.append(Pod(f"hsx-worker-{len(pods)}", env, tmp_path))
            counts["pods started"] += 1
        while len(pods) > n:  # a StatefulSet removes the highest ordinal first
            pod = pods.pop()
            held = [w.get("current_batch") for w in heartbeat.read_workers(r, RUN)
                    if w["worker"] == f"gpu-{pod.name}" and w.get("alive") and w.get("current_batch")]
            if held and r.zscore(keys.extract_leases, held[0]) is not None:
                evicted_holding.append(held[0])
            pod.evict(timeout=scaled(120))
            counts["SIGTERMs (worker + sidecar)"] += 2

    def busy(name: str) -> bool:
        return any(w["worker"] == f"gpu-{name}" and w.get("batches", 0) >= 1 for w in heartbeat.read_workers(r, RUN))

    try:
        scale_to(desired(3))
        assert len(pods) == 3
        wait_until("3 pods extracting", lambda: all(busy(p.name) for p in pods), 120)
        scale_to(1)                                                   # scale-down mid-run, mid-batch
        wait_until("more batches done", lambda: r.scard(keys.done) >= 10, 120)
        scale_to(max(1, desired(2)))                                  # scale up again
        # The autoscaler's loop. An empty list scales to zero even while batches are in hand (running jobs are not
        # in the list): those workers finish or hand back their batch, and a handed-back batch scales them up again.
        while not r.get(keys.index_written):
            scale_to(desired(2))
            for pod in pods:
                assert pod.worker.poll() is None and pod.sidecar.poll() is None, f"{pod.name} died: see its logs"
            time.sleep(1)
            assert time.monotonic() - t0 < 900, "the run did not finish"
        scale_to(0)
    finally:
        for pod in pods:
            pod.kill()
    assert r.zcard(keys.extract_leases) == 0 and r.zcard(keys.upload_leases) == 0  # scaled to zero: no lease left
    seen = Counter()
    for path in (store / RUN / "batches").rglob("*.safetensors"):
        seen.update(batchfile.read_bytes(path.read_bytes(), where=str(path)).sample_ids)
    assert len(seen) == SAMPLES and max(seen.values()) == 1
    assert all(r.sismember(keys.done, bid) for bid in evicted_holding)
    assert [p for p in (tmp_path / "spool").rglob("*") if p.is_file()] == []
    verify = subprocess.run([str(BIN / "hsx"), "verify", "--run", RUN], env=env, capture_output=True, text=True, timeout=scaled(300))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    handed_back = sum((tmp_path / "logs" / f.name).read_text().count("handed") for f in (tmp_path / "logs").glob("*-worker.log"))
    report = {**counts, "evictions holding a batch": len(evicted_holding), "batches handed back": handed_back,
              "samples": SAMPLES, "samples exactly once": sum(1 for c in seen.values() if c == 1),
              "seconds": round(time.monotonic() - t0, 1), "batches": ledger.run_totals(r, RUN)["batches"]}
    (artifacts / "k8s_scaling.json").write_text(json.dumps(report, indent=1))
    print(report)
