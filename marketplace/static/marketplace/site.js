/* Small progressive enhancements; every page works without them.
 *
 * 1. Live regions: an element with data-poll-url is refreshed every data-poll-interval ms (default 2000).
 *    The URL answers with HTML whose top-level elements carry data-slot="NAME"; each one replaces the
 *    content of the element with the same data-slot inside the polled element, only when it changed (so a
 *    screen reader's aria-live region announces real changes only). An answer with the header
 *    X-Poll-Stop: 1 ends the polling (the thing reached a state nobody is waiting on); X-Poll-Interval sets
 *    the next wait in ms. A slot with data-reload reloads the whole page (what was awaited has finished and
 *    the rest of the page changed too).
 * 2. Copy buttons: <button data-copy="#id"> copies the text of #id and says so in its own live region.
 * 3. <details data-close-on-narrow> starts closed on a phone-sized screen (unless it has data-active), so the
 *    results come first; it stays open on wider screens and without JavaScript.
 * 4. The rent page's #estimate follows the number of GPUs (or MIG slices) typed and the profile chosen: the same sums the server made for the first
 *    figure (marketplace/web/renters.py _estimate), rates with their significant decimals as the `usd_rate` filter
 *    shows them; the balance panel above it (#funds) takes the server's words for the chosen profile.
 * 5. A table wider than its box (.table-wrap scrolls sideways, on a phone) becomes a focusable region named
 *    after its table, so that it can be scrolled from the keyboard too; one that fits is no tab stop.
 * 6. The navigation (base.html, marketplace/web/nav.py): on a phone its links fold behind one "Menu" button
 *    (aria-expanded); its menus (<details class="nav-group">) close when another opens, on Escape and on a click
 *    elsewhere. Without JavaScript every link shows and the menus open and close as plain <details>.
 */
