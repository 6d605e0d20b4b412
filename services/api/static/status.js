// ClusterPulse status page (served by the orchestrator at GET /; services/api/routes/status_page.py).
// Every refresh reads the nodes' summaries (/v1/nodes?fields=summary, NODES_PAGE a request, each
// page after the last one's `next`), /v1/jobs, /v1/events and the plan of each running job: every
// REFRESH_MS, and at once when the event stream (GET /v1/stream) says something happened (a burst
// of events while a refresh is in flight makes one more refresh, not one each).
// A node's page (#node=<name>, a click on its card) reads /v1/nodes/<name> and that node's events
// instead: its hardware in full, read only there, and its history of transitions.
// A job's step rate and its loss and MFU trends cover the last TREND_S seconds this tab has seen
// (kept in memory: a reload starts them again); until they span RATE_MIN_S the rate is the pace
// of the slowest rank's last step.
// A 401 shows the sign-in box; the token lives in sessionStorage and goes in a bearer header only.
"use strict";

const TOKEN_KEY = "pulse-token";
const REFRESH_MS = Number(document.body.dataset.refreshMs) || 3000;
const NODES_PAGE = Number(document.body.dataset.nodesPage) || 5000;
const EVENTS_SHOWN = 25;
const NODE_EVENTS = 500;
const TREND_S = 300;
const RATE_S = 60;
const RATE_MIN_S = 10; // samples closer together than this say too little: the last step time speaks
const SVG = "http://www.w3.org/2000/svg";

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

// what a card shows of a node: the summary GET /v1/nodes?fields=summary answers
// (services/api/bodies.py), or the same made here of a node in full (its own page)
function summaryOf(n) {
  const gpus = n.gpus.filter((g) => !g.lost);
  const nums = (key) => gpus.map((g) => g[key]).filter((x) => x !== null && x !== undefined);
  const [temps, watts, widths] = [nums("temperature_celsius"), nums("power_watts"), nums("pcie_link_width").filter((x) => x)];
  const narrow = gpus.filter((g) => g.pcie_link_width && g.pcie_link_width_max && g.pcie_link_width < g.pcie_link_width_max);
  return {
    ...n,
    gpu: {
      count: n.gpus.length,
      lost: n.gpus.length - gpus.length,
      temperature_max_celsius: temps.length ? Math.max(...temps) : null,
      power_min_watts: watts.length ? Math.min(...watts) : null,
      power_max_watts: watts.length ? Math.max(...watts) : null,
      pcie_width_min: widths.length ? Math.min(...widths) : null,
      pcie_narrow: narrow.map((g) => [g.index, g.pcie_link_width, g.pcie_link_width_max]),
    },
    psu_amperes: Object.fromEntries(n.psus.map((p) => [p.name, p.output_current_amperes ?? p.input_current_amperes])),
    cordoned: !!(n.schedulable === false && !(n.scheduler && !n.scheduler.available)),
  };
}

function hardware(n) {
  const g = n.gpu;
  const parts = [];
  parts.push(`${g.count} GPU${g.count === 1 ? "" : "s"}` + (g.lost ? ` (${g.lost} lost)` : ""));
  if (g.temperature_max_celsius !== null) parts.push(`max ${fmt(g.temperature_max_celsius, 0)} °C`);
  if (g.power_min_watts !== null) parts.push(`${fmt(g.power_min_watts, 0)}–${fmt(g.power_max_watts, 0)} W`);
  const psus = Object.entries(n.psu_amperes).map(([name, amps]) => `${name} ${fmt(amps, 1)} A`);
  if (psus.length) parts.push(psus.join(" / "));
  const narrow = g.pcie_narrow || [];
  if (narrow.length) parts.push(`PCIe ${narrow.map(([i, w, max]) => `GPU ${i} x${w}/x${max}`).join(", ")}`);
  else if (g.pcie_width_min) parts.push(`PCIe x${g.pcie_width_min}`);
  return parts;
}

