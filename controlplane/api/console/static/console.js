// The console's one script: live updates from the watch stream, clocks, reveal and copy, confirmations.
// The pages work without it (plain forms and links); it makes them follow the database live.
"use strict";

(function () {
  // ---- time: "for 2 min 05 s" clocks and the "taking longer than expected" switch ----------------

  function duration(seconds) {
    var total = Math.max(0, Math.floor(seconds));
    if (seconds < 10) return Math.max(0, seconds).toFixed(1) + " s";
    var d = Math.floor(total / 86400), h = Math.floor((total % 86400) / 3600);
    var m = Math.floor((total % 3600) / 60), s = total % 60;
    var pad = function (n) { return (n < 10 ? "0" : "") + n; };
    if (d) return d + " d " + h + " h";
    if (h) return h + " h " + pad(m) + " min";
    if (m) return m + " min " + pad(s) + " s";
    return s + " s";
  }

  // The server's clock may differ from the browser's: the page says when it was rendered (server
  // time) and times are shown relative to that, plus what passed here since.
  var skewMs = 0;

  function tick() {
    var now = Date.now() - skewMs;
    document.querySelectorAll("[data-since]").forEach(function (el) {
      var since = Date.parse(el.getAttribute("data-since"));
      if (!isNaN(since)) el.textContent = duration((now - since) / 1000);
    });
    document.querySelectorAll("[data-expected-by]").forEach(function (el) {
      var by = Date.parse(el.getAttribute("data-expected-by"));
      if (!isNaN(by) && now > by) el.setAttribute("data-overdue", "");
    });
  }

  function syncClock(root) {
    var el = (root || document).querySelector("[data-server-now]");
    if (!el) return;
    var server = Date.parse(el.getAttribute("data-server-now"));
    if (!isNaN(server)) skewMs = Date.now() - server;
  }

  // ---- live: the watch stream's events fetch the page's live part again --------------------------

  function showAllowed(root) {
    var body = root.querySelector("[data-allowed]");
    if (!body) return;
    var allowed = (body.getAttribute("data-allowed") || "").split(" ");
    document.querySelectorAll("[data-action]").forEach(function (section) {
      section.hidden = allowed.indexOf(section.getAttribute("data-action")) < 0;
    });
  }

  // Where focus was inside the live part, to put it back once the part is replaced.
  function focusKey(el, live) {
    if (!el || !live.contains(el)) return null;
    if (el.hasAttribute("data-copy")) return '[data-copy="' + el.getAttribute("data-copy") + '"]';
    if (el.hasAttribute("data-reveal")) return "[data-reveal]";
    if (el.id) return "#" + el.id;
    return null;
  }

  function follow(live) {
    var status = document.querySelector("[data-live-status]");
    var say = function (text) { if (status) status.textContent = text; };
    var source = null, fetching = null, pending = false;
    var first = live.querySelector("[data-state]");
    var initialState = first ? first.getAttribute("data-state") : null;

    function refresh() {
      if (fetching) { pending = true; return; }
      fetching = fetch(live.getAttribute("data-live"), { credentials: "same-origin", cache: "no-store" })
        .then(function (response) {
          if (response.status === 401) { window.location.reload(); return null; }
          return response.ok ? response.text() : null;
        })
        .then(function (html) {
          if (html === null || html === undefined) return;
          var focus = focusKey(document.activeElement, live);
          var before = live.querySelector("[data-state]");
          var was = before ? before.getAttribute("data-state") : null;
          live.innerHTML = html;
          var badge = live.querySelector(".badge");
          if (badge && badge.getAttribute("data-state") !== was) say("Now " + badge.textContent + ".");
          syncClock(live);
          tick();
          showAllowed(live);
          if (focus) {
            var again = live.querySelector(focus);
            if (again) again.focus();
          }
          var body = live.querySelector("[data-terminal]");
          if (body && body.getAttribute("data-terminal") === "true" && source) {
            source.close();  // a terminal state changes no more: the stream has ended
            // What can be done with it now differs (remove, retry): the whole page says so.
            if (body.getAttribute("data-state") !== initialState) window.location.reload();
          }
        })
        .catch(function () { /* the stream's next event, or its reconnection, fetches again */ })
        .then(function () {
          fetching = null;
          if (pending) { pending = false; refresh(); }
        });
    }

    source = new EventSource(live.getAttribute("data-watch"));
    // The first event after (re)connecting is the snapshot: whatever was missed is caught up on.
    ["instance", "transition", "step"].forEach(function (name) {
      source.addEventListener(name, refresh);
    });
    var opened = 0;
    source.onopen = function () {
      opened += 1;
      if (status) status.setAttribute("data-connections", String(opened));  // how often it (re)connected
      say("Live: this page follows the database as it changes.");
    };
    source.onerror = function () {
      if (source.readyState === EventSource.CLOSED) return;
      say("Reconnecting to live updates…");  // EventSource reconnects by itself (with Last-Event-ID)
    };
  }

  // ---- the list: the organisation's stream fetches the list again; the filter and order re-query it --

  function followList(list) {
    var status = document.querySelector("[data-live-status]");
    var form = document.querySelector("[data-list-form]");
    var fetching = null, pending = false;

    function query() {
      if (!form) return window.location.search;
      var params = new URLSearchParams(new FormData(form));
      ["q", "show", "include"].forEach(function (name) { if (!params.get(name)) params.delete(name); });
      if (params.get("sort") === "newest") params.delete("sort");
      var text = params.toString();
      return text ? "?" + text : "";
    }

    function refresh() {
      if (fetching) { pending = true; return; }
      var search = query();
      fetching = fetch(list.getAttribute("data-list-live") + search, { credentials: "same-origin", cache: "no-store" })
        .then(function (response) {
          if (response.status === 401) { window.location.reload(); return null; }
          return response.ok ? response.text() : null;
        })
        .then(function (html) {
          if (html === null || html === undefined) return;
          // Keep what the person opened (a folded group) and where focus was (a row's link).
          var open = Array.prototype.map.call(list.querySelectorAll("details[open]"), function (d) { return d.id; });
          var focused = list.contains(document.activeElement) ? document.activeElement.getAttribute("href") : null;
          list.innerHTML = html;
          open.forEach(function (id) { var d = id && document.getElementById(id); if (d) d.open = true; });
          if (focused) { var again = list.querySelector('a[href="' + focused + '"]'); if (again) again.focus(); }
          syncClock(list);
          tick();
        })
        .catch(function () { /* the next event, or the stream's reconnection, fetches again */ })
        .then(function () {
          fetching = null;
          if (pending) { pending = false; refresh(); }
        });
    }

    if (form) {
      var timer = null;
      var apply = function () {
        window.history.replaceState(null, "", window.location.pathname + query());
        refresh();
      };
      form.addEventListener("input", function () { clearTimeout(timer); timer = setTimeout(apply, 200); });
      form.addEventListener("change", apply);
      form.addEventListener("submit", function (event) { event.preventDefault(); apply(); });
    }
    if (!window.EventSource) return;
    var source = new EventSource(list.getAttribute("data-list-watch"));
    // `list` after each (re)connection (whatever was missed), `transition` per change of a database.
    ["list", "transition"].forEach(function (name) { source.addEventListener(name, refresh); });
    var opened = 0;
    source.onopen = function () {
      opened += 1;
      if (status) status.setAttribute("data-connections", String(opened));
    };
  }

  // ---- reveal and copy ----------------------------------------------------------------------------

  function revealed(panel) {
    if (panel._formats) return Promise.resolve(panel._formats);
    return fetch(panel.getAttribute("data-connection"), { credentials: "same-origin", cache: "no-store" })
      .then(function (response) {
        if (!response.ok) throw new Error("the connection details cannot be read now");
        return response.json();
      })
      .then(function (formats) { panel._formats = formats; return formats; });
  }

  function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
    var area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    var ok = document.execCommand("copy");
    document.body.removeChild(area);
    return ok ? Promise.resolve() : Promise.reject(new Error("copy is not available here"));
  }

  function announce(near, text) {
    var scope = near.closest("section") || document;
    var status = scope.querySelector("[data-copy-status]");
    if (status) status.textContent = text;
  }

  function flash(button, text) {
    var original = button.getAttribute("data-label") || button.textContent;
    button.setAttribute("data-label", original);
    button.textContent = text;
    setTimeout(function () { button.textContent = original; }, 1500);
  }

  document.addEventListener("click", function (event) {
    var button = event.target.closest("button");
    if (!button) return;
    var panel = button.closest("[data-connection]");
    if (button.hasAttribute("data-reveal") && panel) {
      var shown = button.getAttribute("aria-pressed") === "true";
      if (shown) {
        panel.querySelectorAll("[data-format]").forEach(function (code) {
          code.textContent = code.getAttribute("data-masked") || code.textContent;
        });
        button.setAttribute("aria-pressed", "false");
        button.textContent = "Reveal password";
        return;
      }
      revealed(panel).then(function (formats) {
        panel.querySelectorAll("[data-format]").forEach(function (code) {
          if (!code.hasAttribute("data-masked")) code.setAttribute("data-masked", code.textContent);
          code.textContent = formats[code.getAttribute("data-format")];
        });
        button.setAttribute("aria-pressed", "true");
        button.textContent = "Hide password";
      }, function (error) { announce(button, error.message); });
      return;
    }
    if (button.hasAttribute("data-copy") && panel) {
      revealed(panel)
        .then(function (formats) { return copyText(formats[button.getAttribute("data-copy")]); })
        .then(function () { flash(button, "Copied"); announce(button, "Copied, with the password."); },
              function (error) { announce(button, "Not copied: " + error.message); });
      return;
    }
    if (button.hasAttribute("data-copy-target")) {
      var source = document.getElementById(button.getAttribute("data-copy-target"));
      if (source) copyText(source.textContent).then(function () {
        flash(button, "Copied");
        announce(button, "Copied.");
      }, function (error) { announce(button, "Not copied: " + error.message); });
    }
  });

  // ---- forms: type-the-name confirmation, confirm dialogs, one submission -------------------------

  function confirmState(form) {
    var input = form.querySelector("[data-confirm-name]");
    var submit = form.querySelector("[data-confirm-submit]");
    if (input && submit) submit.disabled = input.value.trim() !== input.getAttribute("data-confirm-name");
  }

  document.addEventListener("input", function (event) {
    var form = event.target.closest("[data-confirm-form]");
    if (form) confirmState(form);
  });

  document.addEventListener("submit", function (event) {
    var form = event.target;
    var question = form.getAttribute("data-confirm");
    if (question && !window.confirm(question)) { event.preventDefault(); return; }
    if (form.hasAttribute("data-once")) {
      if (form._sent) { event.preventDefault(); return; }
      form._sent = true;
      form.querySelectorAll("button[type=submit]").forEach(function (b) { b.setAttribute("aria-disabled", "true"); });
    }
  });

  document.addEventListener("DOMContentLoaded", function () {
    syncClock(document);
    tick();
    setInterval(tick, 1000);
    document.querySelectorAll("[data-confirm-form]").forEach(confirmState);
    var live = document.querySelector("[data-watch]");
    if (live && window.EventSource) follow(live);
    var list = document.querySelector("[data-list-live]");
    if (list) followList(list);
  });
})();
