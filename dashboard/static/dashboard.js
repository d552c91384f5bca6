// hsx dashboard: polls /api/status every few seconds and redraws the page (no reload, no CDN).
// Every string from Redis (errors, names) goes in via textContent, never as HTML.
"use strict";
(function () {
  const body = document.body;
  const API = body.dataset.api, RETRY = body.dataset.retry;
  let run = body.dataset.run || new URLSearchParams(location.search).get("run") || "";
  let refreshMs = Math.max(1000, 1000 * parseFloat(body.dataset.refresh || "3"));
  const $ = (id) => document.getElementById(id);

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v; else if (k.startsWith("data-")) node.setAttribute(k, v); else node[k] = v;
    }
    for (const c of children) node.append(c instanceof Node ? c : String(c ?? ""));
    return node;
  }
  const fmtInt = (n) => (n ?? 0).toLocaleString("en-US");
  const fmtNum = (n, d = 1) => (n == null ? "-" : Number(n).toLocaleString("en-US", {maximumFractionDigits: d, minimumFractionDigits: d}));
  function fmtBytes(n) {
    if (n == null) return "-";
    const units = ["B", "KB", "MB", "GB", "TB", "PB"]; let i = 0;
    while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
    return (i ? n.toFixed(1) : n.toFixed(0)) + " " + units[i];
  }
  function fmtDuration(s) {
    if (s == null) return "unknown";
    s = Math.round(s); const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
    return h ? `${h}h${String(m).padStart(2, "0")}m` : `${m}m${String(sec).padStart(2, "0")}s`;
  }
  const pct = (done, total) => (total ? Math.min(100, (100 * done) / total) : 0);
  function bar(done, total, cls) {
    const b = el("div", {class: "bar " + (cls || "")}, el("span"));
    b.firstChild.style.width = pct(done, total).toFixed(2) + "%";
    return b;
  }
  function fill(tbody, rows, emptyText, cols) {
    tbody.replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", {class: "muted", colSpan: cols}, emptyText))]));
  }

  const BARS = [["samples", "samples"], ["tokens", "tokens"], ["batches_extracted", "batches extracted"],
                ["batches_uploaded", "batches uploaded + verified"]];

  function renderProgress(o) {
    $("bars").replaceChildren(...BARS.map(([key, label]) => {
      const p = o.progress[key];
      return el("div", {class: "bar-row", id: "bar-" + key, "data-done": p.done, "data-total": p.total},
        el("span", {}, label), bar(p.done, p.total, key === "batches_uploaded" ? "uploaded" : ""),
        el("span", {class: "num"}, `${fmtInt(p.done)} / ${fmtInt(p.total)} (${pct(p.done, p.total).toFixed(1)}%)`));
    }));
    const r = o.rate;
    $("rate-samples").textContent = `${fmtNum(r.samples_per_s)} samples/s`;
    $("rate-tokens").textContent = `${fmtNum(r.tokens_per_s, 0)} tokens/s (last ${fmtDuration(r.window_seconds)})`;
    $("rate-extract").textContent = `${fmtNum(r.extract_tokens_per_s, 0)} tokens/s`;
    $("eta").textContent = o.complete ? "done" : o.planning ? "unknown until the plan is whole" : fmtDuration(o.eta_seconds);
    $("uploaded-bytes").textContent = fmtBytes(o.uploaded_bytes);
    $("bytes-per-token").textContent = o.bytes_per_token == null ? "-" : `${fmtNum(o.bytes_per_token, 0)} B/token`;
    $("storage").textContent = `${o.store_dtype || "-"}, codec ${o.codec || "none"}` +
      (o.compute_dtype && o.compute_dtype !== "bfloat16" ? `, computed in ${o.compute_dtype}` : "") +
      `; ${fmtBytes(o.written_bytes || 0)} written`;
    $("prefix-tokens").textContent = o.prefix ? `${fmtInt(o.prefix.stored_tokens)} / ${fmtInt(o.prefix.computed_tokens)}` +
      ` tokens (shared prefixes ${o.prefix.reuse})` : "-";
    $("extract-queue").textContent = fmtInt(o.extract_queue);
    $("failure-count").textContent = `${o.dead_letters.length} dead, ${o.retrying} retrying`;
    const badge = $("run-state");
    const lost = o.workers.some((w) => w.state === "lost");
    badge.textContent = o.complete ? "complete" + (o.index_written ? ", index written" : "") :
      (lost ? "running, lost worker" : "running") + (o.planning ? ", plan unfinished" : "");
    badge.className = "badge " + (o.complete ? "complete" : lost ? "stalled" : "running");
  }

  function renderChart(s) {
    const svg = $("chart"), W = 900, H = 220, pad = 28;
    const n = s.extracted_tokens_per_s.length;
    const peak = Math.max(1, ...s.extracted_tokens_per_s, ...s.uploaded_tokens_per_s);
    const ns = "http://www.w3.org/2000/svg";
    const mk = (tag, attrs) => { const e = document.createElementNS(ns, tag); for (const k in attrs) e.setAttribute(k, attrs[k]); return e; };
    const x = (i) => pad + (n > 1 ? (i * (W - 2 * pad)) / (n - 1) : 0);
    const y = (v) => H - pad - (v / peak) * (H - 2 * pad);
    const kids = [];
    for (const f of [0, 0.5, 1]) {
      kids.push(mk("line", {x1: pad, x2: W - pad, y1: y(peak * f), y2: y(peak * f)}));
      const t = mk("text", {x: 2, y: y(peak * f) - 2}); t.textContent = fmtNum(peak * f, 0); kids.push(t);
    }
    // Uploaded is drawn dashed on top: where upload keeps up, both lines stay visible.
    for (const [name, values] of [["extracted", s.extracted_tokens_per_s], ["uploaded", s.uploaded_tokens_per_s]]) {
      kids.push(mk("polyline", {class: name, points: values.map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" ")}));
    }
    svg.replaceChildren(...kids);
    const minutes = (s.end - s.start) / 60;
    $("chart-axis").replaceChildren(el("span", {}, `-${fmtNum(minutes, 0)} min`),
      el("span", {}, `${s.bucket_seconds} s buckets`), el("span", {}, new Date(s.end * 1000).toLocaleTimeString()));
  }

  function renderWorkers(o) {
    fill($("workers").tBodies[0], o.workers.map((w) => el("tr", {class: w.activity || w.state, "data-worker": w.worker},
      el("td", {}, w.host ?? "-"), el("td", {}, w.gpu ?? (w.device || "-")), el("td", {}, w.gpu_name ?? (w.gpu_note || "-")),
      el("td", {}, w.activity ? `${w.state}, ${w.activity}` : w.state), el("td", {class: "num"}, w.util_pct == null ? "-" : `${w.util_pct}%`),
      el("td", {class: "num"}, w.mem_total_bytes == null ? "-" : `${fmtBytes(w.mem_used_bytes)} / ${fmtBytes(w.mem_total_bytes)}`),
      el("td", {class: "num"}, w.temp_c == null ? "-" : `${w.temp_c} °C`),
      el("td", {class: "num"}, w.power_w == null ? "-" : `${fmtNum(w.power_w, 0)} W`),
      el("td", {}, w.current_batch ?? (w.last_batch ? `last ${w.last_batch}` +
        ((w.reclaimed || []).length ? ` (reclaimed: ${w.reclaimed.join(", ")})` : "") : "-")),
      el("td", {class: "num"}, `${fmtNum(w.heartbeat_age_seconds, 0)} s ago`),
      el("td", {class: "num"}, fmtInt(w.batches)), el("td", {class: "num"}, fmtNum(w.tokens_per_s, 0)))),
      "no GPU worker has reported yet", 12);
  }

  function renderHosts(o) {
    fill($("hosts").tBodies[0], o.hosts.map((h) => {
      const fill = h.spool_fill == null ? 0 : 100 * h.spool_fill;
      return el("tr", {"data-host": h.host}, el("td", {}, h.host),
        el("td", {}, `${fmtBytes(h.spool_bytes)} / ${fmtBytes(h.spool_budget_bytes)}`,
           bar(fill, 100, "small" + (fill > 90 ? " bad" : fill > 70 ? " warn" : ""))),
        el("td", {class: "num"}, fmtInt(h.spool_files)), el("td", {class: "num"}, fmtInt(h.upload_queue)),
        el("td", {class: "num"}, fmtInt(h.uploaders)),
        el("td", {class: "num"}, `${fmtBytes(h.upload_bytes_per_s)}/s, ${fmtNum(h.upload_tokens_per_s, 0)} tokens/s`),
        el("td", {class: "num"}, `${fmtNum(h.reported_age_seconds, 0)} s ago`));
    }), "no host has reported a spool yet", 7);
  }

  function renderShards(o) {
    fill($("shards").tBodies[0], o.shards.map((s) => el("tr", {"data-shard": s.shard}, el("td", {}, s.shard),
      el("td", {class: "num"}, `${fmtInt(s.done)} / ${fmtInt(s.total)}`), el("td", {}, bar(s.done, s.total, "uploaded small")))),
      "no plan yet", 3);
  }

  function renderSources(o) {
    const sources = o.sources || [];
    $("sources-section").hidden = sources.length === 0;
    fill($("sources").tBodies[0], sources.map((s) => el("tr", {"data-source": s.source}, el("td", {}, s.source),
      el("td", {class: "num"}, fmtInt(s.rows)), el("td", {class: "num"}, fmtInt(s.rejected)),
      el("td", {class: "num"}, `${fmtInt(s.done.samples)} / ${fmtInt(s.samples)}`),
      el("td", {class: "num"}, `${fmtInt(s.done.tokens)} / ${fmtInt(s.tokens)}`),
      el("td", {class: "num"}, fmtInt(s.computed_tokens)),
      el("td", {}, bar(s.done.samples, s.samples, "uploaded small")))), "one dataset", 7);
  }

  async function retry(batchIds) {
    const res = await fetch(RETRY, {method: "POST", headers: {"Content-Type": "application/json"}, credentials: "same-origin",
                                    body: JSON.stringify({run, batch_ids: batchIds})});
    if (!res.ok) { showError(`retry failed: HTTP ${res.status}`); return; }
    refresh();
  }

  function renderFailures(o) {
    fill($("dead").tBodies[0], o.dead_letters.map((d) => {
      const btn = el("button", {type: "button"}, "retry"); btn.onclick = () => retry([d.batch_id]);
      return el("tr", {"data-batch": d.batch_id}, el("td", {}, d.batch_id), el("td", {class: "num"}, d.attempts),
                el("td", {class: "err"}, d.last_error), el("td", {}, btn));
    }), "none", 4);
    $("retry-all").hidden = !o.dead_letters.length;
    fill($("errors").tBodies[0], o.recent_errors.map((e) => el("tr", {},
      el("td", {}, e.ts ? new Date(e.ts * 1000).toLocaleTimeString() : "-"), el("td", {}, e.batch_id + (e.dead ? " (dead)" : e.resolved ? " (done since)" : "")),
      el("td", {class: "num"}, e.attempts), el("td", {class: "err"}, e.last_error))), "none", 4);
  }

  // FP8's measured error per stored layer: compute (one batch, once per run) next to storage (sampled batches).
  function renderFidelity(o) {
    const f = o.fidelity;
    $("fidelity").hidden = !f;
    if (!f) return;
    const cell = (rec, layer, rel, cos) => {
      const i = rec ? rec.layer_ids.indexOf(layer) : -1;
      return el("td", {class: "num"}, i < 0 ? "-" : `${Number(rec[rel][i]).toFixed(4)} / ${Number(rec[cos][i]).toFixed(5)}`);
    };
    fill($("fidelity-layers").tBodies[0], f.layer_ids.map((layer) => el("tr", {"data-layer": String(layer)},
      el("td", {}, String(layer)), cell(f.compute, layer, "rel_l2", "cosine"),
      cell(f.store, layer, "rel_l2_mean", "cosine_mean"), cell(f.store, layer, "rel_l2_max", "cosine_min"))),
      "not measured yet", 4);
    const notes = [];
    if (f.compute) notes.push(`compute: batch ${f.compute.batch_id} (${fmtInt(f.compute.tokens)} tokens, once per run), against ${f.compute.reference}`);
    if (f.store) notes.push(`storage: ${fmtInt(f.store.batches_measured)} batches (${fmtInt(f.store.tokens_measured)} tokens)`);
    $("fidelity-note").textContent = notes.join(" · ");
  }

  function renderRuns(runs) {
    const sel = $("run-select");
    if (sel.options.length === runs.length && [...sel.options].every((o, i) => o.value === runs[i])) { sel.value = run; return; }
    sel.replaceChildren(...runs.map((r) => el("option", {value: r}, r)));
    sel.value = run;
  }

  function renderMalformed(lines) {
    const e = $("malformed");
    e.hidden = !lines.length;
    e.textContent = lines.length ? `${lines.length} malformed records in Redis skipped: ${lines.slice(0, 5).join("; ")}` : "";
  }

  // Why the run needs a person: the stall reason, a store that refuses uploads, uploaders that put jobs back.
  function renderProblems(o) {
    const lines = [];
    if (o.planning) lines.push(o.planning.line);
    if (o.stalled) lines.push(`STALLED: ${o.stalled}`);
    if (o.store_refusal) lines.push(`the store refuses uploads (batch ${o.store_refusal.batch}): ${o.store_refusal.error}`);
    for (const [host, rec] of Object.entries(o.upload_refused || {})) {
      lines.push(`uploads refused on host ${host} (${rec.jobs || 0} jobs put back): ${rec.message || rec.cause}`);
    }
    const e = $("problems");
    e.hidden = !lines.length;
    e.textContent = lines.join(" · ");
  }

  function showError(text) { const e = $("error"); e.textContent = text; e.hidden = !text; }

  let timer = null;
  async function refresh() {
    clearTimeout(timer);
    try {
      const res = await fetch(API + (run ? "?run=" + encodeURIComponent(run) : ""), {credentials: "same-origin", cache: "no-store"});
      if (!res.ok) {
        // 503 while Redis is down: {"error": "Redis unreachable since ..."}; show that line as it is.
        const body = await res.json().catch(() => null);
        if (body && body.error) { showError(body.error); timer = setTimeout(refresh, refreshMs); return; }
        throw new Error(`HTTP ${res.status} from ${API}`);
      }
      const data = await res.json();
      const o = data.overview;
      $("empty").hidden = !!o;
      if (o) {
        run = o.run;
        renderRuns(data.runs); renderProgress(o); renderChart(o.series); renderWorkers(o); renderHosts(o);
        renderShards(o); renderSources(o); renderFailures(o); renderMalformed(o.malformed || []); renderProblems(o);
        renderFidelity(o);
      }
      $("updated").textContent = `updated ${new Date().toLocaleTimeString()} · Redis ${data.redis}`;
      refreshMs = Math.max(1000, 1000 * data.refresh_seconds);
      showError("");
    } catch (err) {
      showError(`cannot reach the dashboard API: ${err.message}`);
    }
    timer = setTimeout(refresh, refreshMs);
  }

  $("run-select").onchange = (ev) => {
    run = ev.target.value;
    history.replaceState(null, "", "?run=" + encodeURIComponent(run));
    refresh();
  };
  $("retry-all").onclick = () => retry(null);
  refresh();
})();
