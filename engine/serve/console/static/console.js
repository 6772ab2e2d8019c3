// runbook console: local times (UTC on hover) and live updates of a run through server-sent events.
"use strict";
function localize(root) {
  root.querySelectorAll("time[datetime]").forEach(function (t) {
    var d = new Date(t.getAttribute("datetime"));
    if (!isNaN(d.getTime())) {
      t.textContent = d.toLocaleString();
      t.title = t.getAttribute("datetime") + " (UTC)";
    }
  });
}
document.addEventListener("DOMContentLoaded", function () {
  localize(document);
  var live = document.getElementById("live");
  if (!live || !live.dataset.stream || live.dataset.final || !window.EventSource) { return; }
  var es = new EventSource(live.dataset.stream);
  es.addEventListener("update", function (e) {
    live.innerHTML = e.data;
    localize(live);
    live.dataset.updates = String(Number(live.dataset.updates || "0") + 1);
  });
  es.addEventListener("end", function () { es.close(); live.dataset.final = "1"; });
});
