// The batchgen dashboard: polls /api/overview, draws the tables and the tok/s chart.
"use strict";

const REFRESH_MS = Number(document.body.dataset.refreshMs) || 2000;
const COLORS = ["#2f6fdb", "#2e9d5b", "#c98a12", "#8a4fd1", "#cc3d3d", "#168a95"];
let selected = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function fmtDuration(s) {
  if (s === null || s === undefined) return "–";
  s = Math.round(s);
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
  return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m";
}

function fmtTime(t) {
  return t ? new Date(t * 1000).toLocaleTimeString() : "–";
}

function share(rows, total) {
  return total ? 100 * rows / total : 0;
}

function setBar(bar, job) {
  // done rows fill the bar; failed and cancelled ones are segments of their own after
  // them: a job cancelled whole is an orange bar at 0%, never a full one
  const pct = Math.floor(share(job.done, job.total));
  bar.className = "bar " + job.state;
  bar.dataset.pct = String(pct);
  bar.title = `done ${job.done}, failed ${job.failed}, cancelled ${job.cancelled} of ${job.total}`;
  let left = 0;
  [job.done, job.failed, job.cancelled].forEach((rows, i) => {
    const width = share(rows, job.total);
    bar.children[i].style.left = left + "%";
    bar.children[i].style.width = (i ? width : pct) + "%";
    left += width;
  });
  bar.lastChild.textContent = pct + "%";
}

const JOB_CELLS = [
  (j) => j.job_id, (j) => shortModel(j.model), (j) => j.state, null, (j) => j.done,
  (j) => j.failed, (j) => j.cancelled, (j) => j.total, (j) => j.tokens_per_s.toFixed(1),
  (j) => j.unserved ? "no worker" : j.refused_now ? "refused" : fmtDuration(j.eta_s),
  (j) => fmtTime(j.created_at)];
const JOB_CLASSES = ["", "", "state", "progress", "num", "num", "num", "num", "num", "num", ""];

function jobRow(jobId) {
  // made once per job and then updated in place: a row replaced between a press and its
  // release would swallow the click
  const row = el("tr", {class: "job", "data-job": jobId},
    ...JOB_CLASSES.map((c) => el("td", {class: c})));
  row.children[3].append(el("div", {class: "bar"}, el("span", {class: "done"}),
    el("span", {class: "failed"}), el("span", {class: "cancelled"}), el("em")));
  row.addEventListener("click", () => { selected = jobId; refresh(); });
  return row;
}

function renderJobs(jobs) {
  const body = document.querySelector("#jobs tbody");
  const old = new Map([...body.children].map((r) => [r.dataset.job, r]));
  const rows = jobs.map((j) => {
    const row = old.get(j.job_id) || jobRow(j.job_id);
    row.classList.toggle("selected", j.job_id === selected);
    JOB_CELLS.forEach((cell, i) => {
      if (!cell) return;
      const td = row.children[i], value = String(cell(j));
      if (td.textContent !== value) td.textContent = value;
    });
    row.children[1].title = j.model;
    row.children[2].className = "state " + j.state;
    setBar(row.children[3].firstChild, j);
    return row;
  });
  rows.forEach((row, i) => { if (body.children[i] !== row) body.insertBefore(row, body.children[i] || null); });
  while (body.children.length > rows.length) body.lastChild.remove();
  document.getElementById("no-jobs").hidden = jobs.length > 0;
}

function shortModel(model) {
  const parts = String(model || "").split("/");
  return parts.length > 2 ? "…/" + parts.slice(-2).join("/") : model;
}

function renderWorkers(workers, now) {
  const body = document.querySelector("#workers tbody");
  body.replaceChildren(...workers.map((w) => el("tr", {"data-worker": w.name},
    el("td", {}, w.host || "?"), el("td", {}, w.name), el("td", {title: w.model}, shortModel(w.model)),
    el("td", {}, w.device || "?"), el("td", {class: "num"}, w.in_flight),
    el("td", {class: "num"}, Number(w.tokens_per_s || 0).toFixed(1)),
    el("td", {}, w.last_heartbeat ? fmtDuration(now - w.last_heartbeat) + " ago" : "–"))));
  document.getElementById("no-workers").hidden = workers.length > 0;
}

