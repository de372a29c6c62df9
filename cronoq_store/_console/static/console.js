// Refreshes a page that asks for it (data-refresh="SECONDS" on <body>): fetches the page
// again and swaps its <main>, SECONDS after the last refresh ended (one at a time, however
// slow the server: a tab never piles requests up). The new content is the server's escaped HTML, parsed inert
// (DOMParser runs no script), and the page's policy forbids inline script anyway.
"use strict";
(function () {
  var seconds = Number(document.body.dataset.refresh || 0);
  var stamp = document.getElementById("refreshed");
  if (!seconds) { return; }
  function show(text, stale) {
    stamp.textContent = text;
    stamp.classList.toggle("stale", stale);
  }
  function busy() {
    // Never replace a form the operator is typing into.
    var active = document.activeElement;
    return active && (active.tagName === "INPUT" || active.tagName === "SELECT");
  }
  // A refresh that has not ended after this long is given up (a connection gone quiet), so
  // that the next one can start.
  var PATIENCE_MS = Math.max(60, 2 * seconds) * 1000;
  // Whether to go on refreshing.
  async function refresh() {
    if (busy()) { return true; }
    var abort = new AbortController();
    var timer = window.setTimeout(function () { abort.abort(); }, PATIENCE_MS);
    try {
      var response = await fetch(window.location.href, { credentials: "same-origin",
        cache: "no-store", signal: abort.signal });
      var page = new DOMParser().parseFromString(await response.text(), "text/html");
      if (!response.ok) {
        // The reason the console's error page gives (already written safe by the server),
        // or the status alone for any other page (a proxy's).
        var reason = page.getElementById("error");
        throw new Error("HTTP " + response.status +
          (reason ? ": " + reason.textContent.slice(0, 500) : ""));
      }
      var fresh = page.getElementById("live");
      if (fresh && !busy()) {
        document.getElementById("live").replaceChildren(...Array.from(fresh.childNodes).map(function (n) { return document.importNode(n, true); }));
      }
      if (!page.body.dataset.refresh) {
        // The page is final (a prune that ended): stop asking.
        show("final " + new Date().toISOString().slice(11, 19) + " UTC", false);
        return false;
      }
      show("refreshed " + new Date().toISOString().slice(11, 19) + " UTC", false);
    } catch (err) {
      show("not refreshed: " + err.message, true);
    } finally {
      window.clearTimeout(timer);
    }
    return true;
  }
  async function keepRefreshing() {
    if (await refresh()) { window.setTimeout(keepRefreshing, seconds * 1000); }
  }
  show("refreshes every " + seconds + " s", false);
  window.setTimeout(keepRefreshing, seconds * 1000);
}());
