// Times on the console's pages: the server writes <time datetime="...Z" title="exact UTC">
// with a relative text ("3 min ago", formats.ago); here the title becomes the exact time in
// the viewer's own zone, and the relative text is kept current as time passes (the same
// rules as the server's). A <time class="exact"> shows the exact time and titles the
// relative one. No inline script: the Content-Security-Policy allows none.
(function () {
  "use strict";
  var WORDS = {
    en: { past: "{n} {u} ago", future: "in {n} {u}", now: "just now",
          units: { s: "s", min: "min", h: "h", d: "d" }, locale: "en-GB" },
    zh: { past: "{n} {u}前", future: "{n} {u}后", now: "刚刚",
          units: { s: "秒", min: "分钟", h: "小时", d: "天" }, locale: "zh-CN" }
  };

  function words() {
    return WORDS[document.documentElement.lang] || WORDS.en;
  }

  function relative(at, now, w) {
    var seconds = Math.trunc((now - at) / 1000), size = Math.abs(seconds), n, u;
    if (size < 10) return w.now;
    if (size < 60) { n = size; u = "s"; }
    else if (size < 3600) { n = Math.floor(size / 60); u = "min"; }
    else if (size < 86400) { n = Math.floor(size / 3600); u = "h"; }
    else { n = Math.floor(size / 86400); u = "d"; }
    return (seconds >= 0 ? w.past : w.future).replace("{n}", n).replace("{u}", w.units[u]);
  }

  function local(at, w) {
    return at.toLocaleString(w.locale, {
      year: "numeric", month: "2-digit", day: "2-digit", hour: "2-digit", minute: "2-digit",
      second: "2-digit", hour12: false, timeZoneName: "short"
    });
  }

  function refresh(root) {
    var w = words(), now = Date.now();
    var times = (root || document).querySelectorAll("time[datetime]");
    for (var i = 0; i < times.length; i++) {
      var el = times[i], at = new Date(el.getAttribute("datetime"));
      if (isNaN(at.getTime())) continue;
      if (el.classList.contains("exact")) {
        el.textContent = local(at, w);
        el.title = relative(at, now, w);
      } else {
        el.textContent = relative(at, now, w);
        el.title = local(at, w);
      }
    }
  }

  document.addEventListener("DOMContentLoaded", function () { refresh(document); });
  document.addEventListener("htmx:load", function (e) { refresh(e.target); });  // swapped-in parts
  setInterval(function () { refresh(document); }, 15000);
})();
