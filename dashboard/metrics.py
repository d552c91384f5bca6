"""GET /metrics: every run's overview in the Prometheus text format (prometheus-client).

Names follow Prometheus conventions: base units (seconds, bytes, ratios 0-1),
``_total`` on counters, labels for run / shard / worker / host. Counters are
the ledger's monotonic counts; a worker's ``batches`` counter restarts with
its process, which Prometheus' rate() handles.
"""

from __future__ import annotations

from flask import Blueprint, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dashboard import state
from dashboard.overview import build_overview
from hsx import life

bp = Blueprint("metrics", __name__)


class OverviewCollector:
    """Turns overviews (dashboard.overview.build_overview) into metric families."""

    def __init__(self, overviews: list[dict]):
        self.overviews = overviews

    def collect(self):
        def gauge(name, doc, labels=("run",)):
            return GaugeMetricFamily(name, doc, labels=list(labels))

        def counter(name, doc, labels=("run",)):
            return CounterMetricFamily(name, doc, labels=list(labels))

        planned = {k: gauge(f"hsx_planned_{k}", f"{k} in the run's plan") for k in ("batches", "samples", "tokens")}
        computed = gauge("hsx_planned_computed_tokens", "tokens the GPU computes for the run's plan (padding in, each "
                         "shared prefix once); against hsx_planned_tokens, those stored")
        done = {k: counter(f"hsx_uploaded_{k}", f"{k} verified in the store and recorded done")
                for k in ("batches", "samples", "tokens", "bytes")}
        extracted = counter("hsx_extracted_batches", "batches that reached a spool at least once")
        written = counter("hsx_written_bytes", "bytes of batch files written to spools (rewrites included)")
        per_token = gauge("hsx_bytes_per_token", "stored bytes per real token of the batches done (absent until one is)")
        rate = {k: gauge(f"hsx_upload_{k}_per_second", f"{k} recorded done a second, averaged over the rate window")
                for k in ("batches", "samples", "tokens")}
        extract_rate = gauge("hsx_extract_tokens_per_second", "tokens extracted a second, averaged over the rate window")
        eta = gauge("hsx_eta_seconds", "seconds to finish at the current upload rate (absent when unknown)")
        complete = gauge("hsx_run_complete", "1 once every planned batch is done")
        queue = gauge("hsx_extract_queue_jobs", "extract jobs waiting in the run's queue")
        dead = gauge("hsx_dead_letter_batches", "batches in dead letters (need a retry)")
        retrying = gauge("hsx_retrying_batches", "batches that failed and are being retried")
        malformed = gauge("hsx_malformed_records", "records of the run in Redis that hsx skipped as malformed")
        refusing = gauge("hsx_store_refusing", "1 while the store refuses uploads for good (403, no bucket, metadata "
                         "dropped; the message is in /api/status store_refusal)")
        shard_planned = gauge("hsx_shard_planned_batches", "planned batches of a shard", ("run", "shard"))
        shard_done = gauge("hsx_shard_uploaded_batches", "done batches of a shard", ("run", "shard"))
        wl = ("run", "worker", "host", "gpu")
        w_up = gauge("hsx_worker_up", "1 while the worker's heartbeat is fresh", wl)
        w_age = gauge("hsx_worker_heartbeat_age_seconds", "seconds since the worker's last heartbeat", wl)
        w_batches = counter("hsx_worker_batches", "batches this worker process extracted", wl)
        w_busy = gauge("hsx_worker_busy", "1 while the worker holds a batch", wl)
        gpu = {"util_pct": gauge("hsx_gpu_utilization_ratio", "GPU utilisation, 0-1", wl),
               "mem_used_bytes": gauge("hsx_gpu_memory_used_bytes", "GPU memory used", wl),
               "mem_total_bytes": gauge("hsx_gpu_memory_total_bytes", "GPU memory total", wl),
               "temp_c": gauge("hsx_gpu_temperature_celsius", "GPU temperature", wl),
               "power_w": gauge("hsx_gpu_power_watts", "GPU power draw", wl)}
        hl = ("run", "host")
        host = {"spool_bytes": gauge("hsx_spool_bytes", "bytes of finished batch files in the host's spool", hl),
                "spool_files": gauge("hsx_spool_files", "finished batch files in the host's spool", hl),
                "spool_budget_bytes": gauge("hsx_spool_budget_bytes", "the host's spool byte budget", hl),
                "upload_queue": gauge("hsx_upload_queue_jobs", "upload jobs waiting on upload@host", hl),
                "uploaders": gauge("hsx_uploaders", "uploader processes serving upload@host", hl),
                "upload_bytes_per_second": gauge("hsx_host_upload_bytes_per_second",
                                                 "bytes a second the host's uploaders finished", hl)}
        for o in self.overviews:
            run, p = o["run"], o["progress"]
            planned["batches"].add_metric([run], p["batches_uploaded"]["total"])
            planned["samples"].add_metric([run], p["samples"]["total"])
            planned["tokens"].add_metric([run], p["tokens"]["total"])
            computed.add_metric([run], o["prefix"]["computed_tokens"])
            done["batches"].add_metric([run], p["batches_uploaded"]["done"])
            done["samples"].add_metric([run], p["samples"]["done"])
            done["tokens"].add_metric([run], p["tokens"]["done"])
            done["bytes"].add_metric([run], o["uploaded_bytes"])
            extracted.add_metric([run], p["batches_extracted"]["done"])
            written.add_metric([run], o["written_bytes"])
            if o["bytes_per_token"] is not None:
                per_token.add_metric([run], o["bytes_per_token"])
            for k in ("batches", "samples", "tokens"):
                rate[k].add_metric([run], o["rate"][f"{k}_per_s"])
            extract_rate.add_metric([run], o["rate"]["extract_tokens_per_s"])
            if o["eta_seconds"] is not None:
                eta.add_metric([run], o["eta_seconds"])
            complete.add_metric([run], 1 if o["complete"] else 0)
            queue.add_metric([run], o["extract_queue"])
            dead.add_metric([run], len(o["dead_letters"]))
            retrying.add_metric([run], o["retrying"])
            malformed.add_metric([run], len(o["malformed"]))
            refusing.add_metric([run], 1 if o.get("store_refusal") else 0)
            for s in o["shards"]:
                shard_planned.add_metric([run, s["shard"]], s["total"])
                shard_done.add_metric([run, s["shard"]], s["done"])
            for w in o["workers"]:
                labels = [run, w["worker"], w["host"] or "", "" if w["gpu"] is None else str(w["gpu"])]
                w_up.add_metric(labels, 1 if w["state"] == "alive" else 0)
                w_age.add_metric(labels, w["heartbeat_age_seconds"])
                w_batches.add_metric(labels, w["batches"])
                w_busy.add_metric(labels, 1 if w["activity"] == "busy" else 0)
                for field, family in gpu.items():
                    if w.get(field) is not None and w["state"] == "alive":
                        family.add_metric(labels, w[field] / 100 if field == "util_pct" else w[field])
            for h in o["hosts"]:
                for field, family in host.items():
                    value = h["upload_bytes_per_s"] if field == "upload_bytes_per_second" else h[field]
                    family.add_metric([run, h["host"]], value)
        yield from planned.values()
        yield computed
        yield from done.values()
        yield from (extracted, written, per_token, *rate.values(), extract_rate, eta, complete, queue, dead, retrying,
                    malformed, refusing, shard_planned, shard_done, w_up, w_age, w_batches, w_busy, *gpu.values(), *host.values())


@bp.get("/metrics")
def metrics():
    st = state.current()
    overviews = [build_overview(st.redis, run, st.config, st.plans) for run in life.Run.names(st.redis)]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(OverviewCollector(overviews))
    return Response(generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
