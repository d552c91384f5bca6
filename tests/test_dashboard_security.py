"""Issue 13, items 1, 5 and 6c: the dashboard (and the rq-dashboard it mounts) against someone who can
write to Redis or reach the port through a browser.

- every /rq route (enumerated from the app's url_map), every method, with job hashes whose meta,
  result and data are pickles that would create a file when unpickled: no file, no 500;
- rq-dashboard is read-only (no GET or POST changes a queue) and its Workers page shows the job a
  worker holds;
- the ?token= login and a Redis password given as ?password= appear in no log, page or banner;
- a state-changing request through a foreign Host or Origin (DNS rebinding, cross-site form) is refused.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib
from base64 import b64encode
from pathlib import Path

import pytest
from markupsafe import escape
from rq import Queue, Worker
from rq.job import Job
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

from dashboard.app import create_app
from dashboard.config import DashboardConfig
from hsx.life import ledger, queues
from hsx.life.ledger import BatchSpec
from hsx.redisconn import free_port, redact
from tests.manifests import example_manifest
from tests.waiting import scaled

RUN = "sec"
SPECS = [BatchSpec(batch_id=f"b{i:07d}", index=i, shard="00000", samples=2, tokens=10, padded=16, padded_len=8,
                   sample_ids=[f"s{i}-{j}" for j in range(2)]) for i in range(3)]
TOKEN = "tok-5f0c2a9d41e8b7"
REGISTRIES = ("queued", "failed", "started", "finished", "deferred", "scheduled", "canceled")


class _Creates:
    """Unpickling this creates ``path`` (open(path, "w")): proof that something unpickled it."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _plant_pickled_job(r, job_id: str, queue_name: str, markers: Path, status: str) -> None:
    """A job hash as a pickle-using rq client would write it, every pickled field a payload."""
    data = zlib.compress(pickle.dumps(("builtins.print", None, [_Creates(markers / f"{job_id}.data")], {})))
    r.hset(f"rq:job:{job_id}", mapping={
        "data": data, "meta": pickle.dumps(_Creates(markers / f"{job_id}.meta")),
        "result": pickle.dumps(_Creates(markers / f"{job_id}.result")),
        "origin": queue_name, "status": status, "description": "planted", "created_at": "2026-01-01T00:00:00.000000Z",
        "enqueued_at": "2026-01-01T00:00:00.000000Z", "started_at": "2026-01-01T00:00:01.000000Z",
        "ended_at": "2026-01-01T00:00:02.000000Z", "worker_name": "evil-worker",
        "exc_info": zlib.compress(b"Traceback: planted")})
    r.xadd(f"rq:results:{job_id}", {"type": 2, "worker_name": "evil-worker",
                                    "return_value": b64encode(pickle.dumps(_Creates(markers / f"{job_id}.rv")))})
    r.sadd("rq:queues", f"rq:queue:{queue_name}")


def _plant(r, markers: Path) -> dict[str, str]:
    """Pickled jobs in every place rq-dashboard looks, beside hsx's own JSON jobs; {job id: queue}."""
    ledger.save_plan(r, RUN, example_manifest(RUN), SPECS, {"batches": 3, "samples": 6, "tokens": 30})
    ext = queues.extract_queue_name(RUN)
    legit = queues.enqueue_extract(r, RUN, SPECS[0].batch_id, seq=1)
    jobs = {legit.id: ext}
    for name, status, place in (("evil-queued", "queued", "queue"), ("evil-failed", "failed", "failed"),
                                ("evil-started", "started", "started")):
        _plant_pickled_job(r, name, ext, markers, status)
        jobs[name] = ext
        if place == "queue":
            r.rpush(f"rq:queue:{ext}", name)
        elif place == "failed":
            r.zadd(FailedJobRegistry(ext, connection=r).key, {name: time.time() + 3600})
        else:
            r.zadd(StartedJobRegistry(ext, connection=r).key, {name: time.time() + 3600})
    # A queue only pickled jobs live in, as another rq application sharing this Redis would have.
    _plant_pickled_job(r, "evil-other", "other-app", markers, "failed")
    r.rpush("rq:queue:other-app", "evil-other")
    r.zadd(FailedJobRegistry("other-app", connection=r).key, {"evil-other": time.time() + 3600})
    jobs["evil-other"] = "other-app"
    # A worker holding a pickled job.
    evil = Worker([Queue("other-app", connection=r)], connection=r, name="evil-worker")
    evil.register_birth()
    evil.prepare_execution(Job.fetch("evil-started", connection=r, serializer=JSONSerializer))
    return jobs


