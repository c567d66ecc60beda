// lucid_fx graph viewer: pan (drag), zoom (wheel, +/-), search, details on click, colour modes.
// It opens on the summary panel, with the summary's focus node (the worst, else the input) in
// view at a zoom where labels are data.minFontPx tall on screen, or the whole graph if that fits.
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("lucid-data").textContent);
  var svg = document.querySelector("#canvas svg");
  var canvas = document.getElementById("canvas");
  var details = document.getElementById("details");
  var summary = document.getElementById("summary");
  var search = document.getElementById("search");
  var found = document.getElementById("found");
  var colorMode = document.getElementById("color-by");
  var full = svg.viewBox.baseVal;
  var view = { x: full.x, y: full.y, w: full.width, h: full.height };
  var home = { x: full.x, y: full.y, w: full.width, h: full.height };
  var nodes = Array.prototype.slice.call(svg.querySelectorAll("g.node"));
  var edges = Array.prototype.slice.call(svg.querySelectorAll("path.edge"));
  var byId = {};
  nodes.forEach(function (g) { byId[g.id] = g; });

  function apply() { svg.setAttribute("viewBox", [view.x, view.y, view.w, view.h].join(" ")); }
  function unitsPerPixel() {
    var r = svg.getBoundingClientRect();
    return Math.max(view.w / Math.max(r.width, 1), view.h / Math.max(r.height, 1));
  }
  function zoom(factor, px, py) {
    var r = svg.getBoundingClientRect(), k = unitsPerPixel();
    var cx = view.x + view.w / 2 + ((px === undefined ? r.width / 2 : px - r.left) - r.width / 2) * k;
    var cy = view.y + view.h / 2 + ((py === undefined ? r.height / 2 : py - r.top) - r.height / 2) * k;
    view.x = cx - (cx - view.x) * factor; view.y = cy - (cy - view.y) * factor;
    view.w *= factor; view.h *= factor; apply();
  }
  var readableScale = data.minFontPx / data.fontPx;  // screen pixels per drawing unit
  function setView(cx, cy, scale) {
    var r = svg.getBoundingClientRect(), w = Math.max(r.width, 1) / scale, h = Math.max(r.height, 1) / scale;
    view = { x: cx - w / 2, y: cy - h / 2, w: w, h: h }; apply();
  }
  function onGraph(c, half, lo, hi) {  // a centre that keeps the view on the drawing where it can
    return hi - lo <= 2 * half ? (lo + hi) / 2 : Math.min(Math.max(c, lo + half), hi - half);
  }
  function readable(cx, cy) {
    // The whole graph if it fits at a readable size (never above natural size), else the
    // readable size around (cx, cy): a 500-node graph squeezed to fit is a blank-looking page.
    var r = svg.getBoundingClientRect(), fit = Math.min(r.width / home.w, r.height / home.h);
    if (fit >= readableScale) { setView(home.x + home.w / 2, home.y + home.h / 2, Math.min(fit, 1)); return; }
    var halfW = r.width / readableScale / 2, halfH = r.height / readableScale / 2;
    setView(onGraph(cx, halfW, home.x, home.x + home.w), onGraph(cy, halfH, home.y, home.y + home.h), readableScale);
  }
  function centreOn(id) {
    var box = data.nodes[id].box;
    setView(box[0], box[1], Math.max(1 / unitsPerPixel(), readableScale));
  }

  var drag = null;
  canvas.addEventListener("pointerdown", function (e) {
    if (e.target.closest && e.target.closest("g.node")) return;
    drag = { x: e.clientX, y: e.clientY, vx: view.x, vy: view.y, k: unitsPerPixel() };
    canvas.classList.add("dragging");
  });
  window.addEventListener("pointermove", function (e) {
    if (!drag) return;
    view.x = drag.vx - (e.clientX - drag.x) * drag.k; view.y = drag.vy - (e.clientY - drag.y) * drag.k; apply();
  });
  window.addEventListener("pointerup", function () { drag = null; canvas.classList.remove("dragging"); });
  canvas.addEventListener("wheel", function (e) { e.preventDefault(); zoom(e.deltaY > 0 ? 1.15 : 1 / 1.15, e.clientX, e.clientY); }, { passive: false });
  document.getElementById("zoom-in").addEventListener("click", function () { zoom(1 / 1.3); });
  document.getElementById("zoom-out").addEventListener("click", function () { zoom(1.3); });
  document.getElementById("fit").addEventListener("click", function () { readable(view.x + view.w / 2, view.y + view.h / 2); });
  document.getElementById("all").addEventListener("click", function () { view = Object.assign({}, home); apply(); });

  function cell(text) { var td = document.createElement("td"); td.textContent = text; return td; }
  function select(id) {
    nodes.forEach(function (g) { g.classList.toggle("selected", g.id === id); });
    edges.forEach(function (p) { p.classList.toggle("lit", p.getAttribute("data-from") === id || p.getAttribute("data-to") === id); });
    details.innerHTML = "";
    if (!id) { details.classList.add("hidden"); summary.classList.remove("hidden"); return; }
    var attrs = data.nodes[id].attrs;
    var back = document.createElement("a"); back.href = "#"; back.id = "back"; back.textContent = "\u2190 summary";
    back.addEventListener("click", function (e) { e.preventDefault(); select(null); });
    details.appendChild(back);
    var h = document.createElement("h2"); h.textContent = attrs.name; details.appendChild(h);
    var table = document.createElement("table");
    Object.keys(attrs).forEach(function (key) {
      var tr = document.createElement("tr"); tr.className = "attr-" + key;
      tr.appendChild(cell(key)); tr.appendChild(cell(String(attrs[key]))); table.appendChild(tr);
    });
    var io = document.createElement("tr");
    io.appendChild(cell("inputs")); io.appendChild(cell(data.nodes[id].inputs.join(", ") || "-")); table.appendChild(io);
    details.appendChild(table);
    details.classList.remove("hidden"); summary.classList.add("hidden");
  }
  nodes.forEach(function (g) { g.addEventListener("click", function (e) { e.stopPropagation(); select(g.id); }); });
  document.addEventListener("keydown", function (e) { if (e.key === "Escape") select(null); });
  Array.prototype.forEach.call(document.querySelectorAll("a.goto"), function (a) {
    if (byId[a.dataset.node]) byId[a.dataset.node].classList.add("listed");  // outlined in the drawing too
    a.addEventListener("click", function (e) { e.preventDefault(); centreOn(a.dataset.node); select(a.dataset.node); });
  });

  function runSearch() {
    var q = search.value.trim().toLowerCase(), hits = [];
    nodes.forEach(function (g) {
      var a = data.nodes[g.id].attrs;
      var hit = q !== "" && (String(a.name).toLowerCase().indexOf(q) >= 0 || String(a.op || "").toLowerCase().indexOf(q) >= 0);
      g.classList.toggle("match", hit); g.classList.toggle("dim", q !== "" && !hit);
      if (hit) hits.push(g.id);
    });
    edges.forEach(function (p) { p.classList.toggle("dim", q !== ""); });
    found.textContent = q === "" ? "" : hits.length + " match" + (hits.length === 1 ? "" : "es");
    return hits;
  }
  search.addEventListener("input", runSearch);
  search.addEventListener("keydown", function (e) {
    if (e.key !== "Enter") return;
    var hits = runSearch();
    if (hits.length) { centreOn(hits[0]); select(hits[0]); }
  });

  function paint(mode) {
    nodes.forEach(function (g) {
      var a = data.nodes[g.id], rect = g.querySelector("rect");
      rect.setAttribute("fill", mode === "error" ? (a.errorFill || "#ffffff") : a.domainFill);
    });
    document.getElementById("legend-domain").style.display = mode === "error" ? "none" : "";
    document.getElementById("legend-error").style.display = mode === "error" ? "" : "none";
  }
  colorMode.addEventListener("change", function () { paint(colorMode.value); });
  paint(colorMode.value);
  (function initialView() {
    var focus = data.focus && data.nodes[data.focus];
    readable(focus ? focus.box[0] : home.x + home.w / 2, focus ? focus.box[1] : home.y);
  })();
  window.lucidViewer = {
    select: select, search: runSearch, zoom: zoom, centreOn: centreOn, view: function () { return view; },
    scale: function () { return 1 / unitsPerPixel(); }, readableScale: readableScale,
  };
})();