function renderTenants(tenants) {
  const limit = (held, max) => max === null ? `${held}` : `${held} / ${max}`;
  const body = document.querySelector("#tenants tbody");
  body.replaceChildren(...tenants.map((t) => el("tr", {"data-tenant": t.tenant},
    el("td", {}, t.tenant || "(none)"), el("td", {class: "num"}, t.weight),
    el("td", {class: "num"}, limit(t.jobs, t.max_jobs)),
    el("td", {class: "num"}, limit(t.enqueued_tokens, t.max_enqueued_tokens)),
    el("td", {class: "num"}, t.usage.input_tokens),
    el("td", {class: "num"}, t.usage.cached_input_tokens),
    el("td", {class: "num"}, t.usage.output_tokens),
    el("td", {class: "num"}, Number(t.usage.engine_s).toFixed(1)))));
  document.getElementById("no-tenants").hidden = tenants.length > 0;
}

function renderChart(series, jobs, now) {
  const canvas = document.getElementById("chart");
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = 200;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  ctx.clearRect(0, 0, width, height);
  const pad = {l: 48, r: 10, t: 10, b: 22};
  // the last hour at most, the last five minutes at least: a short run is not a spike
  const span = Math.min(3600, Math.max(300, series.length ? now - series[0].t : 0));
  const t0 = now - span;
  const top = jobs.filter((j) => series.some((p) => p.jobs[j.job_id]))
                  .slice(0, COLORS.length - 1);
  const lines = [{name: "fleet", color: COLORS[0], value: (p) => p.fleet}].concat(
    top.map((j, i) => ({name: j.job_id, color: COLORS[i + 1], value: (p) => p.jobs[j.job_id] || 0})));
  const ymax = Math.max(1, ...series.map((p) => p.fleet)) * 1.1;
  const x = (t) => pad.l + (width - pad.l - pad.r) * (t - t0) / span;
  const y = (v) => height - pad.b - (height - pad.t - pad.b) * v / ymax;
  ctx.strokeStyle = "#e3e6ec"; ctx.fillStyle = "#6b7385"; ctx.font = "11px system-ui, sans-serif";
  ctx.lineWidth = 1;
  for (let k = 0; k <= 4; k++) {
    const v = ymax * k / 4;
    ctx.beginPath(); ctx.moveTo(pad.l, y(v)); ctx.lineTo(width - pad.r, y(v)); ctx.stroke();
    ctx.fillText(v.toFixed(v < 10 ? 1 : 0), 4, y(v) + 4);
  }
  for (let k = 4; k >= 0; k--) {
    const ago = span * k / 4;
    const label = k ? "-" + (ago >= 60 ? Math.round(ago / 60) + "m" : Math.round(ago) + "s") : "now";
    ctx.fillText(label, x(now - ago) - (k ? 10 : 24), height - 6);
  }
  // runs of samples without a gap (the server was down, say): no line bridges a gap
  const steps = series.slice(1).map((p, i) => p.t - series[i].t).sort((a, b) => a - b);
  const gap = Math.max(15, 4 * (steps[Math.floor(steps.length / 2)] || 0));
  const runs = [];
  series.forEach((p, i) => {
    if (!i || p.t - series[i - 1].t > gap) runs.push([]);
    runs[runs.length - 1].push(p);
  });
  ctx.fillStyle = "rgba(47, 111, 219, 0.15)";
  for (const run of runs) {  // the fleet as a shaded area, each job a dashed line over it
    ctx.beginPath();
    ctx.moveTo(x(run[0].t), y(0));
    for (const p of run) ctx.lineTo(x(p.t), y(p.fleet));
    ctx.lineTo(x(run[run.length - 1].t), y(0));
    ctx.closePath();
    ctx.fill();
  }
  for (const line of lines) {
    ctx.strokeStyle = line.color; ctx.lineWidth = line.name === "fleet" ? 2.5 : 1.5;
    ctx.setLineDash(line.name === "fleet" ? [] : [5, 3]);
    for (const run of runs) {
      ctx.beginPath();
      run.forEach((p, i) => { const f = i ? "lineTo" : "moveTo"; ctx[f](x(p.t), y(line.value(p))); });
      ctx.stroke();
    }
  }
  ctx.setLineDash([]);
  document.getElementById("legend").replaceChildren(...lines.map((l) =>
    el("span", {}, Object.assign(el("i"), {style: "background:" + l.color}), l.name)));
}