def _urls(app, jobs: dict[str, str]) -> list[tuple[str, str, str]]:
    """(method, url, endpoint) for every rule of the rq-dashboard blueprint, for every job/queue/registry."""
    out = []
    with app.test_request_context():
        from flask import url_for

        for rule in app.url_map.iter_rules():
            if not rule.endpoint.startswith("rq_dashboard."):
                continue
            choices: list[dict] = [{}]
            for arg in rule.arguments - set(rule.defaults or {}):
                values = {"instance_number": [0], "queue_name": sorted(set(jobs.values())), "registry_name": REGISTRIES,
                          "job_id": sorted(jobs), "per_page": [8], "order": ["asc"], "page": [1],
                          "filename": ["js/jquery-3.5.1.min.js"]}[arg]
                choices = [{**c, arg: v} for c in choices for v in values]
            for args in choices:
                url = url_for(rule.endpoint, **args)
                for method in sorted((rule.methods or set()) | {"GET", "POST", "DELETE"}):
                    out.append((method, url, rule.endpoint))
    return sorted(set(out))


def _queue_state(r) -> dict[str, object]:
    keys = sorted(k.decode() for k in r.keys("rq:*") if not k.startswith((b"rq:worker", b"rq:workers",
                                                                         b"rq:clean", b"rq:results")))
    read = {b"hash": r.hgetall, b"list": lambda k: r.lrange(k, 0, -1), b"set": r.smembers,
            b"zset": lambda k: r.zrange(k, 0, -1, withscores=True), b"string": r.get, b"stream": r.xrange}
    return {k: (r.type(k), read[r.type(k)](k)) for k in keys}


