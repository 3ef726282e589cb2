// qgemm's pages: every figure comes from the public /v1 API (what a page shows, a script can fetch).
// Data goes into the page as text nodes only (never as HTML).
"use strict";

const KEY = "qgemm.apiKey";  // sessionStorage: this tab only; never in a URL

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function showError(message) {
  const p = document.getElementById("error");
  p.textContent = message;
  p.hidden = !message;
}

function askForKey() {
  const form = document.getElementById("key-form");
  form.hidden = false;
  return new Promise((resolve) => {
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      const input = document.getElementById("api-key");
      sessionStorage.setItem(KEY, input.value);
      input.value = "";  // the key lives in sessionStorage only, not in the form
      form.hidden = true;
      resolve();
    }, { once: true });
  });
}

async function api(path, options = {}) {
  for (;;) {
    const headers = Object.assign({ Accept: "application/json" }, options.headers || {});
    const key = sessionStorage.getItem(KEY);
    if (key) headers.Authorization = `Bearer ${key}`;
    const r = await fetch(path, Object.assign({}, options, { headers }));
    if (r.status === 401) { sessionStorage.removeItem(KEY); await askForKey(); continue; }
    const body = await r.json().catch(() => null);
    if (!r.ok) {
      const err = body && body.error ? `${body.error.code}: ${body.error.message}` : `HTTP ${r.status}`;
      throw new Error(err);
    }
    return body;
  }
}

const fmtBytes = (n) => {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
};
const fmtCount = (n) => (n >= 1e9 ? `${(n / 1e9).toFixed(2)}B` : n >= 1e6 ? `${(n / 1e6).toFixed(1)}M` : `${n}`);
const fmtNum = (v) => (v === null || v === undefined ? "" : Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-3)
  ? v.toExponential(3) : Number(v.toPrecision(5)).toString());
const layerOf = (name) => { const m = /^blk\.(\d+)\./.exec(name); return m ? Number(m[1]) : -1; };
// names in natural order: blk.2 before blk.10
const natural = new Intl.Collator(undefined, { numeric: true }).compare;
const FOLD_ABOVE = 8;  // a model of more layer groups than this opens with its blocks folded
// shapes are row-major [N, K]; GGUF (and gguf-dump, llama.cpp's logs) list ggml's ne = [K, N]
const shapeTitle = (shape) => `qgemm (row-major): [${shape.join(", ")}]; GGUF's ne: [${[...shape].reverse().join(", ")}]`;

// Horizontal bars (label, value) as SVG, with each bar's title for exact numbers.
function bars(container, rows, format = fmtBytes) {
  const w = 560, rowH = 18, labelW = 150, max = Math.max(...rows.map((r) => r[1]), 1);
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", `0 0 ${w} ${rows.length * rowH + 4}`);
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", container.id.replace(/-/g, " "));
  rows.forEach(([label, value], i) => {
    const g = document.createElementNS(svg.namespaceURI, "g");
    const t = document.createElementNS(svg.namespaceURI, "text");
    t.setAttribute("x", 0); t.setAttribute("y", i * rowH + 13); t.textContent = label;
    const r = document.createElementNS(svg.namespaceURI, "rect");
    r.setAttribute("x", labelW); r.setAttribute("y", i * rowH + 3); r.setAttribute("height", rowH - 6);
    r.setAttribute("width", Math.max(1, (w - labelW - 90) * value / max));
    const v = document.createElementNS(svg.namespaceURI, "text");
    v.setAttribute("x", labelW + (w - labelW - 90) * value / max + 4); v.setAttribute("y", i * rowH + 13);
    v.textContent = format(value);
    const title = document.createElementNS(svg.namespaceURI, "title");
    title.textContent = `${label}: ${value}`;
    g.append(title, t, r, v);
    svg.append(g);
  });
  container.replaceChildren(svg);
}

// A histogram (edges, counts) as SVG columns.
function histogram(container, h) {
  const w = 480, hgt = 160, n = h.counts.length, max = Math.max(...h.counts, 1);
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", `0 0 ${w} ${hgt + 20}`);
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", `histogram from ${fmtNum(h.edges[0])} to ${fmtNum(h.edges[n])}`);
  h.counts.forEach((c, i) => {
    const r = document.createElementNS(svg.namespaceURI, "rect");
    const bh = hgt * c / max;
    r.setAttribute("x", i * w / n); r.setAttribute("y", hgt - bh);
    r.setAttribute("width", Math.max(1, w / n - 1)); r.setAttribute("height", bh);
    const title = document.createElementNS(svg.namespaceURI, "title");
    title.textContent = `[${fmtNum(h.edges[i])}, ${fmtNum(h.edges[i + 1])}): ${c}`;
    r.append(title);
    svg.append(r);
  });
  for (const [x, v, anchor] of [[0, h.edges[0], "start"], [w, h.edges[n], "end"]]) {
    const t = document.createElementNS(svg.namespaceURI, "text");
    t.setAttribute("x", x); t.setAttribute("y", hgt + 16); t.setAttribute("text-anchor", anchor);
    t.textContent = fmtNum(v);
    svg.append(t);
  }
  container.replaceChildren(svg);
}

