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
from tests.pacedworker import PACED_HSX
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


# ---- who may reach Redis, and as whom every container runs (issue 37 item 7) ------------------------------------
HSX_PODS = ("hsx-worker", "hsx-produce", "hsx-dashboard")   # app.kubernetes.io/name of every pod of hsx's own


def _pod_specs(docs) -> dict[str, dict]:
    """Every workload's pod spec by workload name (StatefulSet, Deployment, Job)."""
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs
            if d["kind"] in ("StatefulSet", "Deployment", "Job")}


def _containers(pod: dict) -> list[dict]:
    return pod["containers"] + pod.get("initContainers", [])


def _matches(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels, matchExpressions with In / NotIn / Exists / DoesNotExist) against labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and value in e.get("values", []), "NotIn": not has or value not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def admitted(docs, to: str, port: int, source: dict, namespace: dict | None = None) -> bool:
    """Whether the NetworkPolicies let a pod with labels ``source`` (in a namespace with labels ``namespace``; None:
    hsx's own) open ``port`` on the pods of app.kubernetes.io/name ``to``: the rules of Kubernetes' NetworkPolicy."""
    target = {"app.kubernetes.io/name": to}
    policies = [d["spec"] for d in docs if d["kind"] == "NetworkPolicy" and "Ingress" in d["spec"]["policyTypes"]
                and _matches(d["spec"]["podSelector"], target)]
    if not policies:
        return True  # not isolated
    for rule in (rule for p in policies for rule in p.get("ingress", [])):
        if rule.get("ports") and not any(p.get("port") == port for p in rule["ports"]):
            continue
        peers = rule.get("from")
        if not peers:
            return True
        for peer in peers:
            if "ipBlock" in peer:
                return True
            if "namespaceSelector" in peer:
                ns_ok = namespace is not None and _matches(peer["namespaceSelector"], namespace)
            else:
                ns_ok = namespace is None  # a podSelector alone: the policy's own namespace
            if ns_ok and _matches(peer.get("podSelector", {}), source):
                return True
    return False


@pytest.mark.parametrize("overlay", ["gpu", "cpu", "keda"])
def test_only_hsx_pods_reach_redis(overlay):
    docs = render(overlay)
    label = lambda name: {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "hsx"}  # noqa: E731
    for pod in HSX_PODS:
        assert admitted(docs, "hsx-redis", 6379, label(pod)), pod
        assert not admitted(docs, "hsx-redis", 6380, label(pod)), pod  # its port only
    assert not admitted(docs, "hsx-redis", 6379, {"app.kubernetes.io/name": "anything-else"})
    assert not admitted(docs, "hsx-redis", 6379, {})
    assert not admitted(docs, "hsx-redis", 6379, label("hsx-worker"), namespace={"kubernetes.io/metadata.name": "x"})
    keda = {"app.kubernetes.io/name": "keda-operator"}
    assert admitted(docs, "hsx-redis", 6379, keda, {"kubernetes.io/metadata.name": "keda"}) == (overlay == "keda")
    # Redis opens no connection; workers and the producer listen on nothing; the dashboard on its port only.
    redis_policy = _by(docs, "NetworkPolicy", "hsx-redis")["spec"]
    assert "Egress" in redis_policy["policyTypes"] and not redis_policy.get("egress")
    for pod in ("hsx-worker", "hsx-produce"):
        assert not admitted(docs, pod, 8787, label("hsx-dashboard")) and not admitted(docs, pod, 6379, {}), pod
    assert admitted(docs, "hsx-dashboard", 8787, {}) and not admitted(docs, "hsx-dashboard", 6379, label("hsx-worker"))
    # Every workload is covered by an ingress policy: no pod of the kustomization is left open by omission.
    for d in docs:
        if d["kind"] in ("StatefulSet", "Deployment", "Job"):
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert any(p["kind"] == "NetworkPolicy" and _matches(p["spec"]["podSelector"], labels) for p in docs), labels


