// Draws a cluster's charts (charts.html) with the vendored uPlot, from the JSON document
// the page names in data-source, and reads it again every data-every seconds. Each status
// is drawn in the colour of its badge (read from console.css, so the two cannot drift).
// The page's numbers are also in its tables, which work without this script.
// window.cronoqCharts holds the last document read and the plots, for the browser tests.
"use strict";
(function () {
  var section = document.getElementById("charts");
  if (!section || typeof uPlot === "undefined") { return; }
  var source = section.dataset.source;
  var every = Number(section.dataset.every || 0);
  var stamp = document.getElementById("refreshed");
  var HEIGHT = 220;
  var state = { doc: null, plots: {}, backlog: [[], [], []], reads: 0, error: null };
  window.cronoqCharts = state;

  var COLOURED = ["succeeded", "failed", "cancelled", "skipped", "expired", "running", "retrying", "queued"];
  function colour(status) {
    var probe = document.createElement("span");
    probe.className = "status status-" + (COLOURED.indexOf(status) >= 0 ? status : "other");
    probe.hidden = true;
    document.body.appendChild(probe);
    var found = window.getComputedStyle(probe).color;
    probe.remove();
    return found;
  }
  function utc(ts) { return uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"); }
  function width(id) { return Math.max(document.getElementById(id).clientWidth, 300); }

  function finishedData(doc, window_) {
    var buckets = doc[window_].buckets;
    var data = [buckets.map(function (b) { return b.start_unix_s; })];
    doc.statuses.forEach(function (s) {
      data.push(buckets.map(function (b) { return b.per_minute[s] || 0; }));
    });
    return data;
  }
  function finishedOptions(doc, id) {
    var series = [{}];
    doc.statuses.forEach(function (s) {
      series.push({ label: s, stroke: colour(s), width: 2, points: { show: false },
        value: function (u, v) { return v == null ? "-" : v.toFixed(1) + "/min"; } });
    });
    return { width: width(id), height: HEIGHT, tzDate: utc, series: series,
      scales: { y: { range: function (u, min, max) { return [0, Math.max(max, 1)]; } } },
      axes: [{}, { label: "tasks per minute", size: 60 }] };
  }
  function backlogOptions(id) {
    return { width: width(id), height: HEIGHT, tzDate: utc,
      series: [{}, { label: "live tasks", stroke: colour("queued"), width: 2, scale: "n" },
        { label: "oldest's age (s)", stroke: colour("retrying"), width: 2, scale: "s", dash: [6, 4] }],
      scales: { n: { range: function (u, min, max) { return [0, Math.max(max, 1)]; } },
        s: { range: function (u, min, max) { return [0, Math.max(max, 1)]; } } },
      axes: [{}, { scale: "n", label: "live tasks", size: 60 },
        { scale: "s", side: 1, label: "age, s", size: 60, grid: { show: false } }] };
  }
  function draw(id, key, options, data) {
    var plot = state.plots[key];
    if (plot) { plot.setData(data); return; }
    state.plots[key] = new uPlot(options, data, document.getElementById(id));
  }
  function show(text, stale) {
    if (!stamp) { return; }
    stamp.textContent = text;
    stamp.classList.toggle("stale", stale);
  }

  async function load() {
    try {
      var response = await fetch(source, { credentials: "same-origin", cache: "no-store" });
      if (!response.ok) { throw new Error("HTTP " + response.status); }
      var doc = await response.json();
      var backlog = doc.backlog;
      state.backlog[0].push(Date.parse(doc.now) / 1e3);
      state.backlog[1].push(backlog.at_least && backlog.estimate !== null ? backlog.estimate : backlog.live);
      state.backlog[2].push(backlog.oldest === null ? null : backlog.oldest.age_seconds);
      draw("chart-hour", "hour", finishedOptions(doc, "chart-hour"), finishedData(doc, "hour"));
      draw("chart-day", "day", finishedOptions(doc, "chart-day"), finishedData(doc, "day"));
      draw("chart-backlog", "backlog", backlogOptions("chart-backlog"), state.backlog);
      state.doc = doc;
      state.reads += 1;
      state.error = null;
      show("charts read " + new Date().toISOString().slice(11, 19) + " UTC", false);
    } catch (err) {
      state.error = String(err.message || err);
      show("charts not read: " + state.error, true);
    }
  }
  window.addEventListener("resize", function () {
    Object.keys(state.plots).forEach(function (key) {
      var plot = state.plots[key];
      plot.setSize({ width: width("chart-" + key), height: HEIGHT });
    });
  });
  load();
  if (every) { window.setInterval(load, every * 1000); }
}());
