// lucid_fx graph viewer: pan (drag), zoom (wheel, +/-), search, details on click, colour modes.
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("lucid-data").textContent);
  var svg = document.querySelector("#canvas svg");
  var canvas = document.getElementById("canvas");
  var details = document.getElementById("details");
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
  function centreOn(id) {
    // Natural size (one unit per pixel), centred on the node.
    var box = data.nodes[id].box, r = svg.getBoundingClientRect();
    var w = Math.max(r.width, 200), h = Math.max(r.height, 200);
    view = { x: box[0] - w / 2, y: box[1] - h / 2, w: w, h: h }; apply();
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
  document.getElementById("fit").addEventListener("click", function () { view = Object.assign({}, home); apply(); });

  function cell(text) { var td = document.createElement("td"); td.textContent = text; return td; }
  function select(id) {
    nodes.forEach(function (g) { g.classList.toggle("selected", g.id === id); });
    edges.forEach(function (p) { p.classList.toggle("lit", p.getAttribute("data-from") === id || p.getAttribute("data-to") === id); });
    details.innerHTML = "";
    if (!id) { details.classList.add("hidden"); return; }
    var attrs = data.nodes[id].attrs;
    var h = document.createElement("h2"); h.textContent = attrs.name; details.appendChild(h);
    var table = document.createElement("table");
    Object.keys(attrs).forEach(function (key) {
      var tr = document.createElement("tr"); tr.className = "attr-" + key;
      tr.appendChild(cell(key)); tr.appendChild(cell(String(attrs[key]))); table.appendChild(tr);
    });
    var io = document.createElement("tr");
    io.appendChild(cell("inputs")); io.appendChild(cell(data.nodes[id].inputs.join(", ") || "-")); table.appendChild(io);
    details.appendChild(table);
    details.classList.remove("hidden");
  }
  nodes.forEach(function (g) { g.addEventListener("click", function (e) { e.stopPropagation(); select(g.id); }); });
  document.addEventListener("keydown", function (e) { if (e.key === "Escape") select(null); });

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
    // A tall graph squeezed to fit is unreadable: start at natural size on its top instead.
    var r = svg.getBoundingClientRect();
    if (r.width > 0 && r.height > 0 && Math.min(r.width / home.w, r.height / home.h) < 0.6) {
      var w = Math.max(r.width, 1), h = Math.max(r.height, 1);
      view = { x: home.x + home.w / 2 - w / 2, y: home.y, w: w, h: h }; apply();
    }
  })();
  window.lucidViewer = { select: select, search: runSearch, zoom: zoom, view: function () { return view; } };
})();
