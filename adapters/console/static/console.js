// Live updates of the console's pages (ADR 0020): the server's event stream says when the
// store changed, and each live region refreshes itself (htmx, hx-trigger "ql3:changed").
// Without a stream the regions poll on their own. No inline script: this file is all there is.
(function () {
  "use strict";
  function start() {
    var body = document.body;
    if (!body || !document.querySelector(".live") || !window.EventSource || !window.htmx) {
      return;
    }
    var source = new EventSource(body.getAttribute("data-events"));
    source.addEventListener("changed", function () {
      window.htmx.trigger(body, "ql3:changed");
    });
    source.addEventListener("open", function () {
      body.setAttribute("data-live", "connected");
    });
    source.addEventListener("error", function () {
      body.setAttribute("data-live", "polling");
    });
    window.addEventListener("pagehide", function () { source.close(); });
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