# the planted started-registry member "evil-started" lacks rq's job_id:execution_id form: rq warns when it reads it
@pytest.mark.filterwarnings("ignore:Composite key must contain job_id:DeprecationWarning")
def test_every_rq_route_never_unpickles_never_500s_and_changes_nothing(r, redis_server, tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    jobs = _plant(r, markers)
    # Token auth on, as in the report: an authorised operator's GET must not run a payload either.
    app = create_app(DashboardConfig(redis_url=redis_server.url, token=TOKEN), r=r)
    client = app.test_client()
    auth = {"Authorization": f"Bearer {TOKEN}", "Host": "127.0.0.1:8787", "Origin": "http://127.0.0.1:8787"}
    before = _queue_state(r)
    answers = {}
    for method, url, endpoint in _urls(app, jobs):
        res = client.open(url, method=method, headers=auth)
        answers[(method, url)] = res.status_code
        assert res.status_code != 500, (method, url, res.data[:300])
        assert not list(markers.iterdir()), f"{method} {url} unpickled a payload: {sorted(markers.iterdir())}"
        if method not in ("GET", "HEAD", "OPTIONS"):
            assert res.status_code in (403, 405), (method, url, res.status_code)
        if endpoint.split(".")[1] in ("requeue_all", "requeue_job_view", "delete_job_view", "empty_queue",
                                      "compact_queue") and method != "OPTIONS":  # OPTIONS: Flask's automatic Allow
            assert res.status_code in (403, 405), (method, url, res.status_code)
    assert _queue_state(r) == before, "an /rq request changed rq's queues or registries"
    assert len(answers) > 300
    # The views kept still answer: the overview, queue depths, lists and the hsx job itself.
    assert answers[("GET", "/rq/")] == 200 and answers[("GET", "/rq/0/data/queues.json")] == 200
    legit = next(j for j in jobs if j.startswith("x-"))
    assert answers[("GET", f"/rq/0/data/job/{legit}.json")] == 200
    assert answers[("GET", f"/rq/0/view/job/{legit}")] == 200
    # Lists and the Workers page still answer with a planted job among hsx's: it shows as "not JSON".
    listed = client.get(f"/rq/0/data/jobs/{queues.extract_queue_name(RUN)}/queued/8/asc/1.json", headers=auth)
    assert listed.status_code == 200
    assert {j["id"]: "not JSON" in j["description"] for j in listed.json["jobs"]} == {legit: False, "evil-queued": True}
    workers = client.get("/rq/0/data/workers.json", headers=auth)
    assert workers.status_code == 200
    assert "not JSON" in {w["name"]: w for w in workers.json["workers"]}["evil-worker"]["current_job"]["call_string"]
    assert not list(markers.iterdir())
    depths = {q["name"]: q["count"] for q in client.get("/rq/0/data/queues.json", headers=auth).json["queues"]}
    assert depths[queues.extract_queue_name(RUN)] == 2
    assert client.get("/rq/1/data/queues.json", headers=auth).status_code == 404  # one Redis: instance 0 only


def test_workers_page_shows_the_job_a_worker_holds(r, redis_server):
    ledger.save_plan(r, RUN, example_manifest(RUN), SPECS, {"batches": 3, "samples": 6, "tokens": 30})
    job = queues.enqueue_extract(r, RUN, SPECS[1].batch_id, seq=1)
    q = queues.queue(r, queues.extract_queue_name(RUN))
    worker = Worker([q], connection=r, name="gpu-hostA-0", serializer=JSONSerializer, job_class=queues.HsxJob)
    worker.register_birth()
    worker.prepare_execution(job)  # what rq does when it starts the job
    client = create_app(DashboardConfig(redis_url=redis_server.url), r=r).test_client()
    res = client.get("/rq/0/data/workers.json")
    assert res.status_code == 200, res.data[:300]
    [w] = res.json["workers"]
    assert w["name"] == "gpu-hostA-0" and w["current_job"]["job_id"] == job.id
    assert w["current_job"]["description"] == f"extract {RUN}/{SPECS[1].batch_id}"
    assert "extract_batch" in w["current_job"]["call_string"]
    assert client.get("/rq/0/view/workers").status_code == 200


def test_rq_job_class_and_default_serializer_never_pickle(r, tmp_path):
    """Outside the dashboard too: rq's default serializer in an hsx process reads JSON only, once the process's
    entry made it so (each entry does: tests/test_house.py)."""
    queues.rq_without_pickle()
    marker = tmp_path / "m"
    r.hset("rq:job:p1", mapping={"data": zlib.compress(b"[]"), "meta": pickle.dumps(_Creates(marker)),
                                 "result": pickle.dumps(_Creates(marker)), "status": "finished", "origin": "q"})
    job = Job.fetch("p1", connection=r)  # no serializer: rq's default
    assert job.meta == {"unserialized": pickle.dumps(_Creates(marker))} and not marker.exists()
    job2 = Job.fetch("p1", connection=r, serializer="pickle")  # even asking for pickle by name
    assert not marker.exists() and job2.meta.get("unserialized")


# ---- item 5: secrets ------------------------------------------------------------------------------

@pytest.mark.parametrize("url, secret", [
    ("redis://:pw1-secret@h:6379/0", "pw1-secret"),
    ("redis://user:pw2-secret@h:6379/0", "pw2-secret"),
    ("rediss://:p%40w3-secret@h:6380/0?ssl_cert_reqs=required", "p%40w3-secret"),
    ("redis://h:6379/0?password=pw4-secret", "pw4-secret"),
    ("redis://h:6379/0?db=1&PASSWORD=pw5-secret&socket_timeout=5", "pw5-secret"),
    ("rediss://h:6380/0?sentinel_password=pw6-secret", "pw6-secret"),
    ("unix:///run/redis.sock?db=0&password=pw7-secret", "pw7-secret"),
    ("unix://:pw8-secret@/run/redis.sock?db=0", "pw8-secret"),
    ("redis://pw9-secret@h:6379/0", "pw9-secret"),
])
def test_redact_hides_every_password_shape(url, secret):
    shown = redact(url)
    assert secret not in shown and "***" in shown
    assert redact(shown) == shown
    host = re.sub(r"^[a-z]+://([^@]*@)?", "", url).split("/")[0].split("?")[0]
    assert host in shown


def test_redact_keeps_a_url_without_secrets():
    for url in ("redis://h:6379/0", "unix:///run/redis.sock?db=2", "rediss://h:6380/0?ssl_cert_reqs=none"):
        assert redact(url) == url


def _hsx() -> list[str]:
    script = Path(sys.executable).with_name("hsx")
    return [str(script)] if script.exists() else [sys.executable, "-m", "hsx_cli.main"]


@pytest.fixture
def password_redis(tmp_path):
    """A private redis-server that requires a password."""
    binary = os.environ.get("HSX_REDIS_SERVER") or shutil.which("redis-server")
    port, password = free_port(), "redis-pw-7d1e93"
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", password,
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        yield port, password
    finally:
        proc.terminate()
        proc.wait(timeout=scaled(10))


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def test_token_login_and_query_password_stay_out_of_logs_pages_and_banner(password_redis, tmp_path):
    import redis as redis_py

    port, password = password_redis
    url = f"redis://127.0.0.1:{port}/0?password={password}"
    deadline = time.monotonic() + scaled(10)
    while True:
        try:
            redis_py.Redis.from_url(url).ping()
            break
        except redis_py.ConnectionError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    r = redis_py.Redis.from_url(url)
    ledger.save_plan(r, RUN, example_manifest(RUN), SPECS, {"batches": 3, "samples": 6, "tokens": 30})
    queues.enqueue_extract(r, RUN, SPECS[0].batch_id, seq=1)

    env = {**os.environ, "HSX_REDIS_URL": url, "HSX_DASHBOARD_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
    env.pop("HSX_DASHBOARD_USER", None)
    env.pop("HSX_DASHBOARD_PASSWORD", None)
    http_port = free_port()
    log_path = tmp_path / "dashboard.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*_hsx(), "dashboard", "--port", str(http_port)], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    bodies = []
    try:
        base = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + scaled(30)
        while True:
            try:
                urllib.request.urlopen(f"{base}/metrics", timeout=scaled(2))
            except urllib.error.HTTPError as exc:
                assert exc.code == 401
                break
            except OSError:
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.2)
        opener = urllib.request.build_opener(_NoRedirect)
        with pytest.raises(urllib.error.HTTPError) as redirected:
            opener.open(f"{base}/?run={RUN}&token={TOKEN}", timeout=scaled(5))
        assert redirected.value.code == 302
        cookie = redirected.value.headers["Set-Cookie"].split(";")[0]
        for path in ("/", f"/api/status?run={RUN}", "/rq/", "/rq/0/view/workers", "/rq/0/data/queues.json",
                     "/metrics", f"/rq/0/view/jobs/{queues.extract_queue_name(RUN)}/queued/8/asc/1"):
            with urllib.request.urlopen(urllib.request.Request(base + path, headers={"Cookie": cookie}),
                                        timeout=scaled(5)) as res:
                assert res.status == 200, path
                bodies.append((path, res.read().decode()))
    finally:
        proc.terminate()
        proc.wait(timeout=scaled(10))
    logged = log_path.read_text()
    assert "GET /?run=" in logged and "token=***" in logged  # the access log is on, the token masked
    assert TOKEN not in logged and password not in logged, logged
    assert f"127.0.0.1:{port}/0?password=***" in logged  # the banner names the Redis, masked
    for path, body in bodies:
        assert password not in body and TOKEN not in body, path
    status = json.loads(dict(bodies)[f"/api/status?run={RUN}"])
    assert status["redis"] == f"redis://127.0.0.1:{port}/0?password=***"


def test_query_password_on_the_command_line_is_refused(tmp_path):
    secret = "cli-pw-42e1a0"
    res = subprocess.run([*_hsx(), "status", "--redis-url", f"redis://127.0.0.1:1/0?password={secret}"],
                         capture_output=True, text=True, timeout=scaled(60),
                         env={k: v for k, v in os.environ.items() if k not in ("HSX_REDIS_URL", "REDIS_URL")})
    assert res.returncode != 0 and "password" in res.stderr, res.stderr
    assert secret not in res.stdout + res.stderr


# ---- item 6c: Host and Origin on state-changing requests ------------------------------------------

def _dead_letter(r):
    ledger.save_plan(r, RUN, example_manifest(RUN), SPECS, {"batches": 3, "samples": 6, "tokens": 30})
    for spec in SPECS:
        queues.enqueue_extract(r, RUN, spec.batch_id, seq=1)
    ledger.record_failure(r, RUN, SPECS[2].batch_id, "boom", max_attempts=1)


@pytest.mark.parametrize("headers, why", [
    ({"Host": "rebind.evil.example:8787", "Origin": "http://rebind.evil.example:8787"}, "Host"),
    ({"Host": "rebind.evil.example:8787"}, "Host"),
    ({"Host": "127.0.0.1:8787", "Origin": "http://evil.example"}, "cross-origin"),
    ({"Host": "127.0.0.1:8787", "Origin": "null"}, "cross-origin"),
    ({"Host": "127.0.0.1:8787", "Sec-Fetch-Site": "cross-site"}, "cross-site"),
])
def test_state_changes_through_a_foreign_host_or_origin_are_refused(r, redis_server, headers, why):
    _dead_letter(r)
    client = create_app(DashboardConfig(redis_url=redis_server.url), r=r).test_client()  # no auth
    ext = queues.extract_queue_name(RUN)
    before = queues.queue(r, ext).count
    res = client.post("/api/retry", json={"run": RUN}, headers=headers)
    assert res.status_code == 403 and why in res.get_data(as_text=True)
    res = client.post(f"/rq/queue/{ext}/queued/empty", headers=headers)
    assert res.status_code == 403
    assert queues.queue(r, ext).count == before and list(ledger.dead_letters(r, RUN)) == [SPECS[2].batch_id]
    # Reading stays open (no auth configured): the page, its numbers, rq's queue depths.
    assert client.get("/api/status", headers=headers).status_code == 200


@pytest.mark.parametrize("host, allowed", [
    ("127.0.0.1:8787", ()), ("localhost:8787", ()), ("[::1]:8787", ()), ("10.1.2.3", ()),
    ("gpu-box-1:8787", ("gpu-box-1",)), ("Dash.Example.org.", ("dash.example.org",)),
])
def test_state_changes_through_this_dashboard_pass(r, redis_server, host, allowed):
    _dead_letter(r)
    config = DashboardConfig(redis_url=redis_server.url, allowed_hosts=allowed)
    client = create_app(config, r=r).test_client()
    origin = f"http://{host.lower().rstrip('.')}"
    res = client.post("/api/retry", json={"run": RUN}, headers={"Host": host, "Origin": origin,
                                                                 "Sec-Fetch-Site": "same-origin"})
    assert res.status_code == 200 and res.json["retried"] == [SPECS[2].batch_id], res.data
    assert client.post("/api/retry", json={"run": RUN}, headers={"Host": host}).status_code == 200  # curl: no Origin


def test_allowed_hosts_from_the_environment(monkeypatch):
    from hsx_cli import dashboard as command
    from hsx_cli.flags import resolve
    from hsx_cli.main import build_parser

    args = build_parser().parse_args(["dashboard"])
    monkeypatch.setenv("HSX_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("HSX_DASHBOARD_ALLOWED_HOSTS", "gpu-box-1, Dash.Example.org.")
    config = command.config(resolve(command.FLAGS, args))
    assert config.allowed_hosts == ("gpu-box-1", "dash.example.org")
    monkeypatch.setenv("HSX_DASHBOARD_ALLOWED_HOSTS", "http://gpu-box-1:8787")
    with pytest.raises(ValueError, match="without scheme or port"):
        command.config(resolve(command.FLAGS, args))


def test_job_lists_answer_with_invalid_job_ids_in_a_queue_or_registry(r, redis_server):
    """A job id rq refuses to build a Job from (anyone who can write to Redis can plant one) made every list
    holding it answer 500; it is listed as unreadable and the valid jobs beside it still show."""
    ledger.save_plan(r, RUN, example_manifest(RUN), SPECS, {"batches": 3, "samples": 6, "tokens": 30})
    ext = queues.extract_queue_name(RUN)
    legit = queues.enqueue_extract(r, RUN, SPECS[0].batch_id, seq=1)
    bad_ids = ["bad id!", "../etc", "<img src=x>"]
    for bad in bad_ids:
        r.zadd(FailedJobRegistry(ext, connection=r).key, {bad: time.time() + 3600})
        r.rpush(f"rq:queue:{ext}", bad)
    app = create_app(DashboardConfig(redis_url=redis_server.url, token=TOKEN), r=r)
    auth = {"Authorization": f"Bearer {TOKEN}", "Host": "127.0.0.1:8787", "Origin": "http://127.0.0.1:8787"}
    client = app.test_client()
    for registry, want in (("queued", {legit.id, *bad_ids}), ("failed", set(bad_ids))):
        res = client.get(f"/rq/0/data/jobs/{ext}/{registry}/20/asc/1.json", headers=auth)
        assert res.status_code == 200, (registry, res.data[:300])
        listed = {j["id"]: j for j in res.json["jobs"]}
        assert set(listed) == {str(escape(i)) for i in want}, registry       # HTML-escaped like every string
        for bad in bad_ids:
            assert "not a valid rq job id" in listed[str(escape(bad))]["description"]
    assert client.get("/rq/0/view/jobs", headers=auth).status_code == 200
