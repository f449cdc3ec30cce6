// A real aether service for the browser tests and the graph benchmark: the binary, a fresh
// data directory (optionally seeded by `aether demo`), `aether serve` on a free port, and,
// with CONSOLE_DIST, a fresh console build served in front of it.
import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { createServer, request as httpRequest } from 'node:http';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const repo = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../..');

export function binary() {
  if (process.env.AETHER_BIN) return process.env.AETHER_BIN;
  const candidates = [
    path.join(repo, 'target/debug/aether'),
    process.env.CARGO_TARGET_DIR && path.join(process.env.CARGO_TARGET_DIR, 'debug/aether'),
  ].filter(Boolean);
  return candidates.find((p) => existsSync(p)) ?? candidates[0];
}

/**
 * The service's environment: this one without a ledger database named, so that the demo and
 * the service use the data directory's own SQLite ledger even where the test script exports
 * DATABASE_URL for the Rust tests (a shared database holds other nodes' settings).
 */
function serviceEnv() {
  const env = { ...process.env };
  for (const name of ['DATABASE_URL', 'AETHER_TOKENS', 'AETHER_TOKENS_FILE', 'OTEL_EXPORTER_OTLP_ENDPOINT']) delete env[name];
  return env;
}

/** Runs a command to its end, keeping its output for the failure message. */
function run(cmd, args, timeoutMs) {
  return new Promise((resolve, reject) => {
    const child = spawn(cmd, args, { stdio: ['ignore', 'pipe', 'pipe'], env: serviceEnv() });
    let out = '';
    child.stdout.on('data', (d) => (out += d));
    child.stderr.on('data', (d) => (out += d));
    const timer = setTimeout(() => child.kill('SIGKILL'), timeoutMs);
    child.on('error', reject);
    child.on('exit', (code) => {
      clearTimeout(timer);
      code === 0 ? resolve(out) : reject(new Error(`${cmd} ${args.join(' ')} exited ${code}:\n${out.slice(-4000)}`));
    });
  });
}

function freePort() {
  return new Promise((resolve) => {
    const s = createServer().listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

/**
 * A console build served from disk, under the service's own Content-Security-Policy so
 * that the build is held to it, and everything else passed to the service.
 */
function distProxy(dist, target, csp) {
  const types = { '.js': 'text/javascript', '.css': 'text/css', '.html': 'text/html' };
  return createServer(async (req, res) => {
    const url = new URL(req.url, 'http://x');
    if (url.pathname === '/ui' || url.pathname.startsWith('/ui/')) {
      const rel = url.pathname.slice(4);
      const file = path.extname(rel) ? path.join(dist, rel) : path.join(dist, 'index.html');
      try {
        const body = await readFile(file);
        res.writeHead(200, {
          'content-type': types[path.extname(file)] ?? 'application/octet-stream',
          ...(csp ? { 'content-security-policy': csp } : {}),
        });
        return res.end(body);
      } catch {
        res.writeHead(404);
        return res.end();
      }
    }
    const up = httpRequest({ host: '127.0.0.1', port: target, path: req.url, method: req.method, headers: req.headers }, (r) => {
      res.writeHead(r.statusCode, r.headers);
      r.pipe(res);
    });
    req.pipe(up);
  });
}

/**
 * Starts the service; `demo` seeds it first. Returns its base URL (the console's origin),
 * the role tokens and `stop`, which always ends the server and removes the data.
 */
export async function startService({ demo }) {
  const work = await mkdtemp(path.join(tmpdir(), 'aether-console-'));
  const data = path.join(work, 'data');
  const aether = binary();
  let server = null;
  let proxy = null;
  const stop = async () => {
    proxy?.close();
    if (server && server.exitCode === null) {
      server.kill('SIGTERM');
      await new Promise((r) => {
        const t = setTimeout(() => (server.kill('SIGKILL'), r()), 10_000);
        server.on('exit', () => (clearTimeout(t), r()));
      });
    }
    await rm(work, { recursive: true, force: true });
  };
  try {
    if (demo) await run(aether, ['demo', '--data-dir', data], 300_000);
    const port = await freePort();
    server = spawn(aether, ['serve', '--data-dir', data, '--listen', `127.0.0.1:${port}`, '--no-grpc'], {
      stdio: ['ignore', 'ignore', 'pipe'],
      env: serviceEnv(),
    });
    let log = '';
    server.stderr.on('data', (d) => (log = (log + d).slice(-4000)));
    let base = `http://127.0.0.1:${port}`;
    for (let i = 0; ; i++) {
      if (await fetch(`${base}/readyz`).then((r) => r.ok, () => false)) break;
      if (i > 600 || server.exitCode !== null) throw new Error(`aether serve did not become ready; its log ends:\n${log}`);
      await new Promise((r) => setTimeout(r, 100));
    }
    const tokens = Object.fromEntries(
      (await readFile(path.join(data, 'tokens'), 'utf8'))
        .split('\n')
        .filter((l) => l && !l.startsWith('#'))
        .map((l) => l.split(':')),
    );
    if (process.env.CONSOLE_DIST) {
      const uiPort = await freePort();
      const csp = (await fetch(`${base}/ui/`)).headers.get('content-security-policy');
      proxy = distProxy(path.resolve(process.env.CONSOLE_DIST), port, csp).listen(uiPort, '127.0.0.1');
      base = `http://127.0.0.1:${uiPort}`;
    }
    return { base, tokens, stop };
  } catch (e) {
    await stop();
    throw e;
  }
}
