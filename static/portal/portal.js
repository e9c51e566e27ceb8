/* gpushare portal: copy buttons, a log that follows, live charts. Plain JS, no build step. */
(function () {
  "use strict";

  // --- no inline handlers (the content security policy forbids them):
  // <form data-confirm="Really?"> asks before submitting; <button data-print> prints the page.
  document.addEventListener("submit", function (event) {
    var form = event.target.closest("form[data-confirm]");
    if (form && !window.confirm(form.getAttribute("data-confirm"))) event.preventDefault();
  }, true);
  document.addEventListener("click", function (event) {
    if (event.target.closest("[data-print]")) window.print();
  });

  // --- copy buttons: <button data-copy="#element-id">
  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-copy]");
    if (!button) return;
    var source = document.querySelector(button.getAttribute("data-copy"));
    if (!source) return;
    var text = source.value !== undefined && source.tagName !== "PRE" ? source.value : source.textContent;
    var done = function () {
      var label = button.textContent;
      button.textContent = "Copied";
      button.setAttribute("aria-live", "polite");
      setTimeout(function () { button.textContent = label; }, 1500);
    };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done);
    } else {
      var area = document.createElement("textarea");
      area.value = text;
      document.body.appendChild(area);
      area.select();
      document.execCommand("copy");
      area.remove();
      done();
    }
  });

  // --- the navigation menu at phone width: <button data-nav-toggle aria-controls="...">
  document.addEventListener("click", function (event) {
    var toggle = event.target.closest("[data-nav-toggle]");
    if (!toggle) return;
    var menu = document.getElementById(toggle.getAttribute("aria-controls"));
    var open = toggle.getAttribute("aria-expanded") !== "true";
    toggle.setAttribute("aria-expanded", open ? "true" : "false");
    if (menu) menu.classList.toggle("open", open);
  });

  // --- live validation shows errors only for fields the user has touched
  function touch(event) {
    var form = event.target.form;
    var touched = form && form.querySelector("input[name=_touched]");
    if (!touched || !event.target.name) return;
    var names = touched.value ? touched.value.split(",") : [];
    if (names.indexOf(event.target.name) < 0) { names.push(event.target.name); touched.value = names.join(","); }
  }
  document.addEventListener("input", touch, true);
  document.addEventListener("change", touch, true);

  // --- the log follows its tail unless the reader scrolled up
  var stick = true;
  document.addEventListener("scroll", function (event) {
    var log = event.target;
    if (log && log.id === "log") stick = log.scrollHeight - log.scrollTop - log.clientHeight < 24;
  }, true);
  document.addEventListener("htmx:afterSettle", function () {
    var log = document.getElementById("log");
    if (log && stick) log.scrollTop = log.scrollHeight;
  });

  // --- charts
  var palette = { sm: "#0b57a4", mem: "#116329", power: "#a4161a", cost: "#7a4a00" };

  function lineChart(canvas, label, color, unit, max) {
    return new window.Chart(canvas, {
      type: "line",
      data: { labels: [], datasets: [{ label: label, data: [], borderColor: color, backgroundColor: color + "22", fill: true, pointRadius: 0, tension: 0.25 }] },
      options: {
        animation: false, responsive: true, maintainAspectRatio: false,
        plugins: { legend: { display: false }, tooltip: { callbacks: { label: function (c) { return c.formattedValue + " " + unit; } } } },
        scales: { x: { ticks: { maxTicksLimit: 6 } }, y: { beginAtZero: true, suggestedMax: max, title: { display: true, text: unit } } }
      }
    });
  }

  function clock(ms) {
    return new Date(ms).toISOString().substring(11, 19);
  }

  function jobCharts(root) {
    var url = root.getAttribute("data-job-metrics");
    var charts = {
      sm: lineChart(root.querySelector("[data-series=sm]"), "SM utilisation", palette.sm, "%", 100),
      mem: lineChart(root.querySelector("[data-series=mem]"), "GPU memory", palette.mem, "MiB"),
      power: lineChart(root.querySelector("[data-series=power]"), "Power", palette.power, "W")
    };
    var after = 0, idleAfterDone = 0;
    var points = document.querySelector("[data-points]");
    // The agent's latest samples (from its heartbeats) are drawn after the last metering window
    // until a window covers them: the charts move from the job's first seconds on.
    var live = [], drawnLive = 0;
    function push(label, sm, mem, power) {
      charts.sm.data.labels.push(label); charts.sm.data.datasets[0].data.push(sm);
      charts.mem.data.labels.push(label); charts.mem.data.datasets[0].data.push(mem);
      charts.power.data.labels.push(label); charts.power.data.datasets[0].data.push(power);
    }
    function poll() {
      fetch(url + "?after=" + after, { headers: { "Accept": "application/json" }, credentials: "same-origin" })
        .then(function (r) { return r.json(); })
        .then(function (s) {
          Object.keys(charts).forEach(function (k) {
            charts[k].data.labels.splice(charts[k].data.labels.length - drawnLive, drawnLive);
            charts[k].data.datasets[0].data.splice(charts[k].data.datasets[0].data.length - drawnLive, drawnLive);
          });
          for (var i = 0; i < s.t.length; i++) push(clock(s.t[i]), s.sm_util_pct[i], s.memory_mb[i], s.power_w[i]);
          if (s.t.length) after = s.t[s.t.length - 1];
          if (s.live && (!live.length || s.live.t > live[live.length - 1].t)) live.push(s.live);
          live = s.done ? [] : live.filter(function (p) { return p.t > after; });
          live.forEach(function (p) { push(clock(p.t) + " (live)", p.sm_util_pct, p.memory_mb, p.power_w); });
          drawnLive = live.length;
          root.setAttribute("data-live", String(drawnLive));
          Object.keys(charts).forEach(function (k) { charts[k].update(); });
          if (points) points.textContent = String(charts.sm.data.labels.length);
          root.setAttribute("data-count", String(charts.sm.data.labels.length));
          var cost = document.getElementById("cost-so-far");
          if (cost && s.cost_display) { cost.textContent = s.cost_display; cost.title = s.cost_exact + " exact"; }
          if (s.done) idleAfterDone = s.t.length ? 0 : idleAfterDone + 1;
          if (!s.done || idleAfterDone < 3) setTimeout(poll, 2000);
        })
        .catch(function () { setTimeout(poll, 5000); });
    }
    poll();
  }

  function usageChart(canvas) {
    var data = JSON.parse(document.getElementById(canvas.getAttribute("data-usage-chart")).textContent);
    new window.Chart(canvas, {
      data: {
        labels: data.labels,
        datasets: [
          { type: "bar", label: "Cost ($)", data: data.cost.map(Number), backgroundColor: palette.sm, yAxisID: "cost", maxBarThickness: 48 },
          { type: "line", label: "GPU-hours", data: data.gpu_hours, borderColor: palette.cost, yAxisID: "hours", pointRadius: 2 }
        ]
      },
      options: {
        animation: false, responsive: true, maintainAspectRatio: false,
        scales: {
          cost: { position: "left", beginAtZero: true, title: { display: true, text: "$" } },
          hours: { position: "right", beginAtZero: true, grid: { drawOnChartArea: false }, title: { display: true, text: "GPU-hours" } }
        }
      }
    });
  }

  function modelChart(canvas) {
    var data = JSON.parse(document.getElementById(canvas.getAttribute("data-model-chart")).textContent);
    new window.Chart(canvas, {
      type: "doughnut",
      data: { labels: data.models, datasets: [{ data: data.model_cost.map(Number), backgroundColor: [palette.sm, palette.mem, palette.cost, palette.power, "#5a3d99", "#00717a"] }] },
      options: { animation: false, responsive: true, maintainAspectRatio: false, plugins: { legend: { position: "right" } } }
    });
  }

  // --- an inference endpoint: traffic, latency, replicas (polled), cost per day
  function seriesChart(canvas, datasets, unit, stepped) {
    return new window.Chart(canvas, {
      type: "line",
      data: { labels: [], datasets: datasets.map(function (d) {
        // Points are drawn small: a busy minute between quiet ones (no latency: a gap) still shows.
        return { label: d.label, data: [], borderColor: d.color, backgroundColor: d.color + "22", fill: !!d.fill, pointRadius: 1.5, tension: stepped ? 0 : 0.2, stepped: !!stepped, spanGaps: false };
      }) },
      options: {
        animation: false, responsive: true, maintainAspectRatio: false,
        plugins: { legend: { display: datasets.length > 1, position: "bottom" } },
        scales: { x: { ticks: { maxTicksLimit: 6 } }, y: { beginAtZero: true, ticks: { precision: stepped ? 0 : undefined }, title: { display: true, text: unit } } }
      }
    });
  }

  function endpointCharts(root) {
    var url = root.getAttribute("data-endpoint-series");
    var charts = {
      rate: seriesChart(root.querySelector("[data-chart=rate]"), [
        { label: "requests/s", color: palette.sm, fill: true }, { label: "failed/s", color: palette.power }], "requests/s"),
      latency: seriesChart(root.querySelector("[data-chart=latency]"), [
        { label: "p50", color: palette.mem }, { label: "p95", color: palette.cost }, { label: "p99", color: palette.power }], "ms"),
      replicas: seriesChart(root.querySelector("[data-chart=replicas]"), [
        { label: "live", color: palette.sm, fill: true }, { label: "ready", color: palette.mem }], "replicas", true)
    };
    function show(s) {
      var long = s.t.length > 1 && s.t[s.t.length - 1] - s.t[0] > 86400000;
      var labels = s.t.map(function (ms) { return new Date(ms).toISOString().substring(long ? 5 : 11, 16).replace("T", " "); });
      var perSecond = function (n) { return Math.round(n / s.step_seconds * 1000) / 1000; };
      var put = function (chart, columns) {
        chart.data.labels = labels;
        columns.forEach(function (values, i) { chart.data.datasets[i].data = values; });
        chart.update();
      };
      put(charts.rate, [s.requests_per_s, s.errors.map(perSecond)]);
      put(charts.latency, [s.p50_ms, s.p95_ms, s.p99_ms]);
      put(charts.replicas, [s.replicas, s.replicas_ready]);
      root.setAttribute("data-points", String(labels.length));
    }
    show(JSON.parse(document.getElementById("endpoint-series").textContent));
    function poll() {
      fetch(url, { headers: { "Accept": "application/json" }, credentials: "same-origin" })
        .then(function (r) { if (!r.ok) throw new Error(r.status); return r.json(); })
        .then(function (s) { show(s); setTimeout(poll, 10000); })
        .catch(function () { setTimeout(poll, 30000); });
    }
    setTimeout(poll, 10000);
  }

  function costChart(canvas) {
    var data = JSON.parse(document.getElementById(canvas.getAttribute("data-cost-chart")).textContent);
    new window.Chart(canvas, {
      type: "bar",
      data: { labels: data.labels.map(function (d) { return d.substring(5); }), datasets: [{ label: "Cost ($)", data: data.cost.map(Number), backgroundColor: palette.cost, maxBarThickness: 24 }] },
      options: { animation: false, responsive: true, maintainAspectRatio: false, plugins: { legend: { display: false } }, scales: { y: { beginAtZero: true, title: { display: true, text: "$" } } } }
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    if (!window.Chart) return;
    document.querySelectorAll("[data-endpoint-series]").forEach(endpointCharts);
    document.querySelectorAll("[data-cost-chart]").forEach(costChart);
    document.querySelectorAll("[data-model-chart]").forEach(modelChart);
    document.querySelectorAll("[data-job-metrics]").forEach(jobCharts);
    document.querySelectorAll("[data-usage-chart]").forEach(usageChart);
  });
})();
