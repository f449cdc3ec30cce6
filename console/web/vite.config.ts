// Builds the console into ../dist, served by `aether serve` under /ui/. The output is
// committed and CI rebuilds it to compare, so nothing time- or machine-dependent may enter
// it: Vite names chunks by content hash, and no build info is injected.
import { defineConfig, type Plugin } from 'vite';
import { svelte } from '@sveltejs/vite-plugin-svelte';

const target = process.env.AETHER_URL ?? 'http://127.0.0.1:8099';
const devToken = process.env.AETHER_DEV_TOKEN;

/**
 * Dev server only: with AETHER_DEV_TOKEN set, stands in for the session routes of a service
 * that does not have them yet (the proxy adds the bearer token to every call instead).
 */
function devSession(): Plugin {
  return {
    name: 'aether-dev-session',
    apply: 'serve',
    configureServer(server) {
      if (!devToken) return;
      let signedIn = true;
      const role = process.env.AETHER_DEV_ROLE ?? 'regulator';
      const info = () => ({ role, actor: `${role}:dev`, expires_at: '2099-01-01T00:00:00Z', csrf_token: 'dev' });
      server.middlewares.use('/v1/session', (req, res) => {
        const send = (status: number, body?: unknown) => {
          res.statusCode = status;
          res.setHeader('content-type', status >= 400 ? 'application/problem+json' : 'application/json');
          res.end(body === undefined ? '' : JSON.stringify(body));
        };
        if (req.url?.startsWith('/views')) return send(204);
        if (req.method === 'POST') return (signedIn = true), send(201, info());
        if (req.method === 'DELETE') return (signedIn = false), send(204);
        if (signedIn) return send(200, info());
        send(401, { title: 'Unauthorized', status: 401, detail: 'sign in' });
      });
    },
  };
}

const proxied = {
  target,
  changeOrigin: true,
  headers: devToken ? { authorization: `Bearer ${devToken}` } : undefined,
};

export default defineConfig({
  base: '/ui/',
  plugins: [svelte(), devSession()],
  build: {
    outDir: '../dist',
    emptyOutDir: true,
    target: 'es2022',
    // Reproducible output: no source maps with absolute paths, no build stamps.
    sourcemap: false,
  },
  server: {
    proxy: { '/v1': proxied, '/api': proxied, '/readyz': proxied },
  },
});