function definitions(dl, entries) {
  dl.replaceChildren(...entries.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", {}, v)]));
}

async function backendLine() {
  const h = await api("/healthz");
  document.getElementById("backend").textContent =
    `backend ${h.backend}${h.device ? ` (${h.device})` : ""}, qgemm ${h.version}`;
}

const pages = {
  async index() {
    await backendLine();
    const { models } = await api("/v1/models");
    const tbody = document.querySelector("#models tbody");
    for (const m of models) {
      const link = el("a", { href: `/ui/models/${encodeURIComponent(m.id)}`, text: m.id });
      const status = m.status === "ok" ? el("span", { text: "ok" }) : el("span", { class: "error", text: `error: ${m.error}` });
      const row = el("tr", { "data-model": m.id }, el("td", {}, link), el("td", {}, status), el("td", { text: fmtBytes(m.size_bytes) }),
        el("td", { text: m.architecture || "" }), el("td", { text: m.tensor_count }), el("td", { class: "mix", text: "" }));
      tbody.append(row);
      if (m.status === "ok") {
        api(`/v1/models/${encodeURIComponent(m.id)}`).then((d) => {
          row.querySelector(".mix").textContent = d.quant_mix ? d.quant_mix.summary : Object.keys(d.tensor_types).join(", ");
        }).catch((e) => { row.querySelector(".mix").textContent = e.message; });
      }
    }
  },

  async model() {
    const id = document.body.dataset.model;
    const [d, { tensors }] = await Promise.all([api(`/v1/models/${encodeURIComponent(id)}`),
      api(`/v1/models/${encodeURIComponent(id)}/tensors`)]);
    const params = d.parameter_count ? `, ${fmtCount(d.parameter_count)} parameters at ` +
      `${(8 * d.tensor_bytes / d.parameter_count).toFixed(2)} bits each` : "";
    document.getElementById("summary").textContent =
      `${d.file}, ${fmtBytes(d.size_bytes)}, ${d.architecture || "no architecture"}, ${d.tensor_count} tensors${params}` +
      (d.quant_mix ? `; ${d.quant_mix.summary}` : "");
    definitions(document.getElementById("header"), Object.entries(d.header || {}).map(([k, v]) => [k, String(v)]));
    bars(document.getElementById("by-format"),
      Object.entries(d.tensor_types).sort((a, b) => b[1].n_bytes - a[1].n_bytes).map(([t, s]) => [`${t} (${s.count})`, s.n_bytes]));
    const perLayer = new Map();
    for (const t of tensors) {
      const l = layerOf(t.name), k = l < 0 ? "other" : `blk.${l}`;
      perLayer.set(k, (perLayer.get(k) || 0) + t.n_bytes);
    }
    bars(document.getElementById("by-layer"), [...perLayer.entries()].sort((a, b) => natural(a[0], b[0])));
    definitions(document.getElementById("metadata"), Object.entries(d.metadata).map(([k, v]) => {
      if (v && typeof v === "object" && v.type === "ARRAY") {  // summarised by the API: its length and first items
        const more = el("details", {}, el("summary", { text: `${v.item_type} array of ${v.length}` }),
          el("code", { text: JSON.stringify(v.first) + (v.length > v.first.length ? " …" : "") }));
        return [k, more];
      }
      if (k === "general.file_type" && d.quant_mix && d.quant_mix.file_type) return [k, `${v} (${d.quant_mix.file_type})`];
      const s = typeof v === "string" ? v : JSON.stringify(v);
      return [k, s.length > 200 ? el("details", {}, el("summary", { text: `${s.slice(0, 80)}…` }), el("code", { text: s })) : s];
    }));
    const rows = tensors.map((t) => ({ ...t, layer: layerOf(t.name), shapeText: t.shape.join(" × ") }));
    const tbody = document.querySelector("#tensors tbody"), filter = document.getElementById("filter");
    const grouped = document.getElementById("grouped"), minBytes = document.getElementById("min-bytes");
    const layers = [...new Set(rows.map((t) => t.layer))].sort((a, b) => a - b);
    // many layers: the table opens folded (the metadata below it stays in reach); a search unfolds them
    const folded = new Set(layers.length > FOLD_ABOVE ? layers.filter((l) => l >= 0) : []);
    const foldAll = document.getElementById("fold-all");
    let sortKey = "layer", ascending = true;
    const tensorRow = (t) => el("tr", { class: "t" },
      el("td", { text: t.layer < 0 ? "" : t.layer }),
      el("td", {}, el("a", { href: `/ui/models/${encodeURIComponent(id)}/tensors/${encodeURIComponent(t.name)}`, text: t.name })),
      el("td", { text: t.type }), el("td", { text: t.shapeText, title: shapeTitle(t.shape) }),
      el("td", { text: fmtBytes(t.n_bytes) }),
      el("td", {}, t.matmul ? el("a", { href: `/ui/matmul?model=${encodeURIComponent(id)}&tensor=${encodeURIComponent(t.name)}`, text: "multiply" }) : ""));
    // A layer's heading row: a button folds or unfolds its tensors (keyboard: Tab to it, Enter or Space).
    const groupRow = (layer, members) => {
      const label = layer < 0 ? "outside the blocks" : `blk.${layer}`, open = !folded.has(layer);
      const toggle = el("button", { type: "button", "aria-expanded": String(open), "data-layer": layer, text: `${open ? "▾" : "▸"} ${label}` });
      toggle.addEventListener("click", () => { if (open) folded.add(layer); else folded.delete(layer); render(); });
      return el("tr", { class: "group" }, el("th", { colspan: 6, scope: "rowgroup" }, toggle,
        el("span", { class: "muted", text: ` ${members.length} tensors, ${fmtBytes(members.reduce((a, t) => a + t.n_bytes, 0))}` })));
    };
    const render = () => {
      const q = filter.value.trim().toLowerCase(), least = Number(minBytes.value);
      const shown = rows.filter((t) => t.n_bytes >= least && (!q || t.name.toLowerCase().includes(q) ||
        t.type.toLowerCase().includes(q) || t.shapeText.includes(q)));
      const key = sortKey === "shape" ? (t) => t.shape.reduce((a, b) => a * b, 1) : (t) => t[sortKey];
      const cmp = (a, b) => (typeof a === "string" ? natural(a, b) : a < b ? -1 : a > b ? 1 : 0);
      shown.sort((a, b) => (cmp(key(a), key(b)) || natural(a.name, b.name)) * (ascending ? 1 : -1));
      foldAll.hidden = !grouped.checked;
      foldAll.textContent = folded.size ? "unfold all" : "fold all";
      if (grouped.checked) {  // the sort holds within each layer; layers in their order, the rest first
        const groups = new Map(layers.map((l) => [l, []]));
        for (const t of shown) groups.get(t.layer).push(t);
        tbody.replaceChildren(...[...groups].filter(([, m]) => m.length).flatMap(([layer, members]) =>
          [groupRow(layer, members), ...(folded.has(layer) ? [] : members.map(tensorRow))]));
      } else {
        tbody.replaceChildren(...shown.map(tensorRow));
      }
      document.getElementById("count").textContent = `${shown.length} of ${rows.length}`;
    };
    let searching = false;
    filter.addEventListener("input", () => {
      if (filter.value.trim() && !searching) folded.clear();  // a new search shows every match
      searching = Boolean(filter.value.trim());
      render();
    });
    foldAll.addEventListener("click", () => {
      if (folded.size) folded.clear(); else for (const l of layers) folded.add(l);
      render();
    });
    grouped.addEventListener("change", render);
    minBytes.addEventListener("change", render);
    for (const b of document.querySelectorAll("#tensors th button")) {
      b.addEventListener("click", () => {
        ascending = sortKey === b.dataset.key ? !ascending : true;
        sortKey = b.dataset.key;
        for (const other of document.querySelectorAll("#tensors th")) other.removeAttribute("aria-sort");
        b.parentElement.setAttribute("aria-sort", ascending ? "ascending" : "descending");
        render();
      });
    }
    render();
  },

  async tensor() {
    const id = document.body.dataset.model, name = document.body.dataset.tensor;
    const base = `/v1/models/${encodeURIComponent(id)}/tensors/${encodeURIComponent(name)}`;
    const t = await api(base);
    const s = t.stats;
    definitions(document.getElementById("facts"), [["type", t.type],
      ["shape", el("span", { title: shapeTitle(t.shape), text: `${t.shape.join(" × ")} (GGUF's ne: ${[...t.shape].reverse().join(" × ")})` })],
      ["bytes", fmtBytes(t.n_bytes)], ["block format", t.block_format || "-"],
      ["multiplies", t.matmul ? "yes" : `no: ${t.matmul_reason}`],
      ...(s ? [["min / max", `${fmtNum(s.min)} / ${fmtNum(s.max)}`], ["mean ± std", `${fmtNum(s.mean)} ± ${fmtNum(s.std)}`],
        ["all-zero blocks", `${(100 * s.zero_block_share).toFixed(2)}%`]] : [["statistics", t.stats_error || "-"]])]);
    const tryLink = document.getElementById("try");
    if (t.matmul) tryLink.href = `/ui/matmul?model=${encodeURIComponent(id)}&tensor=${encodeURIComponent(name)}`;
    else tryLink.hidden = true;
    if (!s) { document.getElementById("quant").hidden = true; return; }
    const form = document.getElementById("q-form");
    form.addEventListener("submit", (e) => { e.preventDefault(); compareSchemes(base).catch((err) => showError(err.message)); });
    if (t.n_elements <= AUTO_COMPARE_VALUES) form.requestSubmit();  // a second or less: shown without asking
    const h = await api(`${base}/histogram?bins=48`);
    histogram(document.getElementById("values"), h.values);
    if (h.block_scales) histogram(document.getElementById("scales"), h.block_scales);
    else document.getElementById("scales").textContent = "no block scales (a float tensor or a vector)";
  },

  async matmul() {
    const params = new URLSearchParams(location.search);
    const modelSel = document.getElementById("mm-model"), tensorSel = document.getElementById("mm-tensor");
    const [{ models }, { kernels }] = await Promise.all([api("/v1/models"), api("/v1/kernels")]);
    modelSel.replaceChildren(...models.filter((m) => m.status === "ok").map((m) => el("option", { value: m.id, text: m.id })));
    if (params.get("model")) modelSel.value = params.get("model");
    let rows = [];
    const box = document.getElementById("mm-kernels");
    const fillKernels = () => {
      const t = rows.find((r) => r.name === tensorSel.value);
      const fit = kernels.filter((k) => k.available && k.name !== "ref_f32" && (k.name === "auto" || !t || k.weight_types.includes(t.type)));
      box.replaceChildren(box.querySelector("legend"), ...fit.map((k, i) =>
        el("label", { title: k.description }, Object.assign(el("input", { type: "checkbox", value: k.name }), { checked: i < 2 }), ` ${k.name}`)));
    };
    const fillTensors = async () => {
      ({ tensors: rows } = await api(`/v1/models/${encodeURIComponent(modelSel.value)}/tensors`));
      rows = rows.filter((t) => t.matmul);
      tensorSel.replaceChildren(...rows.map((t) => el("option", { value: t.name, text: `${t.name} (${t.type}, ${t.shape.join("×")})` })));
      if (params.get("tensor") && rows.some((t) => t.name === params.get("tensor"))) tensorSel.value = params.get("tensor");
      fillKernels();
    };
    modelSel.addEventListener("change", () => { params.delete("tensor"); fillTensors().catch((e) => showError(e.message)); });
    tensorSel.addEventListener("change", fillKernels);
    await fillTensors();
    document.getElementById("mm").addEventListener("submit", (e) => {
      e.preventDefault();
      runMatmul(rows.find((r) => r.name === tensorSel.value)).catch((err) => showError(err.message));
    });
  },

  async kernels() {
    await backendLine();
    const { kernels } = await api("/v1/kernels");
    document.querySelector("#kernels tbody").replaceChildren(...kernels.map((k) => el("tr", {},
      el("td", { text: k.name }), el("td", { text: k.backend }), el("td", { text: k.available ? "yes" : "no" }),
      el("td", { text: k.weight_types.join(", ") }), el("td", { text: k.activation_format }),
      el("td", { text: k.available ? k.description : `${k.reason} (${k.description})` }))));
  },
};

const AUTO_COMPARE_VALUES = 1 << 22;  // the tensor page compares schemes by itself up to this size (~0.5 s on a CPU)

// GET .../quantization: each scheme's bits, error against the stored values, and on a GPU its product's time.
async function compareSchemes(base) {
  const status = document.getElementById("q-status"), table = document.getElementById("q-table");
  const query = new URLSearchParams({ blocksize: document.getElementById("q-blocksize").value,
    double_quant: document.getElementById("q-dq").checked });
  status.textContent = "requantizing…";
  const r = await api(`${base}/quantization?${query}`);
  table.querySelector("tbody").replaceChildren(...r.schemes.map((q) => {
    const time = q.gemm_us && q.gemm_us["1"] !== undefined ? `${fmtNum(q.gemm_us["1"])} µs (${q.kernel["1"]})` : "";
    const name = q.weight_format === "gguf" ? `${q.tag} (as stored)` : q.tag;
    return el("tr", { "data-scheme": q.tag }, el("td", { text: name }),
      ...(q.reason ? [el("td", { colspan: 4, class: "muted", text: q.reason })]
        : [el("td", { text: fmtNum(q.bits_per_weight) }), el("td", { class: "nmse", text: q.nmse ? q.nmse.toExponential(2) : "0" }),
          el("td", { text: fmtNum(q.max_abs_error) }), el("td", { text: time })]));
  }));
  table.hidden = false;
  status.textContent = `against ${r.reference}` + (r.method ? `; times: ${r.method} on ${r.device}` : "; no GPU here, so no times");
}

// Seeded N(0, 1) values (mulberry32 + Box-Muller): the same seed gives the same activations in every browser.
function randomRows(m, k, seed) {
  let s = seed >>> 0;
  const next = () => { s = (s + 0x6d2b79f5) >>> 0; let t = s; t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61); return ((t ^ (t >>> 14)) >>> 0) / 4294967296; };
  const rows = [];
  for (let i = 0; i < m; i++) {
    const r = new Array(k);
    for (let j = 0; j < k; j++) r[j] = Math.sqrt(-2 * Math.log(1 - next())) * Math.cos(2 * Math.PI * next());
    rows.push(r);
  }
  return rows;
}

