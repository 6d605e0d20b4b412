// ClusterPulse status page (served by the orchestrator at GET /; services/routes/status_page.py).
// Every refresh reads /v1/nodes, /v1/jobs, /v1/events and the plan of each running job, once each:
// every REFRESH_MS, and at once when the event stream (GET /v1/stream) says something happened
// (a burst of events while a refresh is in flight makes one more refresh, not one each).
// A 401 shows the sign-in box; the token lives in sessionStorage and goes in a bearer header only.
"use strict";

const TOKEN_KEY = "pulse-token";
const REFRESH_MS = Number(document.body.dataset.refreshMs) || 3000;
const EVENTS_SHOWN = 25;

class NeedToken extends Error {}

function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

async function get(path) {
  const t = token();
  const r = await fetch(path, { headers: t ? { Authorization: "Bearer " + t } : {}, cache: "no-store" });
  if (r.status === 401) throw new NeedToken(t ? "the token was refused" : "reads need a token");
  if (!r.ok) {
    const body = await r.json().catch(() => ({}));
    const err = new Error(`GET ${path}: ${r.status} ${body.detail || r.statusText}`);
    err.status = r.status;
    throw err;
  }
  return r.json();
}

// el("div", {class: "x"}, child, "text", ...): text is never parsed as HTML.
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== undefined && v !== null) e.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c !== undefined && c !== null) e.append(c instanceof Node ? c : String(c));
  }
  return e;
}

function fmt(x, digits) {
  return x === undefined || x === null ? "-" : Number(x).toFixed(digits);
}

function hardware(n) {
  const gpus = n.gpus.filter((g) => !g.lost);
  const temps = gpus.map((g) => g.temperature_celsius).filter((x) => x !== null && x !== undefined);
  const watts = gpus.map((g) => g.power_watts).filter((x) => x !== null && x !== undefined);
  const lost = n.gpus.length - gpus.length;
  const narrow = gpus.filter((g) => g.pcie_link_width && g.pcie_link_width_max && g.pcie_link_width < g.pcie_link_width_max);
  const widths = gpus.map((g) => g.pcie_link_width).filter((x) => x);
  const parts = [];
  parts.push(`${n.gpus.length} GPU${n.gpus.length === 1 ? "" : "s"}` + (lost ? ` (${lost} lost)` : ""));
  if (temps.length) parts.push(`max ${fmt(Math.max(...temps), 0)} °C`);
  if (watts.length) parts.push(`${fmt(Math.min(...watts), 0)}–${fmt(Math.max(...watts), 0)} W`);
  const psus = n.psus.map((p) => `${p.name} ${fmt(p.output_current_amperes ?? p.input_current_amperes, 1)} A`);
  if (psus.length) parts.push(psus.join(" / "));
  if (narrow.length) parts.push(`PCIe ${narrow.map((g) => `GPU ${g.index} x${g.pcie_link_width}/x${g.pcie_link_width_max}`).join(", ")}`);
  else if (widths.length) parts.push(`PCIe x${Math.min(...widths)}`);
  return parts;
}

function nodeCard(n) {
  return el(
    "div",
    { class: `node state-${n.state}`, "data-node": n.name, "data-state": n.state, title: n.reason },
    el("div", { class: "node-head" }, el("span", { class: "node-name" }, n.name), el("span", { class: "node-state" }, n.state)),
    el("div", { class: "node-reason" }, n.reason || ""),
    el("div", { class: "node-hw" }, hardware(n).map((p) => el("span", {}, p))),
    n.schedulable ? null : el("div", { class: "node-sched" }, n.scheduler && !n.scheduler.available ? "not schedulable (Slurm)" : "cordoned"),
  );
}

