// A small SVG line chart for time series (no library): horizontal grid with y labels, a time axis over the last
// `spanS` seconds, one polyline per series (gaps where a value is null), a legend with the latest values.
// After each update the <svg> carries data-points (points drawn) and data-last (JSON of the latest values), which
// the browser tests read.

const NS = "http://www.w3.org/2000/svg";
const H = 170;
const PAD = { left: 48, right: 8, top: 8, bottom: 20 };

function svgEl(tag, attrs = {}) {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

// A "nice" upper bound for the axis: 1, 2, 2.5 or 5 times a power of ten, at least `max`.
export function niceMax(max) {
  if (!(max > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(max));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= max * 1.0001) return m * p;
  return 10 * p;
}

export class LineChart {
  // series: [{key, label, color}], format(v) -> string, yMax: a fixed top (e.g. 1 for fractions) or null (auto),
  // integer: values are counts (the grid's four steps stay whole numbers).
  constructor(svg, legend, { series, format = (v) => String(v), yMax = null, spanS = 300, integer = false }) {
    this.integer = integer;
    this.svg = svg;
    this.legend = legend;
    this.series = series;
    this.format = format;
    this.yMax = yMax;
    this.spanS = spanS;
    svg.classList.add("chart");
    this.legendValues = [];
    legend.replaceChildren();
    for (const s of series) {
      const sw = document.createElement("span");
      sw.className = "sw";
      sw.style.background = s.color;
      const val = document.createElement("span");
      val.className = "val";
      val.textContent = "–";
      const item = document.createElement("span");
      item.append(sw, document.createTextNode(s.label + " "), val);
      legend.append(item);
      this.legendValues.push(val);
    }
  }

  // times: Unix seconds (ascending); data: {key: [value or null, ...]} aligned with times; now: Unix seconds.
  update(times, data, now) {
    const svg = this.svg;
    // Drawn in CSS pixels of the chart's current width, so text is never stretched.
    const W = Math.max(200, Math.round(svg.getBoundingClientRect().width) || 600);
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const t1 = now;
    const t0 = now - this.spanS;
    let max = 0;
    for (const s of this.series) {
      for (let i = 0; i < times.length; i++) {
        const v = data[s.key] ? data[s.key][i] : null;
        if (times[i] >= t0 && v !== null && v !== undefined && v > max) max = v;
      }
    }
    let top = this.yMax !== null ? Math.max(this.yMax, max) : niceMax(max);
    if (this.integer) top = Math.max(4, Math.ceil(top / 4) * 4);
    const x = (t) => PAD.left + ((t - t0) / (t1 - t0)) * (W - PAD.left - PAD.right);
    const y = (v) => H - PAD.bottom - (v / top) * (H - PAD.top - PAD.bottom);
    const nodes = [];
    for (let k = 0; k <= 4; k++) {
      const v = (top * k) / 4;
      nodes.push(svgEl("line", { class: "grid", x1: PAD.left, x2: W - PAD.right, y1: y(v), y2: y(v) }));
      const label = svgEl("text", { class: "axis", x: PAD.left - 4, y: y(v) + 3, "text-anchor": "end" });
      label.textContent = this.format(v);
      nodes.push(label);
    }
    for (let m = 0; m <= this.spanS / 60; m++) {
      const t = t1 - m * 60;
      const label = svgEl("text", { class: "axis", x: x(t), y: H - 5, "text-anchor": m === 0 ? "end" : "middle" });
      label.textContent = m === 0 ? "now" : `-${m}m`;
      nodes.push(label);
    }
    let drawn = 0;
    const last = {};
    this.series.forEach((s, idx) => {
      const vals = data[s.key] || [];
      let d = "";
      let pen = false;
      let lastV = null;
      for (let i = 0; i < times.length; i++) {
        const v = vals[i];
        if (times[i] < t0 || v === null || v === undefined || !Number.isFinite(v)) { pen = false; continue; }
        d += `${pen ? "L" : "M"}${x(times[i]).toFixed(1)},${y(v).toFixed(1)}`;
        pen = true;
        drawn++;
        lastV = v;
      }
      const path = svgEl("path", { class: "line", d: d || "M0,0", "data-key": s.key });
      path.style.stroke = s.color;
      nodes.push(path);
      last[s.key] = lastV;
      this.legendValues[idx].textContent = lastV === null ? "–" : this.format(lastV);
    });
    svg.replaceChildren(...nodes);
    svg.dataset.points = String(drawn);
    svg.dataset.last = JSON.stringify(last);
    svg.dataset.max = String(max);
  }
}
