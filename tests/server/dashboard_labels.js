// Runs the dashboard's script under node with a recording canvas (no browser): prints the labels the
// "acceptance per draft position" chart writes, as JSON. Used by test_dashboard.py.
"use strict";
const fs = require("fs");
const vm = require("vm");
const [script, positions, width] = [process.argv[2], Number(process.argv[3]), Number(process.argv[4])];
const texts = [];
const ctx = new Proxy({
  font: "11px system-ui, sans-serif",
  measureText: (text) => ({ width: 6.2 * String(text).length }),  // 11px system-ui: about 6 px a character
  fillText: (text, x, y) => texts.push({ text: String(text), x, y, align: ctx.textAlign }),
}, { get: (target, key) => (key in target ? target[key] : () => {}), set: (target, key, v) => ((target[key] = v), true) });
const element = () => ({ textContent: "", dataset: {}, classList: { toggle() {} } });
const canvas = { clientWidth: width, clientHeight: 160, width: 0, height: 0, getContext: () => ctx };
const samples = {};
for (let i = 0; i < positions; i++) {
  samples[`specdecode:spec_decode_num_drafts_per_pos_total{position="${i}"}`] = 100;
  samples[`specdecode:spec_decode_num_accepted_tokens_per_pos_total{position="${i}"}`] = 100 - 9 * i;
}
const context = vm.createContext({
  window: { location: { search: "" }, addEventListener() {}, devicePixelRatio: 1 },
  document: { getElementById: element }, URLSearchParams, fetch: () => new Promise(() => {}), setTimeout() {},
  console, texts, canvas, samples,
});
vm.runInContext(fs.readFileSync(script, "utf8") +
  "\n;snapshots.push({ t: 1, samples }); positionChart(canvas);", context);
process.stdout.write(JSON.stringify(texts));
