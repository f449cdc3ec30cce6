// The console in a real browser against a real service: `aether demo` seeds a ledger with a
// rollout that is rolled back and a held trade, `aether serve` serves it with the console,
// and Chromium (driven by playwright-core) goes through what a regulator and an operator do.
//
//   AETHER_BIN        the aether binary (default: <repo>/target/debug/aether, else
//                     $CARGO_TARGET_DIR/debug/aether, else ~/.cache/aether/target/debug/aether)
//   CHROMIUM          the browser (default /usr/bin/chromium)
//   CONSOLE_ARTIFACTS where screenshots go (default /tmp/console-artifacts)
//   CONSOLE_DIST      serve this console build in front of the service instead of the one
//                     compiled into the binary (to test a fresh `npm run build` without
//                     rebuilding aether)
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdir, readdir, readFile, rm } from 'node:fs/promises';
import { createRequire } from 'node:module';
import path from 'node:path';
import { chromium } from 'playwright-core';
import { startService } from './service.mjs';

const artifacts = process.env.CONSOLE_ARTIFACTS ?? '/tmp/console-artifacts';
const axeSource = await readFile(createRequire(import.meta.url).resolve('axe-core/axe.min.js'), 'utf8');

let service;
let browser;
let base;
let tokens;
const pageErrors = [];

before(async () => {
  await mkdir(artifacts, { recursive: true });
  // This run's screenshots only (they are numbered by step).
  for (const f of await readdir(artifacts)) if (/^\d\d-[\w-]+\.png$/.test(f)) await rm(path.join(artifacts, f));
  service = await startService({ demo: true });
  ({ base, tokens } = service);
  browser = await chromium.launch({ executablePath: process.env.CHROMIUM || '/usr/bin/chromium', args: ['--no-sandbox'] });
});

// The server is stopped whatever happened.
after(async () => {
  await browser?.close().catch(() => {});
  await service?.stop();
});

let shot = 0;
async function snap(page, name) {
  await page.screenshot({ path: path.join(artifacts, `${String(++shot).padStart(2, '0')}-${name}.png`), fullPage: true });
}

/** axe-core on the page as it is: no serious or critical violation. */
async function accessible(page, what) {
  await page.evaluate(axeSource);
  const result = await page.evaluate(() => globalThis.axe.run(document, { resultTypes: ['violations'] }));
  const bad = result.violations.filter((v) => v.impact === 'serious' || v.impact === 'critical');
  assert.deepEqual(
    bad.map((v) => `${v.id} (${v.impact}): ${v.nodes.map((n) => n.target.join(' ')).slice(0, 5).join(', ')}`),
    [],
    `accessibility violations on ${what}`,
  );
}

/** Presses Tab until `selector` has the focus, or fails after `max` presses. */
async function tabTo(page, selector, max = 60) {
  for (let i = 0; i < max; i++) {
    await page.keyboard.press('Tab');
    if (await page.evaluate((s) => document.activeElement?.matches(s) ?? false, selector)) return;
  }
  assert.fail(`Tab never reached ${selector}`);
}

async function newPage() {
  const context = await browser.newContext({ viewport: { width: 1400, height: 900 } });
  const page = await context.newPage();
  page.on('pageerror', (e) => pageErrors.push(e.message));
  page.on('console', (m) => {
    if (m.type() === 'error' && /Content Security Policy/.test(m.text())) pageErrors.push(m.text());
  });
  return page;
}

async function signIn(page, token) {
  await page.goto(`${base}/ui/`);
  await page.fill('#token', token);
  await page.click('button[type=submit]');
  await page.waitForSelector('header');
}

const verdicts = (page, scope) => page.locator(`${scope} [data-proof]`);