async function runMatmul(t) {
  showError("");
  const status = document.getElementById("mm-status");
  const model = document.getElementById("mm-model").value;
  const m = Number(document.getElementById("mm-m").value), k = t.shape[t.shape.length - 1];
  const chosen = [...document.querySelectorAll("#mm-kernels input:checked")].map((i) => i.value);
  if (!chosen.length) throw new Error("choose at least one kernel");
  const source = document.querySelector("input[name=source]:checked").value;
  let call;
  if (source === "file") {
    const file = document.getElementById("mm-file").files[0];
    if (!file) throw new Error("choose a .npy file");
    const body = await file.arrayBuffer();
    call = (kernel) => api(`/v1/matmul?${new URLSearchParams({ model, tensor: t.name, kernel })}`,
      { method: "POST", headers: { "Content-Type": "application/x-npy" }, body });
  } else {
    const activations = randomRows(m, k, Number(document.getElementById("mm-seed").value));
    call = (kernel) => api("/v1/matmul", { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model, tensor: t.name, kernel, activations }) });
  }
  status.textContent = "running the reference (ref_f32)…";
  const ref = await call("ref_f32");
  const refFlat = ref.output.flat(), energy = refFlat.reduce((a, v) => a + v * v, 0);
  const tbody = document.querySelector("#mm-results tbody");
  tbody.replaceChildren();
  document.getElementById("mm-results").hidden = false;
  for (const kernel of ["ref_f32", ...chosen]) {
    status.textContent = `running ${kernel}…`;
    const r = kernel === "ref_f32" ? ref : await call(kernel);
    const flat = r.output.flat();
    let se = 0, worst = 0;
    flat.forEach((v, i) => { const d = v - refFlat[i]; se += d * d; worst = Math.max(worst, Math.abs(d)); });
    const tm = r.timing_ms;
    tbody.append(el("tr", { "data-kernel": kernel }, el("td", { text: r.kernel === kernel ? kernel : `${kernel} → ${r.kernel}` }),
      el("td", { text: r.backend }), el("td", { text: r.activation_format }), el("td", { text: fmtNum(tm.quantize ?? 0) }),
      el("td", { text: fmtNum(tm.gemm) }), el("td", { text: fmtNum(tm.total) }),
      el("td", { class: "nmse", text: energy ? (se / energy).toExponential(2) : "-" }), el("td", { text: fmtNum(worst) }),
      el("td", { class: "head", text: r.output[0].slice(0, 4).map(fmtNum).join(", ") + " …" })));
  }
  status.textContent = `${chosen.length} kernel(s) on ${t.name}, M = ${ref.shape[0]}`;
}

document.addEventListener("DOMContentLoaded", async () => {
  if (document.body.dataset.needsKey === "yes" && !sessionStorage.getItem(KEY)) await askForKey();
  const page = pages[document.body.dataset.page];
  if (page) page().catch((e) => showError(e.message));
});
