// What the lineage graph draws: which nodes are shown (collapse), how labels wrap, where
// dagre puts everything (loaded on first use), and which nodes lie up- or downstream.
import type { GraphNode } from './lineage.ts';

export interface Box {
  id: string;
  kind: 'JOB' | 'DATASET';
  name: string;
  namespace: string;
  lines: string[];
  /** The label was too long even wrapped; the full name is in the node's tooltip. */
  cut: boolean;
  state: string | null;
  x: number;
  y: number;
  w: number;
  h: number;
  /** Neighbours hidden because this node is collapsed. */
  hidden: number;
}
export interface Wire {
  from: string;
  to: string;
  d: string;
}
export interface Drawing {
  boxes: Box[];
  wires: Wire[];
  width: number;
  height: number;
}

const CHAR_W = 7.4;
const LINE_H = 16;
const MAX_CHARS = 26;
const MAX_LINES = 4;

/** Breaks a name at its natural separators into lines of at most MAX_CHARS. */
export function wrap(name: string): { lines: string[]; cut: boolean } {
  const parts = name.match(/[^./_\-@:]+[./_\-@:]?|[./_\-@:]/g) ?? [name];
  const lines: string[] = [];
  let line = '';
  for (let part of parts) {
    while (part.length > MAX_CHARS) {
      if (line) lines.push(line), (line = '');
      lines.push(part.slice(0, MAX_CHARS));
      part = part.slice(MAX_CHARS);
    }
    if ((line + part).length > MAX_CHARS) lines.push(line), (line = part);
    else line += part;
  }
  if (line) lines.push(line);
  if (lines.length <= MAX_LINES) return { lines, cut: false };
  const kept = lines.slice(0, MAX_LINES);
  kept[MAX_LINES - 1] = kept[MAX_LINES - 1].slice(0, MAX_CHARS - 1) + '…';
  return { lines: kept, cut: true };
}

/** Edges of the answer, each once (Marquez lists an edge at both of its ends). */
export function edgesOf(graph: GraphNode[]): [string, string][] {
  const seen = new Set<string>();
  const out: [string, string][] = [];
  for (const n of graph) {
    for (const e of [...n.inEdges, ...n.outEdges]) {
      const key = `${e.origin}\n${e.destination}`;
      if (!seen.has(key)) seen.add(key), out.push([e.origin, e.destination]);
    }
  }
  return out;
}

/**
 * The nodes shown: those reachable from the centre without passing through a collapsed
 * node (a collapsed node is shown, its other neighbours are not, unless reached otherwise).
 */
export function visibleNodes(center: string, graph: GraphNode[], collapsed: Set<string>): Set<string> {
  const adj = new Map<string, string[]>();
  for (const [a, b] of edgesOf(graph)) {
    adj.set(a, [...(adj.get(a) ?? []), b]);
    adj.set(b, [...(adj.get(b) ?? []), a]);
  }
  const start = graph.some((n) => n.id === center) ? center : graph[0]?.id;
  const seen = new Set<string>(start ? [start] : []);
  const queue = [...seen];
  while (queue.length) {
    const n = queue.shift()!;
    if (collapsed.has(n)) continue;
    for (const m of adj.get(n) ?? []) if (!seen.has(m)) seen.add(m), queue.push(m);
  }
  return seen;
}

/** Nodes upstream (ancestors) and downstream (descendants) of `id` along the given edges. */
export function reach(id: string, edges: [string, string][]): { up: Set<string>; down: Set<string> } {
  const walk = (forward: boolean) => {
    const next = new Map<string, string[]>();
    for (const [a, b] of edges) {
      const [from, to] = forward ? [a, b] : [b, a];
      next.set(from, [...(next.get(from) ?? []), to]);
    }
    const seen = new Set<string>();
    const queue = [id];
    while (queue.length) for (const m of next.get(queue.shift()!) ?? []) if (!seen.has(m)) seen.add(m), queue.push(m);
    return seen;
  };
  return { up: walk(false), down: walk(true) };
}

/** A smooth path through dagre's edge points (they avoid the nodes it placed). */
function path(points: { x: number; y: number }[]): string {
  if (points.length < 3) return `M${points.map((p) => `${p.x},${p.y}`).join('L')}`;
  let d = `M${points[0].x},${points[0].y}`;
  for (let i = 1; i < points.length - 1; i++) {
    const p = points[i];
    const q = points[i + 1];
    const end = i === points.length - 2 ? q : { x: (p.x + q.x) / 2, y: (p.y + q.y) / 2 };
    d += `Q${p.x},${p.y} ${end.x},${end.y}`;
  }
  return d;
}

let dagreLoaded: Promise<typeof import('@dagrejs/dagre')> | null = null;

/**
 * Above this many nodes dagre takes seconds (its crossing reduction and coordinate
 * assignment grow faster than linearly: ~0.5 s for 1,000 nodes here), so larger graphs get
 * `quickLayers`, which is linear.
 */
export const DAGRE_MAX_NODES = 600;
const NODESEP = 24;
const RANKSEP = 70;
const MARGIN = 20;

