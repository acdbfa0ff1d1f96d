// opfuse graph viewer: draws the graphs of opfuse/debug/html.py's page from its JSON data.
// Layout comes from Graphviz (precomputed in the data) or from dagre (vendored, run here).
// When it is done, window.opfuseViewer.ready is true (the browser test waits for it).
(function () {
  "use strict";
  var SVGNS = "http://www.w3.org/2000/svg";
  // Box geometry: the same numbers as opfuse/debug/html.py (FONT_PX, LINE_PX, PAD_X, PAD_Y, PORT_BAND).
  var FONT = 11, LINE = 15, PAD_X = 8, PAD_Y = 6, PORT_BAND = 10, MARGIN = 16;
  var data = JSON.parse(document.getElementById("opfuse-data").textContent);
  var details = document.getElementById("details");
  var pinned = null;  // {graph, id} of the clicked node, or null
  var views = [];

  function el(name, attrs, parent) {
    var node = document.createElementNS(SVGNS, name);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (parent) parent.appendChild(node);
    return node;
  }

  // Text widths as the browser will draw them (the SVG text uses the same font).
  var ctx = document.createElement("canvas").getContext("2d");
  function textWidth(text, bold) {
    ctx.font = (bold ? "bold " : "") + FONT + "px monospace";
    return ctx.measureText(text).width;
  }
  function boxSize(node) {
    var width = 0;
    node.lines.forEach(function (line, i) { width = Math.max(width, textWidth(line, i === 0)); });
    var height = node.lines.length * LINE + 2 * PAD_Y + (node.ports > 1 ? PORT_BAND : 0);
    return {w: Math.ceil(width) + 2 * PAD_X, h: height};
  }

  // Layout -> {nodes: id -> {x, y, w, h} (centre), edges: [{points | bezier + tip}], width, height}.
  function dagreLayout(graph) {
    if (typeof dagre === "undefined") throw new Error("opfuse viewer: no layout (dagre missing)");
    var g = new dagre.graphlib.Graph({multigraph: true});
    g.setGraph({rankdir: "TB", nodesep: 26, ranksep: 34, edgesep: 14, marginx: 0, marginy: 0});
    g.setDefaultEdgeLabel(function () { return {}; });
    graph.nodes.forEach(function (n) { var s = boxSize(n); g.setNode(n.id, {width: s.w, height: s.h}); });
    graph.edges.forEach(function (e, i) { g.setEdge(e.src, e.dst, {}, "e" + i); });
    dagre.layout(g);
    var nodes = {};
    graph.nodes.forEach(function (n) {
      var p = g.node(n.id);
      nodes[n.id] = {x: p.x, y: p.y, w: p.width, h: p.height};
    });
    var edges = graph.edges.map(function (e, i) {
      return {points: g.edge({v: e.src, w: e.dst, name: "e" + i}).points.map(function (p) { return [p.x, p.y]; })};
    });
    return {nodes: nodes, edges: edges, width: g.graph().width, height: g.graph().height};
  }

  function portPoint(box, port, ports) {
    return [box.x - box.w / 2 + box.w * (port + 1) / (ports + 1), box.y - box.h / 2];
  }

  function fmt(p) { return p[0].toFixed(2) + "," + p[1].toFixed(2); }

  // Ports of a node with several inputs sit left to right in the order of their producers' x
  // (so the edges need not cross), each labelled with its argument position: -> {edge index: slot}.
  function portSlots(graph, layout) {
    var slots = {}, into = {};
    graph.edges.forEach(function (e, i) { (into[e.dst] = into[e.dst] || []).push(i); });
    Object.keys(into).forEach(function (dst) {
      into[dst].sort(function (a, b) {
        var ea = graph.edges[a], eb = graph.edges[b];
        return (layout.nodes[ea.src].x - layout.nodes[eb.src].x) || (ea.port - eb.port);
      }).forEach(function (edgeIndex, slot) { slots[edgeIndex] = slot; });
    });
    return slots;
  }

  // The SVG path of one edge; an edge into a node with several inputs ends at its port.
  function edgePath(slot, route, target, ports) {
    var d, end;
    if (route.bezier) {  // Graphviz: cubic Bezier pieces, then the arrow's tip
      var pts = route.bezier.map(function (p) { return p.slice(); });
      end = (route.tip || pts[pts.length - 1]).slice();
      if (ports > 1) {
        var port = portPoint(target, slot, ports), dx = port[0] - end[0];
        pts[pts.length - 1][0] += dx;
        pts[pts.length - 2][0] += dx;
        end = port;
      }
      d = "M" + fmt(pts[0]);
      for (var i = 1; i + 2 < pts.length; i += 3) d += "C" + fmt(pts[i]) + " " + fmt(pts[i + 1]) + " " + fmt(pts[i + 2]);
      d += "L" + fmt(end);
      return d;
    }
    var p = route.points.map(function (q) { return q.slice(); });  // dagre: a polyline, smoothed
    if (ports > 1) p[p.length - 1] = portPoint(target, slot, ports);
    d = "M" + fmt(p[0]);
    if (p.length === 2) return d + "L" + fmt(p[1]);
    for (var k = 1; k < p.length - 1; k++) {
      var mid = k < p.length - 2 ? [(p[k][0] + p[k + 1][0]) / 2, (p[k][1] + p[k + 1][1]) / 2] : p[k + 1];
      d += "Q" + fmt(p[k]) + " " + fmt(mid);
    }
    return d;
  }

  function draw(index, graph) {
    var svg = document.getElementById("graph-" + index);
    var layout = graph.layout || dagreLayout(graph);
    var defs = el("defs", {}, svg);
    var marker = el("marker", {id: "arrow-" + index, viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 8,
                               markerHeight: 8, markerUnits: "userSpaceOnUse", orient: "auto"}, defs);
    el("path", {d: "M0,0 L10,5 L0,10 z", fill: "#777"}, marker);
    var scene = el("g", {"class": "scene"}, svg);
    var byId = {}, slots = portSlots(graph, layout);
    graph.nodes.forEach(function (n) { byId[n.id] = n; n.inputs = []; n.users = []; n.argAtSlot = []; });
    var edgeEls = graph.edges.map(function (e, i) {
      var target = layout.nodes[e.dst];
      byId[e.dst].argAtSlot[slots[i]] = e.port;
      var path = el("path", {"class": "edge", d: edgePath(slots[i], layout.edges[i], target, byId[e.dst].ports),
                             "marker-end": "url(#arrow-" + index + ")", "data-src": e.src, "data-dst": e.dst,
                             "data-port": e.port}, scene);
      byId[e.dst].inputs.push(e.src);
      byId[e.src].users.push(e.dst);
      return path;
    });
    var nodeEls = {};
    graph.nodes.forEach(function (n) {
      var box = layout.nodes[n.id], left = box.x - box.w / 2, top = box.y - box.h / 2;
      var g = el("g", {"class": "node " + n.cls, "data-id": n.id}, scene);
      el("rect", {x: left, y: top, width: box.w, height: box.h, rx: n.cls === "input" || n.cls === "output" ? 10 : 4}, g);
      var band = n.ports > 1 ? PORT_BAND : 0;
      n.lines.forEach(function (line, i) {
        var t = el("text", {x: left + PAD_X, y: top + PAD_Y + band + LINE * (i + 1) - 4, "class": i === 0 ? "name" : ""}, g);
        t.textContent = line;
      });
      for (var p = 0; p < n.ports && n.ports > 1; p++) {
        var at = portPoint(box, p, n.ports);
        el("circle", {"class": "port", cx: at[0], cy: at[1], r: 2.5}, g);
        var label = el("text", {"class": "port", x: at[0], y: top + 9, "text-anchor": "middle"}, g);
        label.textContent = String(n.argAtSlot[p]);  // the argument this port feeds
      }
      g.addEventListener("mouseenter", function () { if (!pinned) focus(index, n.id); });
      g.addEventListener("mouseleave", function () { if (!pinned) focus(index, null); });
      g.addEventListener("click", function (ev) {
        ev.stopPropagation();
        pinned = {graph: index, id: n.id};
        focus(index, n.id);
      });
      nodeEls[n.id] = g;
    });
    var view = {svg: svg, scene: scene, graph: graph, byId: byId, nodeEls: nodeEls, edgeEls: edgeEls,
                width: layout.width, height: layout.height, engine: layout.engine || "dagre"};
    panZoom(view);
    return view;
  }

  function focus(index, id) {
    views.forEach(function (v, i) {
      v.svg.classList.toggle("dim", i === index && id !== null);
      Object.keys(v.nodeEls).forEach(function (k) { v.nodeEls[k].classList.remove("focus", "producer", "consumer"); });
      v.edgeEls.forEach(function (e) { e.classList.remove("in", "out"); });
    });
    if (id === null) { showDetails(null); return; }
    var v = views[index], n = v.byId[id];
    v.nodeEls[id].classList.add("focus");
    n.inputs.forEach(function (k) { v.nodeEls[k].classList.add("producer"); });
    n.users.forEach(function (k) { v.nodeEls[k].classList.add("consumer"); });
    v.edgeEls.forEach(function (e) {
      if (e.getAttribute("data-dst") === id) e.classList.add("in");
      if (e.getAttribute("data-src") === id) e.classList.add("out");
    });
    showDetails(n, v.graph.title);
  }

  function showDetails(n, where) {
    while (details.firstChild) details.removeChild(details.firstChild);
    var h = document.createElement("h2");
    h.textContent = n ? n.id : "Node";
    details.appendChild(h);
    if (!n) {
      var hint = document.createElement("p");
      hint.className = "hint";
      hint.textContent = "Hover or click a node.";
      details.appendChild(hint);
      return;
    }
    var sub = document.createElement("p");
    sub.className = pinned ? "pinned" : "hint";
    sub.textContent = where + (pinned ? " (pinned: click the background to release)" : "");
    details.appendChild(sub);
    var dl = document.createElement("dl");
    var rows = [["kind", n.lines[1]], ["python", n.info.python], ["value", n.info.value], ["sharding", n.info.sharding],
                ["module", n.info.module], ["rule", n.info.rule], ["implementation", n.info.implementation],
                ["covers", n.info.covers], ["inputs (producers)", n.inputs.join(", ") || "-"],
                ["users (consumers)", n.users.join(", ") || "-"]];
    rows.forEach(function (row) {
      if (row[1] === undefined || row[1] === "") return;
      var dt = document.createElement("dt"), dd = document.createElement("dd");
      dt.textContent = row[0];
      dd.textContent = row[1];
      dl.appendChild(dt);
      dl.appendChild(dd);
    });
    details.appendChild(dl);
  }

  // Pan (drag), zoom (wheel, around the pointer), fit (double-click or the panel's button).
  function panZoom(view) {
    var svg = view.svg, box;
    function apply() { svg.setAttribute("viewBox", [box.x, box.y, box.w, box.h].join(" ")); }
    view.fit = function () {
      box = {x: -MARGIN, y: -MARGIN, w: view.width + 2 * MARGIN, h: view.height + 2 * MARGIN};
      apply();
    };
    view.fit();
    function toUser(ev) {
      var m = svg.getScreenCTM().inverse(), p = svg.createSVGPoint();
      p.x = ev.clientX; p.y = ev.clientY;
      return p.matrixTransform(m);
    }
    svg.addEventListener("wheel", function (ev) {
      ev.preventDefault();
      var at = toUser(ev), f = Math.exp(ev.deltaY * 0.0015);
      box = {x: at.x - (at.x - box.x) * f, y: at.y - (at.y - box.y) * f, w: box.w * f, h: box.h * f};
      apply();
    }, {passive: false});
    var drag = null, dragged = false;
    svg.addEventListener("pointerdown", function (ev) {
      drag = {x: ev.clientX, y: ev.clientY, box: Object.assign({}, box), scale: 1 / svg.getScreenCTM().a,
              id: ev.pointerId, captured: false};
      dragged = false;
    });
    svg.addEventListener("pointermove", function (ev) {
      if (!drag) return;
      var dx = ev.clientX - drag.x, dy = ev.clientY - drag.y;
      if (!drag.captured && Math.abs(dx) + Math.abs(dy) > 3) {
        // Capture only once it is a drag: a plain click must still reach the node under it.
        svg.setPointerCapture(drag.id);
        svg.classList.add("dragging");
        drag.captured = dragged = true;
      }
      if (!drag.captured) return;
      box = {x: drag.box.x - dx * drag.scale, y: drag.box.y - dy * drag.scale, w: drag.box.w, h: drag.box.h};
      apply();
    });
    svg.addEventListener("pointerup", function () {
      svg.classList.remove("dragging");
      drag = null;
    });
    svg.addEventListener("click", function () {  // a click on the background releases the pin
      if (pinned && !dragged) { pinned = null; focus(0, null); }
    });
    svg.addEventListener("dblclick", function () { view.fit(); });
  }

  data.forEach(function (graph, i) { views.push(draw(i, graph)); });
  Array.prototype.forEach.call(document.querySelectorAll("button.fit"), function (b) {
    b.addEventListener("click", function () { views[Number(b.getAttribute("data-graph"))].fit(); });
  });
  window.opfuseViewer = {ready: true, views: views, focus: focus};
})();
