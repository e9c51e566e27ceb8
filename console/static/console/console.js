// Live refresh without a framework: an element with data-refresh="URL" and
// data-every="SECONDS" is replaced by what URL answers to an htmx-style request
// (the view sends only the fragment when it sees the HX-Request header).
document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-refresh]").forEach((el) => {
    const every = 1000 * Number(el.dataset.every || 5);
    const tick = async () => {
      try {
        const response = await fetch(el.dataset.refresh, { headers: { "HX-Request": "true" }, credentials: "same-origin" });
        if (response.ok) {
          el.innerHTML = await response.text();
          el.dataset.refreshedAt = new Date().toISOString();
        }
      } catch (e) { /* the next tick retries */ }
      setTimeout(tick, every);
    };
    setTimeout(tick, every);
  });
});
