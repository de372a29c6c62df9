// Refreshes a page that asks for it (data-refresh="SECONDS" on <body>): fetches the page
// again and swaps its <main>. The new content is the server's escaped HTML, parsed inert
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
  async function refresh() {
    if (busy()) { return; }
    try {
      var response = await fetch(window.location.href, { credentials: "same-origin", cache: "no-store" });
      if (!response.ok) { throw new Error("HTTP " + response.status); }
      var page = new DOMParser().parseFromString(await response.text(), "text/html");
      var fresh = page.getElementById("live");
      if (fresh && !busy()) {
        document.getElementById("live").replaceChildren(...Array.from(fresh.childNodes).map(function (n) { return document.importNode(n, true); }));
      }
      if (!page.body.dataset.refresh) {
        // The page is final (a prune that ended): stop asking.
        window.clearInterval(timer);
        show("final " + new Date().toISOString().slice(11, 19) + " UTC", false);
        return;
      }
      show("refreshed " + new Date().toISOString().slice(11, 19) + " UTC", false);
    } catch (err) {
      show("not refreshed: " + err.message, true);
    }
  }
  show("refreshes every " + seconds + " s", false);
  var timer = window.setInterval(refresh, seconds * 1000);
}());