def _kind(docs, name: str) -> str:
    return next(d["kind"] for d in docs if d["metadata"]["name"] == name and d["kind"] in ("StatefulSet", "Deployment", "Job"))


@pytest.mark.parametrize("overlay", ["gpu", "cpu", "keda"])
def test_every_container_runs_unprivileged_on_a_read_only_root(overlay):
    docs = render(overlay)
    settings = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("hsx-settings"))["data"]
    pods = _pod_specs(docs)
    assert set(pods) == {"hsx-redis", *HSX_PODS}
    for name, pod in pods.items():
        sc = pod.get("securityContext", {})
        assert sc.get("runAsNonRoot") is True and sc.get("runAsUser", 0) > 0, (name, sc)
        assert sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", name
        assert pod.get("automountServiceAccountToken") is False, name  # no pod talks to the API server
        kind = _kind(docs, name)
        claims = {c["metadata"]["name"] for c in _by(docs, kind, name)["spec"].get("volumeClaimTemplates", [])}
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in _containers(pod):
            where = f"{name}/{c['name']}"
            csc = c.get("securityContext", {})
            assert csc.get("allowPrivilegeEscalation") is False, where
            assert csc.get("capabilities", {}).get("drop") == ["ALL"] and not csc["capabilities"].get("add"), where
            assert csc.get("readOnlyRootFilesystem") is True and not csc.get("privileged"), where
            assert csc.get("runAsUser", sc["runAsUser"]) > 0, where
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            # What the role writes is a writable volume: /tmp (and HOME) an emptyDir; the spool and Redis's data.
            writes = {"/tmp", env.get("HOME") or "/tmp"}
            if name == "hsx-worker":
                writes |= {settings["HSX_SPOOL_DIR"], settings["HSX_MEMORY_SPOOL_DIR"]}
            if name == "hsx-redis":
                writes.add("/data")
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            for path in writes:
                mount = mounts.get(path)
                assert mount is not None and not mount.get("readOnly"), (where, path)
                assert mount["name"] in claims or "emptyDir" in volumes[mount["name"]], (where, path)
            assert "emptyDir" in volumes[mounts["/tmp"]["name"]], where


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of an env value."""
    for key, val in env.items():
        value = value.replace(f"$({key})", val)
    return value


def test_redis_requires_the_secret_password_and_roles_read_it_only_through_their_url(tmp_path):
    """The Redis container's own command, run here with its Secret in the environment: it refuses a client without
    the password, the password is on no command line, and each hsx container's HSX_REDIS_URL (built from the same
    Secret key) gets in."""
    import redis as redis_py

    from hsx.redisconn import connect, free_port

    docs = render("keda")
    password = "0123abcd" * 4  # docs/deploy.md: hex, as `openssl rand -hex 32` makes it
    secret = {"HSX_REDIS_PASSWORD": password}
    redis_pod = _pod_specs(docs)["hsx-redis"]
    box = redis_pod["containers"][0]
    env = {}
    for e in box["env"]:
        ref = e["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "hsx-secrets"
        env[e["name"]] = secret[ref["key"]]
    port = free_port()
    argv = box["command"] + box["args"] + ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    assert not any(password in a or "HSX_REDIS_PASSWORD)" in a for a in argv)
    proc = subprocess.Popen(argv, env={"PATH": os.environ["PATH"], **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    bare = redis_py.Redis(port=port, socket_connect_timeout=2)

    def answer() -> str:
        try:
            bare.ping()
            return "answered"
        except redis_py.AuthenticationError:
            return "refused"

    try:
        assert wait_until("redis-server up", answer, 20, retry_on=(redis_py.ConnectionError,),
                          check=lambda: proc.poll() is None or pytest.fail("redis-server exited")) == "refused"
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline and b"redis-server" in cmdline
        assert proc.poll() is None
        probe = redis_pod["containers"][0]["readinessProbe"]["exec"]["command"]
        assert subprocess.run(probe[:-1] + [probe[-1].replace("redis-cli", f"redis-cli -p {port}")],
                              env={"PATH": os.environ["PATH"], **env}, timeout=scaled(30)).returncode == 0
        for name in HSX_PODS:
            for c in _containers(_pod_specs(docs)[name]):
                where = f"{name}/{c['name']}"
                assert not any("REDIS" in a for a in c.get("args", []) + c.get("command", [])), where
                env = {}
                for e in c["env"]:
                    if "secretKeyRef" in e.get("valueFrom", {}):
                        env[e["name"]] = secret.get(e["valueFrom"]["secretKeyRef"]["key"], "x")
                    elif "value" in e:
                        env[e["name"]] = _expand(e["value"], env)
                url = env["HSX_REDIS_URL"].replace("hsx-redis:6379", f"127.0.0.1:{port}")
                assert f":{password}@" in url, where
                assert connect(url, wait_seconds=5).ping(), where
    finally:
        proc.terminate()
        proc.wait(timeout=scaled(30))
    settings = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("hsx-settings"))["data"]
    assert "HSX_REDIS_URL" not in settings  # a password-less URL in the ConfigMap would be the one a shell sees
    auth = _by(docs, "TriggerAuthentication", "hsx-redis")["spec"]["secretTargetRef"]
    assert auth == [{"parameter": "password", "name": "hsx-secrets", "key": "HSX_REDIS_PASSWORD"}]
    assert _by(docs, "ScaledObject", "hsx-worker")["spec"]["triggers"][0]["authenticationRef"]["name"] == "hsx-redis"


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
        self.worker = subprocess.Popen([*PACED_HSX, "worker", "--run", RUN, "--device", "cpu", "--wait-for-plan",
                                        "--name", f"gpu-{name}"], env=env,
                                       stdout=open(self.logs / f"{name}-worker.log", "w"), stderr=subprocess.STDOUT)
        self.sidecar = subprocess.Popen(["/bin/sh", str(SIDECAR)], env=env, start_new_session=True,
                                        stdout=open(self.logs / f"{name}-sidecar.log", "w"), stderr=subprocess.STDOUT)

    def evict(self, timeout: float) -> None:
        """SIGTERM as the kubelet sends it: the worker first; the native sidecar once the worker has exited. A pod
        that fails its eviction is killed (it is no longer in the test's list of pods: nothing else would)."""
        try:
            self.worker.send_signal(signal.SIGTERM)
            assert self.worker.wait(timeout=timeout) == 0
            self.sidecar.send_signal(signal.SIGTERM)
            assert self.sidecar.wait(timeout=timeout) == 0
        except BaseException:
            self.kill()
            raise

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
        wait_until("more batches done", lambda: ledger.done_count(r, RUN) >= 10, 120)
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
        seen.update(batchfile.read_batch_bytes(path.read_bytes(), where=str(path)).sample_ids)
    assert len(seen) == SAMPLES and max(seen.values()) == 1
    assert ledger.done_among(r, RUN, list(evicted_holding)) == set(evicted_holding)
    assert [p for p in (tmp_path / "spool").rglob("*") if p.is_file()] == []
    verify = subprocess.run([str(BIN / "hsx"), "verify", "--run", RUN], env=env, capture_output=True, text=True, timeout=scaled(300))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    handed_back = sum((tmp_path / "logs" / f.name).read_text().count("handed") for f in (tmp_path / "logs").glob("*-worker.log"))
    report = {**counts, "evictions holding a batch": len(evicted_holding), "batches handed back": handed_back,
              "samples": SAMPLES, "samples exactly once": sum(1 for c in seen.values() if c == 1),
              "seconds": round(time.monotonic() - t0, 1), "batches": ledger.run_totals(r, RUN)["batches"]}
    (artifacts / "k8s_scaling.json").write_text(json.dumps(report, indent=1))
    print(report)