test('a regulator and an operator use the console', { timeout: 600_000 }, async (t) => {
  const page = await newPage();

  await t.test('the landing page says what the console is and asks for a token', async () => {
    await page.goto(`${base}/ui/`);
    await page.waitForSelector('#token');
    assert.match(await page.textContent('main'), /lineage and audit console/i);
    await accessible(page, 'the landing page');
    await snap(page, 'landing');
  });

  await t.test('signing in keeps the token nowhere a script can read', async () => {
    await signIn(page, tokens.regulator);
    const leaks = await page.evaluate(() => ({
      storage: localStorage.length + sessionStorage.length,
      url: location.href,
      cookie: document.cookie,
    }));
    assert.equal(leaks.storage, 0);
    assert.ok(!leaks.url.includes(tokens.regulator));
    assert.ok(!leaks.cookie.includes('aether_session'), 'the session cookie must be HttpOnly');
  });

  await t.test('the integrity panel verifies the newest checkpoint in the browser', async () => {
    await page.waitForSelector('[data-testid=checkpoint-verdict]');
    assert.equal((await page.textContent('[data-testid=checkpoint-verdict]')).trim(), 'verified');
    await accessible(page, 'the integrity panel');
    await snap(page, 'integrity');
  });

  await t.test('Tab reaches the search box, and search finds a job and opens it', async () => {
    await page.evaluate(() => document.activeElement?.blur());
    await tabTo(page, '#search-input');
    await page.keyboard.type('policy.ingest');
    const option = page.locator('#search-list [role=option]', { hasText: 'policy.ingest' }).filter({ hasText: 'job' }).first();
    await option.waitFor();
    await snap(page, 'search');
    await option.click();
    await page.waitForURL(/\/ui\/job\?/);
    await page.waitForSelector('h1:has-text("policy.ingest")');
    await accessible(page, 'a job page');
    await snap(page, 'job');
  });

  await t.test('the lineage graph draws the expected nodes', async () => {
    await page.click('text=Open in the lineage graph');
    await page.waitForSelector('[data-node-id="job:aether:policy.ingest"]');
    for (const id of ['job:aether:policy.ingest', 'dataset:aether://policy:aml_v2', 'job:aether:engine.activate']) {
      assert.equal(await page.locator(`[data-node-id="${id}"]`).count(), 1, `${id} is drawn`);
    }
  });

  await t.test('Tab reaches the graph controls, and the keyboard zooms', async () => {
    await page.evaluate(() => document.activeElement?.blur());
    await tabTo(page, 'button[aria-label="Zoom in"]');
    await tabTo(page, 'svg[role=application]', 5);
    const layer = page.locator('svg.layer');
    const before = await layer.getAttribute('data-transform');
    await page.keyboard.press('+');
    assert.notEqual(await layer.getAttribute('data-transform'), before);
  });

  await t.test('a node’s ledger events carry proofs verified in the browser', async () => {
    await page.click('[data-node-id="job:aether:engine.activate"]');
    await page.waitForSelector('aside .ledger-event');
    await page.waitForFunction(() => [...document.querySelectorAll('aside [data-proof]')].every((e) => !/checking/.test(e.textContent)));
    const texts = await verdicts(page, 'aside').allTextContents();
    assert.ok(texts.length > 0);
    for (const v of texts) assert.equal(v.trim(), 'verified');
    await accessible(page, 'the lineage graph with its side panel');
    await snap(page, 'lineage-panel');
  });

  await t.test('a tampered proof is shown as not verified', async () => {
    await page.route('**/v1/audit/events/*', async (route) => {
      const response = await route.fetch();
      const body = await response.json();
      const h = body.inclusion_proof.hashes[0];
      body.inclusion_proof.hashes[0] = (h[0] === '0' ? '1' : '0') + h.slice(1);
      await route.fulfill({ response, json: body });
    });
    await page.reload();
    await page.waitForSelector('aside [data-proof].not-verified');
    assert.match(await verdicts(page, 'aside').first().textContent(), /not verified: the inclusion proof does not lead to the checkpoint/);
    await snap(page, 'tampered');
    await page.unroute('**/v1/audit/events/*');
  });

  const rollback = await page.evaluate(async () => (await (await fetch('/v1/audit/events?event_type=RolledBack&limit=1')).json()).events[0]);
  const beforeRollback = new Date(Date.parse(rollback.recorded_at) - 500).toISOString();
  let checksBefore = 0;

  await t.test('the time control redraws the graph and the rollouts as they stood', async () => {
    await page.goto(`${base}/ui/lineage?node=${encodeURIComponent('dataset:delta:events')}&depth=1`);
    await page.waitForSelector('[data-node-id="job:aether:rollout.rollback"]');
    await page.fill('#asof-exact', beforeRollback);
    await page.press('#asof-exact', 'Enter');
    await page.waitForURL(/asOf=/);
    await page.waitForSelector('text=as of');
    await page.waitForFunction(() => !document.querySelector('[data-node-id="job:aether:rollout.rollback"]') && document.querySelector('[data-node-id="dataset:delta:events"]'));
    await snap(page, 'lineage-before-rollback');
    // The time stays with the user: the rollouts board opens at it too.
    await page.click('nav >> text=Rollouts');
    await page.waitForURL(/\/ui\/rollouts\?asOf=/);
    await page.waitForSelector('[data-testid=no-rollback]');
    await page.waitForSelector('table.checks tbody tr');
    checksBefore = await page.locator('table.checks tbody tr').count();
    await snap(page, 'rollouts-before-rollback');
  });

  await t.test('the rollouts board shows the rollback and the snapshot it restored', async () => {
    await page.click('text=Now');
    await page.waitForURL((u) => !u.search.includes('asOf'));
    await page.waitForSelector('[data-testid=rollback]');
    const text = await page.textContent('[data-testid=rollback]');
    assert.ok(text.includes(rollback.payload.target_snapshot), 'the rollback names the snapshot it restored');
    await page.waitForSelector('[data-testid=rollback] [data-proof].verified');
    await page.waitForSelector('.u-wrap canvas');
    assert.ok((await page.locator('table.checks tbody tr').count()) > checksBefore, 'checks after the time viewed before');
    const board = await page.textContent('main');
    assert.ok(!board.includes('[object Object]') && !board.includes('undefined'), 'every value is written for a person');
    assert.match(board, /paused \(|frozen/, 'the gate that stopped the candidate is named');
    await accessible(page, 'the rollouts board');
    await snap(page, 'rollouts');
  });

  await t.test('a held decision is explained with its proof', async () => {
    await page.goto(`${base}/ui/decisions/held-explained`);
    await page.waitForSelector('text=Rules fired');
    assert.match(await page.textContent('main'), /held_for_review/);
    await page.waitForSelector('main [data-proof].verified');
    await accessible(page, 'a decision page');
    await snap(page, 'decision');
    // Its lineage run is its scoring batch's (one run a batch), which lists it.
    await page.click('main a[href*="/ui/run?id="]', { timeout: 20000 });
    await page.waitForSelector('text=Decisions in this batch');
    assert.ok(await page.locator('table.decisions a', { hasText: 'held-explained' }).count() === 1, 'the batch run lists the decision');
    await accessible(page, 'a clearing batch run');
  });

  await t.test('collapsing a node hides its neighbours until it is expanded', async () => {
    await page.goto(`${base}/ui/lineage?node=${encodeURIComponent('job:aether:policy.ingest')}&sel=${encodeURIComponent('job:aether:policy.ingest')}`);
    await page.waitForSelector('[data-node-id="dataset:aether://policy:aml_v2"]');
    const all = await page.locator('[data-node-id]').count();
    await page.click('text=Collapse its neighbours');
    await page.waitForFunction(() => document.querySelectorAll('[data-node-id]').length === 1);
    assert.match(await page.getAttribute('[data-node-id="job:aether:policy.ingest"]', 'aria-label'), /neighbours collapsed/);
    await page.click('text=Expand its neighbours');
    await page.waitForFunction((n) => document.querySelectorAll('[data-node-id]').length === n, all);
  });

  await t.test('the browse, run, event and search pages pass axe', async () => {
    const pages = [
      ['/ui/namespaces', 'text=aether://policy'],
      [`/ui/namespace?ns=${encodeURIComponent('aether://policy')}`, 'text=aml_v2'],
      [`/ui/dataset?ns=${encodeURIComponent('aether://policy')}&name=aml_v2`, '.ledger-event [data-proof].verified'],
      [`/ui/events/${rollback.seq}`, 'main [data-proof].verified'],
      ['/ui/search?q=rollout', 'text=rollout.step'],
    ];
    for (const [url, ready] of pages) {
      await page.goto(`${base}${url}`);
      await page.waitForSelector(ready);
      await accessible(page, url);
    }
    // A run, from the dataset version it created.
    await page.goto(`${base}/ui/dataset?ns=${encodeURIComponent('aether://policy')}&name=aml_v2`);
    await page.click('main table a[href*="/ui/run?"]');
    await page.waitForSelector('h1:has-text("Run")');
    await page.waitForSelector('.ledger-event [data-proof].verified');
    await accessible(page, 'a run page');
    await snap(page, 'run');
  });

  await t.test('the timeline pages forward and back with cursors', async () => {
    await page.goto(`${base}/ui/timeline?limit=20`);
    await page.waitForSelector('table tbody tr td');
    const first = await page.textContent('table tbody tr td');
    await page.click('text=Next →');
    await page.waitForURL(/cursor=20/);
    await page.waitForFunction((f) => document.querySelector('table tbody tr td')?.textContent !== f, first);
    await page.click('text=← Previous');
    await page.waitForFunction((f) => document.querySelector('table tbody tr td')?.textContent === f, first);
    await accessible(page, 'the timeline');
    await snap(page, 'timeline');
  });

  await t.test('the regulator’s page views are recorded on the ledger', async () => {
    const res = await fetch(`${base}/v1/audit/events?stream_prefix=access/audit&limit=1000`, {
      headers: { authorization: `Bearer ${tokens.regulator}` },
    });
    const { events } = await res.json();
    const paths = events.filter((e) => e.payload.query === 'page_view').map((e) => e.payload.details.path);
    assert.ok(paths.includes('/ui/decisions/held-explained'), `page views recorded: ${paths.join(', ')}`);
  });

  await t.test('after sign-out the API refuses the old cookie', async () => {
    const cookie = (await page.context().cookies()).find((c) => c.name === 'aether_session');
    assert.ok(cookie, 'a session cookie was set');
    await page.click('text=Sign out');
    await page.waitForSelector('#token');
    for (const route of ['/v1/session', '/api/v1/namespaces']) {
      const res = await fetch(`${base}${route}`, { headers: { cookie: `aether_session=${cookie.value}` } });
      assert.equal(res.status, 401, `${route} with the old cookie`);
    }
  });

  await t.test('an operator sees lineage, and is told proofs are for regulators', async () => {
    const op = await newPage();
    await signIn(op, tokens.operator);
    await op.goto(`${base}/ui/lineage?node=${encodeURIComponent('job:aether:policy.ingest')}&sel=${encodeURIComponent('job:aether:engine.activate')}`);
    await op.waitForSelector('aside >> text=proofs are shown to regulators');
    await accessible(op, 'the lineage graph for an operator');
    await snap(op, 'operator-lineage');
    // The rollout board shows an operator the rollback too, and the snapshot it restored.
    await op.click('nav >> text=Rollouts');
    await op.waitForSelector('[data-testid=rollback]');
    assert.ok((await op.textContent('[data-testid=rollback]')).includes(rollback.payload.target_snapshot));
    await snap(op, 'operator-rollouts');
    await op.context().close();
  });

  assert.deepEqual(pageErrors, [], 'no script errors or CSP violations in the pages');
});
