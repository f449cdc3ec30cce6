// The lineage graph's benchmark: a fresh service is seeded through the OpenLineage ingest
// with a graph of about N nodes (50 pipelines of jobs and datasets from one source, with
// links between neighbouring pipelines), the console opens it in headless Chromium, and the
// page's own Performance API marks give the time to fetch, lay out and draw it; panning is
// measured as frames per second while the view moves on every frame (at the fitted
// overview and zoomed in to reading size). Prints one JSON object.
//
//   node e2e/graph.bench.mjs [N=10000]      (AETHER_BIN, CHROMIUM, CONSOLE_DIST as for e2e)
import { randomUUID } from 'node:crypto';
import { chromium } from 'playwright-core';
import { startService } from './service.mjs';

const N = Number(process.argv[2] ?? 10_000);
const PIPELINES = 50;
const STAGES = Math.max(1, Math.round((N - 1) / PIPELINES / 2));
const NS = 'bench';

function events() {
  const out = [];
  const t = Date.now() - 3_600_000;
  const ds = (p, s) => ({ namespace: NS, name: s === 0 ? 'source' : `p${p}.d${s}` });
  for (let s = 0; s < STAGES; s++) {
    for (let p = 0; p < PIPELINES; p++) {
      const inputs = [ds(p, s)];
      if (s > 0 && s % 10 === 0) inputs.push(ds((p + 1) % PIPELINES, s));
      out.push({
        eventType: 'COMPLETE',
        eventTime: new Date(t + out.length).toISOString(),
        producer: 'https://aether.example/bench',
        schemaURL: 'https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent',
        run: { runId: randomUUID() },
        job: { namespace: NS, name: `p${p}.s${s}` },
        inputs,
        outputs: [ds(p, s + 1)],
      });
    }
  }
  return out;
}

const service = await startService({ demo: false });
let browser;
try {
  const all = events();
  const t0 = performance.now();
  for (let i = 0; i < all.length; i += 500) {
    const res = await fetch(`${service.base}/api/v1/lineage`, {
      method: 'POST',
      headers: { authorization: `Bearer ${service.tokens.operator}`, 'content-type': 'application/json' },
      body: JSON.stringify(all.slice(i, i + 500)),
    });
    if (!res.ok) throw new Error(`ingest answered ${res.status}: ${await res.text()}`);
  }
  const ingestMs = performance.now() - t0;

  browser = await chromium.launch({ executablePath: process.env.CHROMIUM || '/usr/bin/chromium', args: ['--no-sandbox'] });
  const page = await (await browser.newContext({ viewport: { width: 1400, height: 900 } })).newPage();
  await page.goto(`${service.base}/ui/`);
  await page.fill('#token', service.tokens.regulator);
  await page.click('button[type=submit]');
  await page.waitForSelector('header');
  await page.goto(`${service.base}/ui/lineage?node=${encodeURIComponent(`dataset:${NS}:source`)}&depth=1000`);
  await page.waitForFunction(() => performance.getEntriesByName('lineage:drawn').length > 0, null, { timeout: 300_000 });
  const marks = await page.evaluate(() => {
    const at = (n) => performance.getEntriesByName(n)[0].startTime;
    return { fetchMs: at('lineage:fetched') - at('lineage:requested'), layoutAndDrawMs: at('lineage:drawn') - at('lineage:fetched') };
  });
  const nodes = await page.evaluate(() => document.querySelector('.bar .muted')?.textContent ?? '');

  // Pans by one arrow key on every animation frame for two seconds; frames/s is the result.
  const fps = () =>
    page.evaluate(
      () =>
        new Promise((done) => {
          const svg = document.querySelector('svg[role=application]');
          let frames = 0;
          const t = performance.now();
          const step = () => {
            svg.dispatchEvent(new KeyboardEvent('keydown', { key: frames % 20 < 10 ? 'ArrowRight' : 'ArrowLeft', bubbles: true }));
            frames++;
            if (performance.now() - t < 2000) requestAnimationFrame(step);
            else done(frames / ((performance.now() - t) / 1000));
          };
          requestAnimationFrame(step);
        }),
    );
  const overviewFps = await fps();
  // Zoom in (about the centre) until the nodes are elements with their labels.
  for (let i = 0; i < 40 && !(await page.$('g.node text')); i++) await page.click('button[aria-label="Zoom in"]');
  const zoomedFps = await fps();
  const zoomedNodesInDom = await page.evaluate(() => document.querySelectorAll('g.node').length);
  console.log(JSON.stringify({ requestedNodes: N, drawn: nodes, ingestMs: Math.round(ingestMs), ...Object.fromEntries(Object.entries(marks).map(([k, v]) => [k, Math.round(v)])), overviewPanFps: Math.round(overviewFps), zoomedPanFps: Math.round(zoomedFps), zoomedNodesInDom }));
} finally {
  await browser?.close();
  await service.stop();
}
