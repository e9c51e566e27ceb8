// Copy the pinned UMD builds into static/vendor/ (run: npm ci && npm run vendor).
// The copied files are committed, so the portal works offline.
const fs = require("fs");
const path = require("path");

const out = path.resolve(__dirname, "..", "..", "static", "vendor");
const files = [
  ["chart.js/dist/chart.umd.min.js", "chart.umd.min.js"],
  ["chart.js/LICENSE.md", "chart.js.LICENSE.md"],
];
fs.mkdirSync(out, { recursive: true });
for (const [from, to] of files) {
  fs.copyFileSync(path.join(__dirname, "node_modules", from), path.join(out, to));
  console.log(`static/vendor/${to} <- ${from}`);
}
