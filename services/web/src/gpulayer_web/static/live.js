// Live updates without a library: every few seconds, ask this same page for its live part
// (the server answers from its cache, so viewers cost placement nothing) and swap it in.
// Paused while the tab is hidden.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) return;
  var every = Number(document.body.dataset.refreshMs) || 2000;
  function tick() {
    if (document.hidden) { setTimeout(tick, every); return; }
    fetch(location.href, { headers: { "X-Live": "1" }, cache: "no-store" })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) { if (html !== null) live.innerHTML = html; })
      .catch(function () { /* the service restarts: try again next time */ })
      .then(function () { setTimeout(tick, every); });
  }
  setTimeout(tick, every);
})();