async function getJSON(url, options) {
  const response = await fetch(url, Object.assign({credentials: "same-origin"}, options));
  if (response.status === 401) { window.location.reload(); throw new Error("signed out"); }
  const data = await response.json();
  if (!response.ok) throw new Error((data.error && data.error.message) || response.statusText);
  return data;
}

async function renderDetail() {
  const box = document.getElementById("detail");
  if (!selected) { box.hidden = true; return; }
  const d = await getJSON("/api/jobs/" + encodeURIComponent(selected));
  const fields = [["state", d.state], ["model", d.model], ["done / failed / cancelled / total",
    `${d.done} / ${d.failed} / ${d.cancelled} / ${d.total}`], ["in flight", d.in_flight],
    ["queued", d.queued],
    ["prompt tokens", d.prompt_tokens], ["completion tokens", d.completion_tokens],
    ["cached tokens", d.cached_tokens], ["tok/s", d.tokens_per_s],
    ["ETA", d.unserved ? "– (no live worker serves the model)"
      : d.refused_now ? "– (refused by the live workers: see refused)" : fmtDuration(d.eta_s)],
    ["output", d.output], ["started", fmtTime(d.started_at)], ["finished", fmtTime(d.finished_at)],
    ["error", d.error || d.storage_error || "–"]];
  if (d.refused) fields.push(["refused", d.refused]);  // a worker holding other weights
  const dl = el("dl");
  for (const [k, v] of fields) dl.append(el("dt", {}, k), el("dd", {}, v === null ? "–" : v));
  const parts = [el("h2", {}, "Job " + d.job_id), dl];
  if (d.errors.length) {
    parts.push(el("h2", {}, "Failed requests"), el("ul", {class: "reasons"},
      ...d.errors.map((e) => el("li", {}, `#${e.index}${e.id ? " (" + e.id + ")" : ""}: ${e.error}`))));
  }
  if (d.dead_letters.length) {
    parts.push(el("h2", {}, "Dead letters"), el("ul", {class: "reasons"},
      ...d.dead_letters.map((e) => el("li", {}, `#${e.index} after ${e.deliveries} deliveries: ${e.reason}`))));
  }
  if (d.state === "queued" || d.state === "running") {
    const button = el("button", {class: "danger", type: "button"}, "Cancel job");
    button.addEventListener("click", async () => {
      if (!window.confirm("Cancel job " + d.job_id + "? Finished rows are kept.")) return;
      await getJSON("/api/jobs/" + encodeURIComponent(d.job_id) + "/cancel", {method: "POST"});
      refresh();
    });
    parts.push(button);
  }
  const close = el("button", {type: "button", class: "link"}, "close");
  close.addEventListener("click", () => { selected = null; refresh(); });
  parts.push(" ", close);
  box.replaceChildren(...parts);
  if (box.hidden) {
    box.hidden = false;
    box.scrollIntoView({block: "nearest"});  // below a long table it would open unseen
  }
}

let timer = null;
async function refresh() {
  clearTimeout(timer);
  const status = document.getElementById("updated");
  try {
    const data = await getJSON("/api/overview");
    const running = data.jobs.filter((j) => j.state === "running" || j.state === "queued").length;
    const shown = data.total_jobs > data.jobs.length ? `the newest ${data.jobs.length} of ` : "";
    document.getElementById("summary").textContent =
      `${shown}${data.total_jobs} jobs, ${running} active · ${data.workers.length} live workers`;
    const notice = document.getElementById("notice");
    notice.textContent = data.notice || "";
    notice.hidden = !data.notice;
    const outage = document.getElementById("outage");
    outage.textContent = data.outage || "";
    outage.hidden = !data.outage;
    renderJobs(data.jobs);
    renderWorkers(data.workers, data.now);
    renderTenants(data.tenants);
    renderChart(data.series, data.jobs, data.now);
    await renderDetail();
    status.textContent = "updated " + new Date().toLocaleTimeString();
  } catch (err) {
    status.textContent = "refresh failed: " + err.message;
  }
  timer = setTimeout(refresh, REFRESH_MS);
}

refresh();