function nodeCard(n, hw = hardware(n)) {
  return el(
    "div",
    { class: `node state-${n.state}`, "data-node": n.name, "data-state": n.state, title: n.reason },
    el(
      "div",
      { class: "node-head" },
      el("a", { class: "node-name", href: "#node=" + encodeURIComponent(n.name) }, n.name),
      el("span", { class: "node-state" }, n.state),
    ),
    el("div", { class: "node-reason" }, n.reason || ""),
    el("div", { class: "node-hw" }, hw.map((p) => el("span", {}, p))),
    n.schedulable ? null : el("div", { class: "node-sched" }, n.cordoned ? "cordoned" : "not schedulable (Slurm)"),
  );
}

// every node's summary, NODES_PAGE a request, each page after the last one's `next`
async function summaries() {
  const nodes = [];
  let after = null;
  do {
    const page = await get(`/v1/nodes?fields=summary&limit=${NODES_PAGE}` + (after === null ? "" : `&after=${encodeURIComponent(after)}`));
    nodes.push(...page.data);
    after = page.next;
  } while (after !== null);
  return nodes;
}

// The grid is kept between refreshes: a node's card is made again only when what it shows
// changed, and a domain, a rack or the grid has its children set again only when one of them is
// another element. At 16,384 nodes a refresh changes a fraction of the cards (their figures are
// shown to the degree or watt); making every card again took longer than reading them.
const grid = { cards: new Map(), racks: new Map(), order: [] };

function cardOf(n) {
  const hw = hardware(n);
  const shown = [n.state, n.reason, n.schedulable, n.cordoned, ...hw].join("\u0000");
  const kept = grid.cards.get(n.name);
  if (kept && kept.shown === shown) return kept.el;
  const card = nodeCard(n, hw);
  grid.cards.set(n.name, { shown, el: card });
  return card;
}

// box's children become els unless they already are (the kept list says what they are)
function setChildren(box, kept, els) {
  if (kept.length === els.length && kept.every((e, i) => e === els[i])) return kept;
  box.replaceChildren(...els);
  return els;
}