(function () {
  "use strict";

  function applySlots(container, html) {
    var tpl = document.createElement("template");
    tpl.innerHTML = html;
    var changed = false;
    if (tpl.content.querySelector("[data-reload]")) { window.location.reload(); return false; }
    tpl.content.querySelectorAll("[data-slot]").forEach(function (fresh) {
      var name = fresh.getAttribute("data-slot");
      var target = container.querySelector('[data-slot="' + name + '"]');
      if (target && target.innerHTML.trim() !== fresh.innerHTML.trim()) {
        target.innerHTML = fresh.innerHTML;
        Array.prototype.forEach.call(fresh.attributes, function (attr) {
          if (attr.name.indexOf("data-") === 0 && attr.name !== "data-slot") target.setAttribute(attr.name, attr.value);
        });
        changed = true;
      }
    });
    return changed;
  }

  function startPolling(container) {
    var url = container.getAttribute("data-poll-url");
    var every = parseInt(container.getAttribute("data-poll-interval") || "2000", 10);
    if (container.getAttribute("data-poll-stop") === "1") return;
    function tick() {
      fetch(url, { credentials: "same-origin", headers: { "X-Requested-With": "fetch" }, cache: "no-store" })
        .then(function (response) {
          if (!response.ok) throw new Error("HTTP " + response.status);
          var stop = response.headers.get("X-Poll-Stop") === "1";
          var next = parseInt(response.headers.get("X-Poll-Interval") || "", 10) || every;
          return response.text().then(function (html) {
            if (applySlots(container, html)) wireCopyButtons(container);
            container.setAttribute("data-polled-at", new Date().toISOString());
            if (!stop) window.setTimeout(tick, next);
            else container.setAttribute("data-poll-stop", "1");
          });
        })
        .catch(function () { window.setTimeout(tick, every * 2); });
    }
    window.setTimeout(tick, every);
  }

  function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
    var area = document.createElement("textarea");
    area.value = text; area.setAttribute("readonly", ""); area.style.position = "absolute"; area.style.left = "-9999px";
    document.body.appendChild(area); area.select();
    try { document.execCommand("copy"); } finally { document.body.removeChild(area); }
    return Promise.resolve();
  }

  function wireCopyButtons(root) {
    root.querySelectorAll("button[data-copy]").forEach(function (button) {
      if (button.dataset.wired) return;
      button.dataset.wired = "1";
      button.hidden = false;
      button.addEventListener("click", function () {
        var source = document.querySelector(button.getAttribute("data-copy"));
        if (!source) return;
        var said = button.parentNode.querySelector(".copy-status");
        copyText(source.textContent.trim()).then(function () {
          if (said) said.textContent = "Copied to the clipboard.";
        }, function () {
          if (said) said.textContent = "Could not copy: select the text and copy it by hand.";
        });
      });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    if (window.matchMedia && window.matchMedia("(max-width: 47.99rem)").matches) {
      document.querySelectorAll("details[data-close-on-narrow]:not([data-active])").forEach(function (d) { d.open = false; });
    }
    wireCopyButtons(document);
    document.querySelectorAll("[data-poll-url]").forEach(startPolling);
    wireEstimate();
    wireNav();
    wireScrollers();
    window.addEventListener("resize", function () { window.clearTimeout(wireScrollers.timer); wireScrollers.timer = window.setTimeout(wireScrollers, 200); });
  });
  function wireScrollers() {
    document.querySelectorAll(".table-wrap").forEach(function (box) {
      if (box.scrollWidth > box.clientWidth + 1) {
        var table = box.querySelector("table");
        var caption = table && table.querySelector("caption");
        var heading = box.closest("section") && box.closest("section").querySelector("h2, h3");
        var name = (caption || heading || {}).textContent || "Table";
        box.setAttribute("tabindex", "0");
        box.setAttribute("role", "region");
        box.setAttribute("aria-label", name.trim().replace(/\s+/g, " ") + " (scrolls sideways)");
      } else if (box.getAttribute("role") === "region") {
        box.removeAttribute("tabindex"); box.removeAttribute("role"); box.removeAttribute("aria-label");
      }
    });
  }
  function wireNav() {
    var nav = document.getElementById("site-nav");
    var toggle = nav && nav.querySelector(".nav-toggle");
    if (!nav || !toggle) return;
    var groups = nav.querySelectorAll("details.nav-group");
    function closeGroups(except) {
      groups.forEach(function (d) { if (d !== except) d.open = false; });
    }
    function setOpen(open) {
      toggle.setAttribute("aria-expanded", open ? "true" : "false");
      nav.classList.toggle("nav-open", open);
    }
    nav.classList.add("nav-js");
    toggle.hidden = false;
    toggle.addEventListener("click", function () { setOpen(toggle.getAttribute("aria-expanded") !== "true"); });
    groups.forEach(function (d) {
      d.addEventListener("toggle", function () { if (d.open) closeGroups(d); });
    });
    document.addEventListener("click", function (event) {
      if (!nav.contains(event.target)) { closeGroups(null); setOpen(false); }
      else groups.forEach(function (d) { if (d.open && !d.contains(event.target)) d.open = false; });
    });
    document.addEventListener("keydown", function (event) {
      if (event.key !== "Escape") return;
      var open = nav.querySelector("details.nav-group[open]");
      if (open) { open.open = false; open.querySelector("summary").focus(); }
      else if (toggle.getAttribute("aria-expanded") === "true") { setOpen(false); toggle.focus(); }
    });
  }
  function wireEstimate() {
    var box = document.getElementById("estimate");
    var input = document.getElementById("id_num_gpus");
    if (!box || !input) return;
    var price = Number(box.getAttribute("data-price-micros"));
    var committed = Number(box.getAttribute("data-committed-micros"));
    var balance = Number(box.getAttribute("data-balance-micros"));
    /* Rates with every significant decimal, at least two: the `usd_rate` filter's words (core.money.usd_rate_text). */
    var money = new Intl.NumberFormat("en-US", { style: "currency", currency: "USD", minimumFractionDigits: 2,
                                                 maximumFractionDigits: 6 });
    function usdRate(micros) { return money.format(micros / 1000000); }
    function duration(s) {  /* the `duration` filter's words */
      var d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600), m = Math.floor(s % 3600 / 60), sec = s % 60;
      function two(n) { return (n < 10 ? "0" : "") + n; }
      if (d) return d + " d " + h + " h";
      if (h) return m ? h + " h " + two(m) + " min" : h + " h";
      if (m) return m + " min " + two(sec) + " s";
      return sec + " s";
    }
    function set(name, text) {
      var el = box.querySelector('[data-est="' + name + '"]');
      if (el && el.textContent !== text) el.textContent = text;
    }
    /* With MIG slices on offer: the price and the unit follow the chosen profile ("" = whole GPUs). */
    var prices = JSON.parse(box.getAttribute("data-unit-prices") || "null");
    var unit = "GPU", per = "GPU";
    function chooseProfile(profile) {
      if (!prices || !(profile in prices)) return;
      price = prices[profile];
      unit = profile ? "MIG " + profile + " slice" : "GPU";
      per = profile ? "slice" : "GPU";
      set("unit-price", usdRate(price) + " per " + per + "-hour");
      fundsFor(profile);
      update();
    }
    /* The balance panel's "Renting needs ... per GPU/slice" and "Top up first" follow the profile too: the server's
       own words for each one (renters._funds_by_unit), swapped in. */
    var fundsBox = document.getElementById("funds");
    var fundsWords = fundsBox ? JSON.parse(fundsBox.getAttribute("data-by-unit") || "null") : null;
    function fundsFor(profile) {
      if (!fundsWords || !(profile in fundsWords)) return;
      var words = fundsWords[profile];
      fundsBox.querySelectorAll("[data-funds]").forEach(function (el) {
        var key = el.getAttribute("data-funds");
        if (key === "missing_line") el.hidden = !words.missing;
        else if (key === "top_up") el.setAttribute("href", fundsBox.getAttribute("data-top-up-url") + "?amount=" + words.top_up);
        else if (key in words && el.textContent !== String(words[key])) el.textContent = words[key];
      });
      fundsBox.classList.toggle("warning", Boolean(words.missing));
    }
    function update() {
      var n = parseInt(input.value, 10);
      var max = parseInt(input.getAttribute("max") || "0", 10);
      if (!(n >= 1) || (max && n > max)) return;  /* the form says what is wrong when it is sent */
      var total = committed + n * price;
      set("gpus", n + " " + unit + (n === 1 ? "" : "s"));
      set("per-hour", usdRate(n * price));
      set("total", usdRate(total));
      set("lasts", balance > 0 && total ? "about " + duration(Math.floor(balance * 3600 / total)) : "no time: top up first");
    }
    input.addEventListener("input", update);
    document.querySelectorAll('input[name="mig_profile"]').forEach(function (radio) {
      radio.addEventListener("change", function () { if (radio.checked) chooseProfile(radio.value); });
      /* A profile already chosen when the page opens (an offer whose GPUs are all split, a Rent link from offers
         filtered by a profile, the form shown again after an error): its price and unit, not the whole GPU's. */
      if (radio.checked) chooseProfile(radio.value);
    });
  }
})();
