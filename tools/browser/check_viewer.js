// Opens an opfuse HTML dump in headless Chromium and measures what a person would see:
//   node check_viewer.js PAGE.html [SCREENSHOT.png] [--click NODE_ID]
// Prints one JSON object: console errors, every edge's end distances to its source and target
// boxes (and, into a node with several inputs, to the port labelled with its argument), edges
// passing through other boxes, text overflowing its box, and node/edge counts.
// Chromium: $CHROMIUM, else /usr/bin/chromium, else the one packaged in @sparticuz/chromium.
"use strict";
const fs = require("fs");
const path = require("path");
const puppeteer = require("puppeteer-core");

async function chromiumPath() {
  for (const candidate of [process.env.CHROMIUM, "/usr/bin/chromium", "/usr/bin/chromium-browser"]) {
    if (candidate && fs.existsSync(candidate)) return {exe: candidate, args: ["--no-sandbox"]};
  }
  const mod = require("@sparticuz/chromium");
  const chromium = mod.default || mod;
  return {exe: await chromium.executablePath(), args: chromium.args};
}

// Runs in the page: geometry of every edge and label, in viewport pixels.
function measure() {
  const out = {edges: [], overflow: [], nodes: 0, graphs: 0, engines: []};
  const dist = (p, r) => {  // distance from point p to the border of rect r
    const inside = p.x >= r.left && p.x <= r.right && p.y >= r.top && p.y <= r.bottom;
    if (inside) return Math.min(p.x - r.left, r.right - p.x, p.y - r.top, r.bottom - p.y);
    const dx = Math.max(r.left - p.x, 0, p.x - r.right), dy = Math.max(r.top - p.y, 0, p.y - r.bottom);
    return Math.hypot(dx, dy);
  };
  const strictlyInside = (p, r, m) => p.x > r.left + m && p.x < r.right - m && p.y > r.top + m && p.y < r.bottom - m;
  for (const view of window.opfuseViewer.views) {
    out.graphs += 1;
    out.engines.push(view.engine);
    const rects = {};
    for (const [id, g] of Object.entries(view.nodeEls)) {
      rects[id] = g.querySelector("rect").getBoundingClientRect();
      out.nodes += 1;
      for (const t of g.querySelectorAll("text")) {
        const b = t.getBoundingClientRect(), r = rects[id];
        if (b.left < r.left - 0.5 || b.right > r.right + 0.5 || b.top < r.top - 0.5 || b.bottom > r.bottom + 0.5) {
          out.overflow.push({graph: view.graph.title, node: id, text: t.textContent,
                             text_box: [b.left, b.top, b.right, b.bottom], node_box: [r.left, r.top, r.right, r.bottom]});
        }
      }
    }
    for (const e of view.edgeEls) {
      const src = e.getAttribute("data-src"), dst = e.getAttribute("data-dst");
      const m = e.getScreenCTM(), len = e.getTotalLength();
      const at = (s) => { const p = e.getPointAtLength(s); return new DOMPoint(p.x, p.y).matrixTransform(m); };
      const start = at(0), end = at(len);
      const through = new Set();
      for (let s = 4; s < len - 4; s += 3) {  // away from the two ends, the path must be in the open
        const p = at(s);
        for (const [id, r] of Object.entries(rects)) if (strictlyInside(p, r, 1.5)) through.add(id);
      }
      // A node with several inputs numbers its ports by argument: the edge must end at its own.
      const label = [...view.nodeEls[dst].querySelectorAll("text.port")]
        .find((t) => t.textContent === e.getAttribute("data-port"));
      let port = null;
      if (label) { const b = label.getBoundingClientRect(); port = Math.abs((b.left + b.right) / 2 - end.x); }
      out.edges.push({graph: view.graph.title, src, dst, start: dist(start, rects[src]), end: dist(end, rects[dst]),
                      through: [...through], port_dx: port});
    }
  }
  return out;
}

(async () => {
  const args = process.argv.slice(2);
  const clickAt = args.indexOf("--click");
  const click = clickAt >= 0 ? args.splice(clickAt, 2)[1] : null;
  const [page_path, shot] = args;
  const {exe, args: flags} = await chromiumPath();
  const browser = await puppeteer.launch({executablePath: exe, args: flags, headless: true,
                                          defaultViewport: {width: 1500, height: 980}});
  const errors = [];
  try {
    const page = await browser.newPage();
    page.on("console", (msg) => { if (msg.type() === "error") errors.push(msg.text()); });
    page.on("pageerror", (err) => errors.push(String(err)));
    page.on("requestfailed", (req) => errors.push(`request failed: ${req.url()}`));
    const external = [];
    page.on("request", (req) => { if (!req.url().startsWith("file:")) external.push(req.url()); });
    await page.goto("file://" + path.resolve(page_path), {waitUntil: "load"});
    await page.waitForFunction(() => window.opfuseViewer && window.opfuseViewer.ready, {timeout: 20000});
    const result = await page.evaluate(measure);
    if (click) {  // hover/click: the details panel names the node and its Python line
      await page.click(`g.node[data-id="${click}"]`);
      result.details = await page.evaluate(() => document.getElementById("details").innerText);
      result.highlight = await page.evaluate(() => ({
        producers: document.querySelectorAll("g.node.producer").length,
        consumers: document.querySelectorAll("g.node.consumer").length}));
    }
    if (shot) await page.screenshot({path: shot});
    result.errors = errors;
    result.external_requests = external;
    result.browser = await browser.version();
    process.stdout.write(JSON.stringify(result) + "\n");
  } finally {
    await browser.close();
  }
})().catch((err) => { console.error(String(err && err.stack || err)); process.exit(1); });