function renderNodes(nodes) {
  // rack -> NVLink domain -> nodes, racks and domains sorted by name, nodes in the API's name order
  const racks = new Map();
  for (const n of nodes) {
    const rack = n.labels.rack || "no rack label";
    const dom = n.labels.nvlink_domain || "no NVLink domain label";
    if (!racks.has(rack)) racks.set(rack, new Map());
    const doms = racks.get(rack);
    if (!doms.has(dom)) doms.set(dom, []);
    doms.get(dom).push(n);
  }
  const shownRacks = new Map();
  const rackEls = [];
  for (const rack of [...racks.keys()].sort()) {
    const doms = racks.get(rack);
    const r = grid.racks.get(rack) || { domains: new Map(), shown: [] };
    if (!r.el) {
      r.box = el("div", { class: "domains" });
      r.el = el("div", { class: "rack", "data-rack": rack }, el("h3", {}, rack), r.box);
    }
    const shownDoms = new Map();
    const domEls = [];
    for (const dom of [...doms.keys()].sort()) {
      const d = r.domains.get(dom) || { el: el("div", { class: "domain", "data-domain": dom }), head: el("div", { class: "domain-name" }, dom), shown: [] };
      d.shown = setChildren(d.el, d.shown, [d.head, ...doms.get(dom).map(cardOf)]);
      shownDoms.set(dom, d);
      domEls.push(d.el);
    }
    r.domains = shownDoms;
    r.shown = setChildren(r.box, r.shown, domEls);
    shownRacks.set(rack, r);
    rackEls.push(r.el);
  }
  grid.racks = shownRacks;
  grid.order = setChildren(document.getElementById("nodes"), grid.order, rackEls.length ? rackEls : [el("p", {}, "no nodes yet")]);
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

// job id -> [{t, step, loss, mfu}], the samples of the last TREND_S seconds
const trends = new Map();

function sample(jobs) {
  const now = Date.now() / 1000;
  for (const j of jobs) {
    const p = j.progress || {};
    if (p.step === undefined) continue;
    const points = trends.get(j.id) || [];
    points.push({ t: now, step: p.step, loss: p.loss, mfu: p.mfu_ratio });
    trends.set(j.id, points.filter((x) => now - x.t <= TREND_S));
  }
  for (const id of trends.keys()) if (!jobs.some((j) => j.id === id)) trends.delete(id);
}

// steps a second over the last RATE_S seconds seen (when they span RATE_MIN_S at least: a stall
// shows as 0), else 1 / the slowest rank's last step time
function stepRate(j) {
  const points = trends.get(j.id) || [];
  const recent = points.filter((x) => points[points.length - 1].t - x.t <= RATE_S);
  if (recent.length >= 2) {
    const [a, b] = [recent[0], recent[recent.length - 1]];
    if (b.t - a.t >= RATE_MIN_S && b.step >= a.step) return (b.step - a.step) / (b.t - a.t);
  }
  const st = (j.progress || {}).step_time_s;
  return st ? 1 / st : null;
}

// a small line of the last TREND_S seconds of one figure (no axes: its shape, the number beside it)
function spark(points, key) {
  const vals = points.filter((x) => x[key] !== undefined && x[key] !== null);
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", "0 0 80 18");
  svg.setAttribute("data-points", String(vals.length));
  if (vals.length < 2) return svg;
  const lo = Math.min(...vals.map((x) => x[key]));
  const hi = Math.max(...vals.map((x) => x[key]));
  const t0 = vals[0].t;
  const span = Math.max(vals[vals.length - 1].t - t0, 1e-9);
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute(
    "points",
    vals.map((x) => `${((80 * (x.t - t0)) / span).toFixed(1)},${(hi > lo ? 17 - (16 * (x[key] - lo)) / (hi - lo) : 9).toFixed(1)}`).join(" "),
  );
  svg.append(line);
  return svg;
}

// the step's verdict over the last window: its kind and the rank or node that stands out
function bottleneckText(b) {
  if (!b) return "-";
  const where = b.rank !== null && b.rank !== undefined ? ` (rank ${b.rank} on ${b.node})` : b.node ? ` (${b.node})` : "";
  return `${b.kind}${where}`;
}

function renderJobs(jobs, plans) {
  sample(jobs);
  const running = jobs.filter((j) => !["SUCCEEDED", "FAILED", "STOPPED"].includes(j.state));
  if (!running.length) {
    document.getElementById("jobs").replaceChildren(el("p", {}, "no running jobs"));
    return;
  }
  const titles = ["job", "name", "state", "nodes", "step", `step/s (${RATE_S} s)`, `loss (${TREND_S / 60} min)`, `MFU (${TREND_S / 60} min)`, "bound by", "plan in force"];
  const head = el("tr", {}, titles.map((h) => el("th", {}, h)));
  const rows = running.map((j) => {
    const p = j.progress || {};
    const points = trends.get(j.id) || [];
    const rate = stepRate(j);
    return el(
      "tr",
      { "data-job": j.id },
      el("td", {}, j.id),
      el("td", {}, j.name),
      el("td", { class: `state-${j.state}` }, j.state),
      el("td", {}, j.assigned_nodes.join(", ")),
      el("td", { class: "job-step" }, p.step ?? "-"),
      el("td", { class: "job-rate" }, rate === null ? "-" : fmt(rate, 2)),
      el("td", { class: "job-loss" }, fmt(p.loss, 4), " ", spark(points, "loss")),
      el("td", { class: "job-mfu" }, p.mfu_ratio === undefined || p.mfu_ratio === null ? "-" : `${fmt(100 * p.mfu_ratio, 1)} %`, " ", spark(points, "mfu")),
      el("td", { class: "job-bottleneck", title: j.bottleneck ? j.bottleneck.reason : "" }, bottleneckText(j.bottleneck)),
      el("td", { class: "job-plan" }, planText(plans[j.id], j)),
    );
  });
  document.getElementById("jobs").replaceChildren(el("table", {}, el("thead", {}, head), el("tbody", {}, rows)));
}

// the node a #node=<name> hash asks for, or null (the overview)
function nodeAsked() {
  const m = location.hash.match(/^#node=(.+)$/);
  return m ? decodeURIComponent(m[1]) : null;
}

function gpuRows(n) {
  const num = (x, digits, unit) => (x === null || x === undefined ? "-" : `${fmt(x, digits)} ${unit}`);
  const titles = ["GPU", "state", "temperature", "power / limit", "PCIe", "NVLink up", "throttle", "recent XIDs", ""];
  const rows = n.gpus.map((g) =>
    el(
      "tr",
      { "data-gpu": g.index, "data-state": g.state || "HEALTHY", title: g.reason || "" },
      el("td", {}, g.index),
      el("td", { class: `state-${g.state || "HEALTHY"}` }, (g.state || "HEALTHY") + (g.reset_due ? " (reset due)" : "")),
      el("td", {}, num(g.temperature_celsius, 0, "°C")),
      el("td", {}, `${num(g.power_watts, 0, "W")} / ${num(g.power_limit_watts, 0, "W")}`),
      el("td", {}, g.pcie_link_width ? `x${g.pcie_link_width}/x${g.pcie_link_width_max ?? "?"}` : "-"),
      el("td", {}, g.nvlink_total ? `${g.nvlink_up}/${g.nvlink_total}` : "-"),
      el("td", {}, (g.throttle || []).join(", ")),
      el("td", {}, (g.xids_recent || []).join(", ")),
      el("td", {}, g.lost ? "lost" : g.error || ""),
    ),
  );
  return el("table", { class: "gpus" }, el("thead", {}, el("tr", {}, titles.map((h) => el("th", {}, h)))), el("tbody", {}, rows));
}

async function refreshNode(name) {
  const path = encodeURIComponent(name);
  const unknown = (e) => {
    if (e.status === 404) return null;
    throw e;
  };
  const [n, { data: events }] = await Promise.all([get(`/v1/nodes/${path}`).catch(unknown), get(`/v1/events?node=${path}&limit=${NODE_EVENTS}`)]);
  if (n === null) {
    document.getElementById("node-page").replaceChildren(el("a", { href: "#" }, "← all nodes"), el("p", {}, `no node named ${name}`));
    return;
  }
  const moves = events.filter((e) => e.to_state).reverse();
  const history = moves.map((e) =>
    el(
      "tr",
      { "data-transition": e.id },
      el("td", {}, new Date(e.at * 1000).toLocaleString()),
      el("td", { class: `state-${e.to_state}` }, `${e.from_state || "-"} → ${e.to_state}`),
      el("td", {}, e.actor),
      el("td", { class: "reason" }, e.reason),
    ),
  );
  const labels = Object.entries(n.labels).map(([k, v]) => `${k}=${v}`).join(", ");
  document.getElementById("node-page").replaceChildren(
    el("a", { href: "#" }, "← all nodes"),
    el("h2", {}, `Node ${n.name}`),
    nodeCard(summaryOf(n)),
    el("p", { class: "hint" }, labels || "no labels"),
    gpuRows(n),
    el("h2", {}, `History of transitions (${moves.length})`),
    history.length ? el("table", { id: "node-history" }, el("tbody", {}, history)) : el("p", {}, "no transitions yet"),
  );
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

async function refreshOverview() {
  const [nodes, jobs, events] = await Promise.all([summaries(), get("/v1/jobs"), get(`/v1/events?limit=${EVENTS_SHOWN}`)]);
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
  renderNodes(nodes);
  renderJobs(jobs.data, plans);
  renderEvents(events.data);
}

async function refresh() {
  try {
    const asked = nodeAsked();
    if (asked === null) await refreshOverview();
    else await refreshNode(asked);
    document.getElementById("overview").hidden = asked !== null;
    document.getElementById("node-page").hidden = asked === null;
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
window.addEventListener("hashchange", wake);
loop();
follow();