function renderNodes(nodes) {
  // rack -> NVLink domain -> nodes, each level sorted by name
  const racks = new Map();
  for (const n of nodes) {
    const rack = n.labels.rack || "no rack label";
    const dom = n.labels.nvlink_domain || "no NVLink domain label";
    if (!racks.has(rack)) racks.set(rack, new Map());
    const doms = racks.get(rack);
    if (!doms.has(dom)) doms.set(dom, []);
    doms.get(dom).push(n);
  }
  const out = [];
  for (const rack of [...racks.keys()].sort()) {
    const doms = racks.get(rack);
    const groups = [...doms.keys()].sort().map((d) =>
      el("div", { class: "domain", "data-domain": d }, el("div", { class: "domain-name" }, d), doms.get(d).sort((a, b) => a.name.localeCompare(b.name)).map(nodeCard)),
    );
    out.push(el("div", { class: "rack", "data-rack": rack }, el("h3", {}, rack), el("div", { class: "domains" }, groups)));
  }
  document.getElementById("nodes").replaceChildren(...(out.length ? out : [el("p", {}, "no nodes yet")]));
  const counts = {};
  for (const n of nodes) counts[n.state] = (counts[n.state] || 0) + 1;
  document.getElementById("cluster-summary").replaceChildren(
    `${nodes.length} node${nodes.length === 1 ? "" : "s"}: `,
    ...Object.keys(counts).sort().map((s) => el("span", { class: `count state-${s}` }, `${counts[s]} ${s}`)),
  );
}

function planText(plan, job) {
  if (!plan) return "no plan yet";
  if (plan.error) return plan.error;
  const who = (r) => `rank ${r} (${plan.ranks[String(r)] || "?"})`;
  const parts = [`generation ${plan.generation}`];
  const carried = Object.entries(plan.proxies).map(([d, c]) => `${who(c)} carries ${who(d)}`);
  parts.push(carried.length ? carried.join("; ") : "nobody carried");
  parts.push(plan.excluded.length ? `excluded: ${plan.excluded.map(who).join(", ")}` : "nobody excluded");
  if (plan.refused) parts.push(`refused: ${plan.refused}`);
  return parts.join(" · ");
}

function renderJobs(jobs, plans) {
  const running = jobs.filter((j) => !["SUCCEEDED", "FAILED", "STOPPED"].includes(j.state));
  if (!running.length) {
    document.getElementById("jobs").replaceChildren(el("p", {}, "no running jobs"));
    return;
  }
  const head = el("tr", {}, ["job", "name", "state", "nodes", "step", "loss", "MFU", "plan in force"].map((h) => el("th", {}, h)));
  const rows = running.map((j) => {
    const p = j.progress || {};
    return el(
      "tr",
      { "data-job": j.id },
      el("td", {}, j.id),
      el("td", {}, j.name),
      el("td", { class: `state-${j.state}` }, j.state),
      el("td", {}, j.assigned_nodes.join(", ")),
      el("td", { class: "job-step" }, p.step ?? "-"),
      el("td", {}, fmt(p.loss, 4)),
      el("td", {}, p.mfu_ratio === undefined || p.mfu_ratio === null ? "-" : `${fmt(100 * p.mfu_ratio, 1)} %`),
      el("td", { class: "job-plan" }, planText(plans[j.id], j)),
    );
  });
  document.getElementById("jobs").replaceChildren(el("table", {}, el("thead", {}, head), el("tbody", {}, rows)));
}

function when(at) {
  return new Date(at * 1000).toLocaleTimeString();
}

function renderEvents(events) {
  const rows = events
    .slice()
    .reverse()
    .map((e) =>
      el(
        "tr",
        { "data-event": e.id },
        el("td", {}, when(e.at)),
        el("td", {}, e.kind),
        el("td", {}, e.node || e.job || "-"),
        el("td", { class: e.to_state ? `state-${e.to_state}` : "" }, e.to_state ? `${e.from_state || "-"} → ${e.to_state}` : ""),
        el("td", {}, e.actor),
        el("td", { class: "reason" }, e.reason),
      ),
    );
  document.getElementById("events").replaceChildren(rows.length ? el("table", {}, el("tbody", {}, rows)) : el("p", {}, "no events"));
  const latest = (kind) => events.filter((e) => e.kind === kind).pop();
  const partition = latest("partition");
  const leader = latest("leader");
  const bits = [];
  if (leader) bits.push(el("span", { title: leader.reason }, "leader: " + leader.reason.split(" ")[0]));
  if (partition) bits.push(el("span", { class: "partition" }, "partition: " + partition.reason));
  document.getElementById("control-plane").replaceChildren(...bits);
}

