// Draws a cluster's charts (charts.html) with the vendored uPlot, from the JSON document
// the page names in data-source, and reads it again data-every seconds after each read ends
// (one read at a time, however slow the server: a tab never piles requests up). Each status
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
  // The backlog's points kept: a tab left open for weeks draws its latest reads (about
  // 14 hours of them at the default 5 s) instead of growing without end.
  var BACKLOG_POINTS = 10000;
  var state = { doc: null, plots: {}, backlog: [[], [], []], reads: 0, error: null,
    estimated: { hour: [], day: [] } };
  window.cronoqCharts = state;

  // Text from the document as the server writes it in its pages (its terminal-safe rule):
  // controls, format characters (bidi, zero-width), line and paragraph separators and lone
  // surrogates as escapes, a backslash doubled. A status name a newer build wrote cannot
  // reorder or hide a legend.
  var HIDDEN = /[\p{Cc}\p{Cf}\p{Zl}\p{Zp}\p{Cs}\\]/gu;
  var NAMED = { "\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r" };
  function hex(code, digits) { return code.toString(16).padStart(digits, "0"); }
  function visible(text) {
    return String(text).replace(HIDDEN, function (c) {
      if (Object.prototype.hasOwnProperty.call(NAMED, c)) { return NAMED[c]; }
      var code = c.codePointAt(0);
      if (code <= 0xff) { return "\\x" + hex(code, 2); }
      return code <= 0xffff ? "\\u" + hex(code, 4) : "\\U" + hex(code, 8);
    });
  }
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
  // Times as the rest of the console writes them: UTC, 24-hour, ISO dates.
  function iso(ts) { return new Date(ts * 1e3).toISOString(); }
  function ticks(seconds) {
    return function (u, splits) {
      return splits.map(function (s) {
        var text = iso(s);
        if (seconds) { return text.slice(11, 19); }
        return text.slice(11, 16) === "00:00" ? text.slice(0, 10) : text.slice(11, 16);
      });
    };
  }
  var moment = { label: "UTC", value: function (u, v) {
    return v == null ? "-" : iso(v).slice(0, 19).replace("T", " ");
  } };
  function width(id) { return Math.max(document.getElementById(id).clientWidth, 300); }

  var OWN = Object.prototype.hasOwnProperty;
  function finishedData(doc, window_) {
    var buckets = doc[window_].buckets;
    var data = [buckets.map(function (b) { return b.start_unix_s; })];
    // Own keys only: a status a newer build wrote may be named "constructor" or "__proto__".
    doc.statuses.forEach(function (s) {
      data.push(buckets.map(function (b) { return OWN.call(b.per_minute, s) ? b.per_minute[s] : 0; }));
    });
    return data;
  }
  // A bucket that reached its bound is drawn at its estimated rate, with a point on it.
  function estimatedIn(doc, window_) {
    var found = [];
    doc[window_].buckets.forEach(function (b, i) { if (!b.complete) { found.push(i); } });
    return found;
  }
  function finishedOptions(doc, id, window_) {
    var series = [moment];
    // On the lines of the statuses the bucket holds, not on every line's zero.
    var marked = function (u, seriesIdx) {
      var found = state.estimated[window_].filter(function (i) { return u.data[seriesIdx][i] > 0; });
      return found.length ? found : null;
    };
    doc.statuses.forEach(function (s) {
      series.push({ label: visible(s), stroke: colour(s), width: 2,
        points: { show: false, filter: marked, size: 7 },
        value: function (u, v) { return v == null ? "-" : v.toFixed(1) + "/min"; } });
    });
    return { width: width(id), height: HEIGHT, tzDate: utc, series: series,
      scales: { y: { range: function (u, min, max) { return [0, Math.max(max, 1)]; } } },
      axes: [{ values: ticks(false) }, { label: "tasks per minute", size: 60 }] };
  }
  // Whole tasks and whole seconds on the backlog's axes.
  var COUNTS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5,
    5e5, 1e6, 2e6, 5e6, 1e7, 2e7, 5e7, 1e8];
  var SECONDS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 21600,
    43200, 86400, 172800, 604800, 2592000, 31536000];
  function backlogOptions(id) {
    return { width: width(id), height: HEIGHT, tzDate: utc,
      series: [moment, { label: "live tasks", stroke: colour("queued"), width: 2, scale: "n" },
        { label: "oldest's age", stroke: colour("retrying"), width: 2, scale: "s", dash: [6, 4],
          value: function (u, v) { return v == null ? "-" : ageWords(v); } }],
      scales: { n: { range: function (u, min, max) { return [0, Math.max(max, 1)]; } },
        s: { range: function (u, min, max) { return [0, Math.max(max, 60)]; } } },
      axes: [{ values: ticks(true), incrs: [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600] },
        { scale: "n", label: "live tasks", size: 60, incrs: COUNTS },
        { scale: "s", side: 1, label: "oldest's age", size: 70, grid: { show: false }, incrs: SECONDS,
          values: function (u, splits) { return splits.map(ageWords); } }] };
  }
  // The backlog's text, as the page rendered it, kept in step with the charts.
  function ageWords(seconds) {
    var whole = Math.max(0, Math.floor(seconds));
    var units = [["d", 86400], ["h", 3600], ["m", 60], ["s", 1]];
    for (var i = 0; i < units.length - 1; i++) {
      if (whole >= units[i][1]) {
        return Math.floor(whole / units[i][1]) + units[i][0] + " " +
          Math.floor(whole % units[i][1] / units[i + 1][1]) + units[i + 1][0];
      }
    }
    return whole + "s";
  }
  function thousands(n) { return n.toLocaleString("en-US"); }
  function backlogText(doc) {
    var b = doc.backlog, line = document.getElementById("backlog");
    var oldest = document.getElementById("oldest");
    if (!line || !oldest) { return; }
    var parts = [b.at_least
      ? "at least " + thousands(b.live) + " live tasks (counted among the newest " +
        thousands(b.sample) + (b.estimate === null ? "" : "; about " + thousands(b.estimate) +
        " by the planner's estimate") + ")"
      : thousands(b.live) + " live task" + (b.live === 1 ? "" : "s")];
    line.replaceChildren(parts[0]);
    b.by_status.forEach(function (r) {
      var badge = document.createElement("span");
      badge.className = "status status-" + (COLOURED.indexOf(r.status) >= 0 ? r.status : "other");
      badge.textContent = visible(r.status);
      line.append(" · ", badge, " " + thousands(r.count));
    });
    if (b.oldest === null) { oldest.replaceChildren("no live task"); return; }
    var link = document.createElement("a");
    link.href = "/clusters/" + encodeURIComponent(doc.schema) + "/task?id=" + b.oldest.id;
    link.textContent = String(b.oldest.id);
    oldest.replaceChildren("oldest live task: ", link, ", arrived " +
      b.oldest.arrival.slice(0, 19).replace("T", " ") + " UTC, waiting " +
      ageWords(b.oldest.age_seconds));
  }
  // The legend shows the newest point's values, and the hovered one's while hovering.
  function newest(u) {
    var n = u.data[0].length;
    if (n) { u.setLegend({ idx: n - 1 }, false); }
  }
  var keepNewest = { setCursor: [function (u) { if (u.cursor.left < 0) { newest(u); } }] };
  // A plot's series are fixed when it is made: when the statuses change (a newer build's
  // name appears, or leaves the window), the plot is made again, so that no line is drawn
  // under another status's name.
  var drawn = {};
  function draw(id, key, options, data, series) {
    var plot = state.plots[key];
    if (plot && drawn[key] === series) { plot.setData(data); } else {
      if (plot) { plot.destroy(); }
      options.hooks = keepNewest;
      plot = state.plots[key] = new uPlot(options, data, document.getElementById(id));
      drawn[key] = series;
    }
    newest(plot);
  }
  function show(text, stale) {
    if (!stamp) { return; }
    stamp.textContent = text;
    stamp.classList.toggle("stale", stale);
  }

  // Why the server refused a read, from its error document (the schema migrated since the
  // page opened, a role without SELECT, ...): what the page would say on a reload.
  async function reason(response) {
    try {
      var error = (await response.json()).error;
      if (typeof error !== "string") { return ""; }
      return ": " + visible(error.slice(0, 500));
    } catch (err) {
      return "";  // not the console's document (a proxy's page)
    }
  }
  // A read that has not ended after this long is given up (a connection gone quiet), so
  // that the next one can start.
  var PATIENCE_MS = Math.max(60, 2 * every) * 1000;
  async function load() {
    var abort = new AbortController();
    var timer = window.setTimeout(function () { abort.abort(); }, PATIENCE_MS);
    try {
      var response = await fetch(source, { credentials: "same-origin", cache: "no-store",
        signal: abort.signal });
      if (!response.ok) { throw new Error("HTTP " + response.status + (await reason(response))); }
      var doc = await response.json();
      var backlog = doc.backlog;
      state.backlog[0].push(Date.parse(doc.now) / 1e3);
      state.backlog[1].push(backlog.at_least && backlog.estimate !== null ? backlog.estimate : backlog.live);
      state.backlog[2].push(backlog.oldest === null ? null : backlog.oldest.age_seconds);
      state.backlog.forEach(function (line) { line.splice(0, line.length - BACKLOG_POINTS); });
      state.estimated = { hour: estimatedIn(doc, "hour"), day: estimatedIn(doc, "day") };
      var statuses = JSON.stringify(doc.statuses);
      draw("chart-hour", "hour", finishedOptions(doc, "chart-hour", "hour"), finishedData(doc, "hour"), statuses);
      draw("chart-day", "day", finishedOptions(doc, "chart-day", "day"), finishedData(doc, "day"), statuses);
      draw("chart-backlog", "backlog", backlogOptions("chart-backlog"), state.backlog, "");
      backlogText(doc);
      state.doc = doc;
      state.reads += 1;
      state.error = null;
      show("charts read " + new Date().toISOString().slice(11, 19) + " UTC", false);
    } catch (err) {
      state.error = String(err.message || err);
      show("charts not read: " + state.error, true);
    } finally {
      window.clearTimeout(timer);
    }
  }
  async function keepReading() {
    await load();
    if (every) { window.setTimeout(keepReading, every * 1000); }
  }
  window.addEventListener("resize", function () {
    Object.keys(state.plots).forEach(function (key) {
      var plot = state.plots[key];
      plot.setSize({ width: width("chart-" + key), height: HEIGHT });
    });
  });
  keepReading();
}());