/** Lays the shown part of the graph out left to right, inputs before outputs. */
export async function draw(graph: GraphNode[], shown: Set<string>, collapsed: Set<string>): Promise<Drawing> {
  const all = edgesOf(graph);
  const boxes = new Map<string, Box>();
  for (const n of graph) {
    if (!shown.has(n.id)) continue;
    const name = n.data?.name ?? n.id.slice(n.id.lastIndexOf(':') + 1);
    const namespace = n.data?.namespace ?? '';
    const { lines, cut } = wrap(name);
    const longest = Math.max(...lines.map((l) => l.length), Math.min(namespace.length, MAX_CHARS));
    const w = Math.max(120, Math.ceil(longest * CHAR_W) + 28);
    const h = (lines.length + 1) * LINE_H + 16;
    const hidden = collapsed.has(n.id) ? all.filter(([a, b]) => (a === n.id && !shown.has(b)) || (b === n.id && !shown.has(a))).length : 0;
    const state = n.type === 'JOB' ? (n.data?.latestRun?.state ?? null) : null;
    boxes.set(n.id, { id: n.id, kind: n.type, name, namespace, lines, cut, state, x: 0, y: 0, w, h, hidden });
  }
  const wires = all.filter(([a, b]) => boxes.has(a) && boxes.has(b) && a !== b);
  if (boxes.size > DAGRE_MAX_NODES) return quickLayers([...boxes.values()], wires);
  const dagre = await (dagreLoaded ??= import('@dagrejs/dagre'));
  const g = new dagre.graphlib.Graph();
  g.setGraph({ rankdir: 'LR', nodesep: NODESEP, ranksep: RANKSEP, edgesep: 12, marginx: MARGIN, marginy: MARGIN });
  g.setDefaultEdgeLabel(() => ({}));
  for (const b of boxes.values()) g.setNode(b.id, { width: b.w, height: b.h });
  for (const [a, b] of wires) g.setEdge(a, b);
  dagre.layout(g);
  for (const b of boxes.values()) {
    const p = g.node(b.id);
    b.x = p.x - b.w / 2;
    b.y = p.y - b.h / 2;
  }
  const info = g.graph();
  return {
    boxes: [...boxes.values()],
    wires: wires.map(([a, b]) => ({ from: a, to: b, d: path(g.edge(a, b).points ?? []) })),
    width: info.width ?? 0,
    height: info.height ?? 0,
  };
}

/**
 * A linear layered layout for large graphs: ranks by longest path (cycles broken where
 * they are met), two barycentre sweeps to reduce crossings, ranks stacked and centred.
 * Edges are curves between neighbouring ranks; one that skips ranks may cross a node.
 */
export function quickLayers(boxes: Box[], wires: [string, string][]): Drawing {
  const index = new Map(boxes.map((b, i) => [b.id, i]));
  const n = boxes.length;
  const outs: number[][] = Array.from({ length: n }, () => []);
  const ins: number[][] = Array.from({ length: n }, () => []);
  const indegree = new Array<number>(n).fill(0);
  for (const [a, b] of wires) {
    const i = index.get(a)!;
    const j = index.get(b)!;
    outs[i].push(j);
    ins[j].push(i);
    indegree[j]++;
  }
  // Kahn's order; when only cycles remain, take the first node left and go on.
  const rank = new Array<number>(n).fill(0);
  const done = new Array<boolean>(n).fill(false);
  const queue: number[] = [];
  for (let i = 0; i < n; i++) if (indegree[i] === 0) queue.push(i);
  let next = 0;
  for (let taken = 0; taken < n; ) {
    if (!queue.length) {
      while (done[next]) next++;
      queue.push(next);
    }
    const i = queue.pop()!;
    if (done[i]) continue;
    done[i] = true;
    taken++;
    for (const j of outs[i]) {
      if (done[j]) continue;
      rank[j] = Math.max(rank[j], rank[i] + 1);
      if (--indegree[j] === 0) queue.push(j);
    }
  }
  const layers: number[][] = [];
  for (let i = 0; i < n; i++) (layers[rank[i]] ??= []).push(i);
  const pos = new Array<number>(n).fill(0);
  const place = () => layers.forEach((l) => l.forEach((i, k) => (pos[i] = k / Math.max(1, l.length - 1))));
  place();
  // Each sweep orders a rank by the mean position of its neighbours in the ranks before
  // (downward) or after (upward).
  const sweep = (order: number[][], side: number[][]) => {
    for (const l of order) {
      const key = new Map(l.map((i) => [i, side[i].length ? side[i].reduce((s, j) => s + pos[j], 0) / side[i].length : pos[i]]));
      l.sort((a, b) => key.get(a)! - key.get(b)!);
      l.forEach((i, k) => (pos[i] = k / Math.max(1, l.length - 1)));
    }
  };
  sweep(layers, ins);
  sweep([...layers].reverse(), outs);
  sweep(layers, ins);
  const heights = layers.map((l) => (l ?? []).reduce((s, i) => s + boxes[i].h, 0) + NODESEP * Math.max(0, (l ?? []).length - 1));
  const tallest = Math.max(0, ...heights);
  let x = MARGIN;
  layers.forEach((l, r) => {
    if (!l) return;
    const width = Math.max(...l.map((i) => boxes[i].w));
    let y = MARGIN + (tallest - heights[r]) / 2;
    for (const i of l) {
      boxes[i].x = x + (width - boxes[i].w) / 2;
      boxes[i].y = y;
      y += boxes[i].h + NODESEP;
    }
    x += width + RANKSEP;
  });
  return {
    boxes,
    wires: wires.map(([a, b]) => {
      const s = boxes[index.get(a)!];
      const t = boxes[index.get(b)!];
      const x1 = s.x + s.w;
      const y1 = s.y + s.h / 2;
      const x2 = t.x;
      const y2 = t.y + t.h / 2;
      const dx = Math.max(30, (x2 - x1) / 2);
      return { from: a, to: b, d: `M${x1},${y1}C${x1 + dx},${y1} ${x2 - dx},${y2} ${x2},${y2}` };
    }),
    width: x - RANKSEP + MARGIN,
    height: tallest + 2 * MARGIN,
  };
}