function showSignin(why) {
  document.getElementById("content").hidden = true;
  document.getElementById("signin").hidden = false;
  document.getElementById("signin-why").textContent = `Sign in: ${why} (a viewer token or above).`;
  document.getElementById("sign-out").hidden = true;
}

async function refresh() {
  try {
    const [nodes, jobs, events] = await Promise.all([get("/v1/nodes"), get("/v1/jobs"), get(`/v1/events?limit=${EVENTS_SHOWN}`)]);
    const plans = {};
    await Promise.all(
      jobs.data
        .filter((j) => j.state === "RUNNING")
        .map((j) =>
          get(`/v1/jobs/${encodeURIComponent(j.id)}/plan`)
            .then((p) => (plans[j.id] = p))
            .catch((e) => {
              if (e instanceof NeedToken) throw e;
              plans[j.id] = e.status === 409 ? null : { error: e.message };
            }),
        ),
    );
    renderNodes(nodes.data);
    renderJobs(jobs.data, plans);
    renderEvents(events.data);
    document.getElementById("signin").hidden = true;
    document.getElementById("content").hidden = false;
    document.getElementById("error").hidden = true;
    document.getElementById("sign-out").hidden = !token();
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    if (e instanceof NeedToken) {
      showSignin(e.message);
    } else {
      const err = document.getElementById("error");
      err.textContent = `${e.message} (retrying every ${REFRESH_MS / 1000} s)`;
      err.hidden = false;
    }
  }
}

let timer = null;
let inFlight = false;
let again = false;
function loop() {
  clearTimeout(timer);
  inFlight = true;
  refresh().finally(() => {
    inFlight = false;
    if (again) {
      again = false;
      loop();
    } else {
      timer = setTimeout(loop, REFRESH_MS);
    }
  });
}

function wake() {
  if (inFlight) again = true;
  else loop();
}

// The event stream, read with fetch rather than EventSource: EventSource cannot send the bearer
// header, and the token never goes in a URL. A dropped stream reconnects with Last-Event-ID; a
// refused one (no token yet) ends until the next sign-in.
let streaming = false;
async function follow() {
  if (streaming) return;
  streaming = true;
  let last = null;
  try {
    for (;;) {
      const t = token();
      const headers = t ? { Authorization: "Bearer " + t } : {};
      if (last !== null) headers["Last-Event-ID"] = String(last);
      try {
        const r = await fetch("/v1/stream", { headers, cache: "no-store" });
        if (r.status === 401 || r.status === 403) return;
        if (!r.ok) throw new Error(`GET /v1/stream: ${r.status}`);
        const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += value.replaceAll("\r\n", "\n");
          let end;
          while ((end = buf.indexOf("\n\n")) >= 0) {
            const lines = buf.slice(0, end).split("\n");
            buf = buf.slice(end + 2);
            const id = lines.find((l) => l.startsWith("id:"));
            if (id) last = Number(id.slice(3).trim());
            if (lines.some((l) => l.startsWith("data:"))) wake();
          }
        }
      } catch (e) {
        // dropped or refused for another reason: reconnect after a pause
      }
      await new Promise((done) => setTimeout(done, 1000));
    }
  } finally {
    streaming = false;
  }
}

document.getElementById("signin").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const input = document.getElementById("token");
  sessionStorage.setItem(TOKEN_KEY, input.value.trim());
  input.value = "";
  loop();
  follow();
});
document.getElementById("sign-out").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  loop();
});
loop();
follow();
