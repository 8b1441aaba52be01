/**
 * The extension's logic without JupyterLab: the kernel's messages, what to show, what Stop does.
 *
 * The kernel side is workbench/_src/sinks/labcomm.py; its docstring defines the protocol. Everything
 * here is a pure function of a snapshot, so it is unit-tested under node (test/model.test.ts).
 */

/** The comm target that `%load_ext workbench` registers in the kernel. */
export const COMM_TARGET = 'workbench.lab';

/** The protocol version this frontend speaks (labcomm.PROTOCOL). */
export const PROTOCOL = 1;

/** What the user runs to connect a kernel to the sidebar. */
export const LOAD_LINE = '%load_ext workbench';

export interface IDevices {
  gpus: string[];
  tpus: string[];
  cpus: string[];
  virtual_cpus: number;
  physical_cores: number | null;
}

export interface IReplicatorInfo {
  backend: string;
  num_replicas?: number | null;
  num_workers?: number | null;
  num_ps?: number | null;
}

export interface IRunInfo {
  id: string;
  name: string;
  backend: string | null;
  num_replicas: number | null;
  num_workers: number | null;
  status: string;
  reason: string | null;
  /** Where a step's time goes, one sentence (run.diagnosis()); absent from older kernels. */
  breakdown?: string | null;
  foreground: boolean;
  stop_requested: boolean;
  first_step: number | null;
  step: number;
  target_step: number | null;
  loss: number | null;
  metrics: { [name: string]: number | null };
  examples_per_sec: number | null;
  steps_per_sec: number | null;
  /** The median step's examples/s (the compiled calls alone); always labelled "median". */
  median_examples_per_sec?: number | null;
  /** Seconds to go at the current steps/s (null before the first timed chunk). */
  eta_seconds?: number | null;
  /** Which of the run's snapshots these figures are (1, 2, ...: its dashboard shows the same). */
  snapshot_seq?: number | null;
  /** A scaling study's runs share a group ("scaling weak"); its warm-up runs are marked. */
  group?: string | null;
  warmup?: boolean;
  /** The last heal of a run with max_restarts, in one line ("worker 1 lost (...) at step 312: ..."). */
  heal?: string | null;
  /** Before step 1, what the run is doing now ("starting 3 processes ...", "compiling step_fn ..."); null after. */
  doing?: string | null;
  started: number | null;
  ended: number | null;
}

/** A row of the run store's table (wb.runs()), every recorded run of the runs directory. */
export interface IStoredRun {
  id: string;
  name: string | null;
  status: string | null;
  backend: string | null;
  replicas?: number | null;
  workers?: number | null;
  ps?: number | null;
  global_batch?: number | null;
  steps_per_execution?: number | string | null;
  source?: string | null;
  /** Comma-separated (wb.tag_run). */
  tags?: string | null;
  /** Seconds since the epoch. */
  started?: number | null;
  steps: number | null;
  duration_s: number | null;
  steps_per_sec: number | null;
  examples_per_sec: number | null;
  loss: number | null;
  group?: string | null;
  /** The run's `hparams=` as recorded ({lr: 0.1, ...}); null without. */
  hparams?: { [name: string]: unknown } | null;
  [column: string]: unknown;
}

export type SortKey =
  | 'id'
  | 'name'
  | 'backend'
  | 'replicas'
  | 'global_batch'
  | 'started'
  | 'steps'
  | 'steps_per_sec'
  | 'examples_per_sec'
  | 'loss';

/** One hparam as shown and filtered on: "lr=0.1", "opt=adam", "layers=[64,32]". */
export function formatHparam(name: string, value: unknown): string {
  const text =
    typeof value === 'string' ? value : typeof value === 'number' ? String(value) : JSON.stringify(value) ?? '';
  return `${name}=${text}`;
}

/** A run's hparams, in the order recorded: ["lr=0.1", "batch=128"] ([] without). */
export function hparamsOf(row: IStoredRun): string[] {
  const hparams = row.hparams;
  if (!hparams || typeof hparams !== 'object') {
    return [];
  }
  return Object.entries(hparams).map(([name, value]) => formatHparam(name, value));
}

/** A run's tags as the table shows them: "best, lr" -> ["#best", "#lr"]. */
export function tagLabels(row: IStoredRun): string[] {
  return (row.tags || '')
    .split(',')
    .map(t => t.trim())
    .filter(Boolean)
    .map(t => `#${t}`);
}

/**
 * What a row is found by in the table's filter box: name, tags (also as shown, "#best"), source,
 * backend, status, id and its hparams as "lr=0.1" (so "lr=0.1" finds exactly those runs).
 */
export function rowText(row: IStoredRun): string {
  return [row.name, row.tags, ...tagLabels(row), row.source, row.backend, row.status, row.id, ...hparamsOf(row)]
    .filter(v => typeof v === 'string')
    .join(' ')
    .toLowerCase();
}

/**
 * The table's rows sorted by `key` (missing values last), optionally only one backend and only
 * rows whose name, tags, source, backend, status or hparams hold every word of `text`.
 */
export function sortAndFilter(
  rows: IStoredRun[],
  key: SortKey,
  descending: boolean,
  backend: string | null,
  text = ''
): IStoredRun[] {
  const words = text.toLowerCase().split(/\s+/).filter(Boolean);
  const kept = rows.filter(r => (!backend || r.backend === backend) && words.every(w => rowText(r).includes(w)));
  const value = (r: IStoredRun): number | string | null => {
    const v = r[key];
    return typeof v === 'number' || typeof v === 'string' ? v : null;
  };
  return kept.sort((a, b) => {
    const x = value(a);
    const y = value(b);
    if (x === null || y === null) {
      return x === y ? 0 : x === null ? 1 : -1;
    }
    const order = x < y ? -1 : x > y ? 1 : 0;
    return descending ? -order : order;
  });
}

/** The backends present in the table, for the filter. */
export function backendsOf(rows: IStoredRun[]): string[] {
  return [...new Set(rows.map(r => r.backend).filter((b): b is string => typeof b === 'string'))].sort();
}

/** 42 -> "42 s"; 185 -> "3 min 5 s"; 7800 -> "2 h 10 min"; null -> "–" (figures.fmt_duration). */
export function formatDuration(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) {
    return '\u2013';
  }
  const s = Math.round(seconds);
  if (s < 60) {
    return `${s} s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)} min ${s % 60} s`;
  }
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

/** A run that ended since the previous snapshot and ran at least `longSeconds`: worth a notification. */
export function newlyEndedLongRuns(
  before: ISnapshot | null,
  after: ISnapshot | null,
  longSeconds?: number
): IRunInfo[] {
  if (!before || !after) {
    return [];
  }
  const long = longSeconds ?? after.notify_after_seconds ?? 30;
  const wasRunning = new Set(before.runs.filter(isRunning).map(r => r.id));
  return after.runs.filter(
    r =>
      wasRunning.has(r.id) &&
      !isRunning(r) &&
      !r.warmup &&
      r.started !== null &&
      r.ended !== null &&
      r.ended - r.started >= long
  );
}

/**
 * A warm worker pool of the kernel (workbench/_src/launch/pool.py `describe()`): the processes a
 * process backend keeps up between runs of the same shape.
 */
export interface IPoolInfo {
  backend: string;
  workers: number;
  processes: number;
  /** 'busy' (a run has it), 'idle' (waits for the next run), 'retiring' (ends after its run). */
  state: string;
  /** Runs started on the pool. */
  runs: number;
  /** Seconds idle when the kernel sent the snapshot (0 unless idle). */
  idle_seconds: number;
  /** When it went idle, seconds since the epoch on the kernel's clock; null unless idle. */
  idle_since: number | null;
  /** It ends after this many seconds idle; null or 0: kept until shut down. */
  idle_timeout: number | null;
  /** A Ray pool's placement: "Ray (local): node-a, node-b". */
  placement?: string;
}

export interface ISnapshot {
  type: 'snapshot';
  protocol: number;
  devices: IDevices | null;
  replicator: IReplicatorInfo | null;
  runs: IRunInfo[];
  /** Runs at least this long raise a notification when they end unseen (WORKBENCH_NOTIFY_AFTER). */
  notify_after_seconds?: number;
  /** The kernel's warm worker pools (none from a kernel side older than the pool list). */
  pools?: IPoolInfo[];
  /** When the snapshot arrived, seconds since the epoch on the browser's clock (set by parseSnapshot). */
  received?: number;
}

/**
 * Where the active notebook's kernel stands:
 * no-kernel (none, or no notebook), connecting (asked, no answer yet: the kernel may be busy),
 * absent (answered: the workbench is not loaded), ready (snapshots arrive).
 */
export type LinkState = 'no-kernel' | 'connecting' | 'absent' | 'ready';

/** What Stop does: interrupt the kernel (a foreground run holds the shell), or ask over the comm. */
export interface IStopAction {
  kind: 'interrupt' | 'message' | 'none';
  run: IRunInfo | null;
}

/**
 * A snapshot message from the kernel, or null when `data` is something else. `now`: when it
 * arrived (seconds since the epoch), from which an idle pool's idle time is counted on.
 */
export function parseSnapshot(data: unknown, now: number = Date.now() / 1000): ISnapshot | null {
  if (typeof data !== 'object' || data === null) {
    return null;
  }
  const message = data as { [key: string]: unknown };
  if (message.type !== 'snapshot' || !Array.isArray(message.runs)) {
    return null;
  }
  return {
    type: 'snapshot',
    protocol: typeof message.protocol === 'number' ? message.protocol : 0,
    devices: (message.devices as IDevices | null) ?? null,
    replicator: (message.replicator as IReplicatorInfo | null) ?? null,
    runs: message.runs as IRunInfo[],
    notify_after_seconds:
      typeof message.notify_after_seconds === 'number' ? message.notify_after_seconds : undefined,
    pools: Array.isArray(message.pools) ? (message.pools as IPoolInfo[]) : [],
    received: now
  };
}

/**
 * How long `pool` has been idle at `now` (seconds since the epoch, the browser's clock): the
 * kernel's idle_seconds plus the time since the snapshot arrived, so a kernel whose clock differs
 * from the browser's (a remote server) still reads right; 0 unless idle.
 */
export function poolIdleSeconds(pool: IPoolInfo, snapshot: ISnapshot, now: number = Date.now() / 1000): number {
  if (pool.state !== 'idle') {
    return 0;
  }
  if (typeof snapshot.received === 'number') {
    return Math.max(0, (pool.idle_seconds ?? 0) + now - snapshot.received);
  }
  return typeof pool.idle_since === 'number' ? Math.max(0, now - pool.idle_since) : pool.idle_seconds ?? 0;
}

/** An idle time, coarse (the sidebar redraws it every 15 s): "< 1 min", "2 min", "1 h 5 min". */
export function formatIdle(seconds: number): string {
  const minutes = Math.floor(seconds / 60);
  if (minutes < 1) {
    return '< 1 min';
  }
  if (minutes < 60) {
    return `${minutes} min`;
  }
  const rest = minutes % 60;
  return rest ? `${Math.floor(minutes / 60)} h ${rest} min` : `${Math.floor(minutes / 60)} h`;
}

/** A setting in seconds, exact and without zero parts: 600 -> "10 min", 90 -> "1 min 30 s", 3600 -> "1 h". */
export function formatSetting(seconds: number): string {
  const s = Math.round(seconds);
  const parts: string[] = [];
  if (s >= 3600) {
    parts.push(`${Math.floor(s / 3600)} h`);
  }
  if (Math.floor((s % 3600) / 60)) {
    parts.push(`${Math.floor((s % 3600) / 60)} min`);
  }
  if (s % 60 || !parts.length) {
    parts.push(`${s % 60} s`);
  }
  return parts.join(' ');
}

/**
 * One pool's line in the sidebar: "multi-worker · 2 workers · 3 processes · idle 2 min (ends
 * after 10 min idle)", "... · busy (run 3)", "... · ends after its run (run 3)".
 */
export function describePool(pool: IPoolInfo, idleSeconds: number): string {
  const processes = `${pool.processes} ${pool.processes === 1 ? 'process' : 'processes'}`;
  const parts = [pool.backend, plural(pool.workers, 'worker'), processes];
  if (pool.state === 'idle') {
    const ends = pool.idle_timeout
      ? `ends after ${formatSetting(pool.idle_timeout)} idle`
      : 'kept until shut down';
    parts.push(`idle ${formatIdle(idleSeconds)} (${ends})`);
  } else if (pool.state === 'busy') {
    parts.push(`busy (run ${pool.runs})`);
  } else if (pool.state === 'retiring') {
    parts.push(`ends after its run (run ${pool.runs})`);
  } else {
    parts.push(pool.state);
  }
  return parts.join(' \u00b7 ');
}

/** The kernel's pools (an empty list when there are none or the kernel side predates them). */
export function poolsOf(snapshot: ISnapshot | null): IPoolInfo[] {
  return snapshot?.pools ?? [];
}

export function isRunning(run: IRunInfo): boolean {
  return run.status === 'running' || run.status === 'created';
}

/** The newest running run (snapshots list runs newest first), or null. */
export function runningRun(snapshot: ISnapshot | null): IRunInfo | null {
  if (!snapshot) {
    return null;
  }
  return snapshot.runs.find(isRunning) ?? null;
}

/** How to stop `run` (default: the newest running run). */
export function stopAction(snapshot: ISnapshot | null, runId?: string): IStopAction {
  const run = runId
    ? snapshot?.runs.find(r => r.id === runId && isRunning(r)) ?? null
    : runningRun(snapshot);
  if (!run) {
    return { kind: 'none', run: null };
  }
  return { kind: run.foreground ? 'interrupt' : 'message', run };
}

/** The newest ended run: the one "open the last run's dashboard figure" shows. */
export function lastEndedRun(snapshot: ISnapshot | null): IRunInfo | null {
  if (!snapshot) {
    return null;
  }
  return snapshot.runs.find(r => !isRunning(r) && !r.warmup) ?? null;
}

/**
 * 1234.5 -> "1,235"; 12.345 -> "12.3"; 0.01234 -> "0.012"; null -> "–". The kernel's
 * workbench/_src/core/run_stats.py `fmt` follows the same rules, so both print a figure identically.
 */
export function formatNumber(value: number | null | undefined): string {
  if (value === null || value === undefined || !Number.isFinite(value)) {
    return '\u2013';
  }
  const size = Math.abs(value);
  if (size >= 100) {
    return Math.round(value).toLocaleString('en-US');
  }
  if (size >= 10) {
    return value.toFixed(1);
  }
  if (size >= 0.01 || size === 0) {
    return value.toFixed(size === 0 ? 0 : 3).replace(/\.?0+$/, '') || '0';
  }
  return value.toPrecision(3);
}

/** A count (steps, replicas): always an integer, "40" not "40.0"; "1,200"; null -> "–". */
export function formatCount(value: number | null | undefined): string {
  if (value === null || value === undefined || !Number.isFinite(value)) {
    return '\u2013';
  }
  return Math.round(value).toLocaleString('en-US');
}

/**
 * "mirrored x4", "async-ps 2w 1ps", "single": a run's configuration in a table cell; the kernel's
 * run.backend_label, with which default run names begin ("mirrored x4 · nb01 · 14:02").
 */
export function describeConfig(row: IStoredRun): string {
  const backend = row.backend ?? '?';
  if (row.ps) {
    return `${backend} ${row.workers ?? '?'}w ${row.ps}ps`;
  }
  return typeof row.replicas === 'number' && row.replicas > 1 ? `${backend} x${row.replicas}` : backend;
}

/**
 * Whether a run's name already says its backend (a default name, "mirrored x2 · nb01 · 14:02"):
 * then the backend is not named again beside it (the card's config line, the status bar).
 */
export function nameHoldsBackend(name: string | null | undefined, backend: string | null | undefined): boolean {
  return !!name && !!backend && name.startsWith(backend);
}

/** "scaling weak · mirrored · 14:02:33" -> "Scaling study · weak · mirrored · 14:02:33". */
export function studyTitle(group: string): string {
  return `Scaling study \u00b7 ${group.replace(/^scaling /, '')}`;
}

/** "scaling weak n=2 · mirrored · 14:02:33" -> "n=2" (the study's line for that configuration). */
export function studyLineName(name: string): string {
  const match = /^scaling \w+ (n=\d+)/.exec(name);
  return match ? match[1] : name;
}

function plural(count: number, word: string): string {
  return `${count} ${word}${count === 1 ? '' : 's'}`;
}

/** "mirrored · 2 replicas", "multi-worker · 4 replicas · 2 workers". */
export function describeReplicas(
  backend: string | null | undefined,
  replicas: number | null | undefined,
  workers?: number | null
): string {
  const parts = [backend ?? 'unknown backend'];
  if (typeof replicas === 'number') {
    parts.push(plural(replicas, 'replica'));
  }
  if (typeof workers === 'number') {
    parts.push(plural(workers, 'worker'));
  }
  return parts.join(' \u00b7 ');
}

/** "8 CPU devices (virtual) · 2 cores" or "4 GPUs". */
export function describeDevices(devices: IDevices | null): string {
  if (!devices) {
    return 'unknown';
  }
  const parts: string[] = [];
  if (devices.tpus.length) {
    parts.push(plural(devices.tpus.length, 'TPU'));
  }
  if (devices.gpus.length) {
    parts.push(plural(devices.gpus.length, 'GPU'));
  }
  if (!devices.gpus.length && !devices.tpus.length) {
    const virtual = devices.cpus.length > 1 ? ' (virtual)' : '';
    parts.push(`${plural(devices.cpus.length, 'CPU device')}${virtual}`);
  }
  if (devices.physical_cores) {
    parts.push(plural(devices.physical_cores, 'core'));
  }
  return parts.join(' \u00b7 ');
}

/** "step 1,200 / 5,000" (or "step 1,200" for an open-ended run). */
export function describeProgress(run: IRunInfo): string {
  const step = `step ${run.step.toLocaleString('en-US')}`;
  return run.target_step ? `${step} / ${run.target_step.toLocaleString('en-US')}` : step;
}

/** 0..1, or null when the run has no target (step and target count from the run's start). */
export function progressFraction(run: IRunInfo): number | null {
  if (!run.target_step) {
    return null;
  }
  return Math.min(1, Math.max(0, run.step / run.target_step));
}

/** "ETA 3 min 5 s" while a run with a target trains; '' otherwise. */
export function describeEta(run: IRunInfo): string {
  if (!isRunning(run) || !run.target_step) {
    return '';
  }
  return `ETA ${formatDuration(run.eta_seconds)}`;
}

/** A run's status as shown: "running", "stopping…", "stopped", ... */
export function describeStatus(run: IRunInfo): string {
  if (isRunning(run) && run.stop_requested) {
    return 'stopping\u2026';
  }
  return run.status;
}

/**
 * The status bar's text: backend · replicas · steps/s of the running run; when nothing runs,
 * the session's replicator and the last run's steps/s (the figure its summary shows); '' when
 * there is nothing to say (the item hides). The backend is named once.
 */
export function statusBarText(state: LinkState, snapshot: ISnapshot | null): string {
  if (state !== 'ready' || !snapshot) {
    return '';
  }
  const run = runningRun(snapshot);
  if (run) {
    const rate = run.steps_per_sec === null ? 'compiling' : `${formatNumber(run.steps_per_sec)} steps/s`;
    return `${describeReplicas(run.backend, run.num_replicas, run.num_workers)} \u00b7 ${rate}`;
  }
  const repl = snapshot.replicator;
  const parts = repl ? [describeReplicas(repl.backend, repl.num_replicas, repl.num_workers)] : [];
  const last = lastEndedRun(snapshot);
  if (last && last.steps_per_sec !== null) {
    // A default name repeats the backend said just before: "last run" instead (its tooltip names it).
    const label = nameHoldsBackend(last.name, last.backend) ? 'last run' : last.name;
    parts.push(`${label}: ${formatNumber(last.steps_per_sec)} steps/s`);
  }
  return parts.join(' \u00b7 ');
}

/** The sidebar's one-line explanation for states other than 'ready'. */
export function stateHint(state: LinkState): string {
  switch (state) {
    case 'no-kernel':
      return 'Open a notebook with a running Python kernel to see its replicator and runs.';
    case 'connecting':
      return 'Waiting for the kernel to answer (it answers when the cell it is running ends)\u2026';
    case 'absent':
      return `The workbench is not loaded in this notebook's kernel. Run ${LOAD_LINE} in a cell to connect this sidebar.`;
    case 'ready':
      return '';
  }
}

/**
 * The delete dialog's text: which runs go, by name (the first `shown`, then how many more),
 * then what is removed.
 */
export function deleteRunsText(names: string[], shown = 8): string {
  const listed = names.slice(0, shown).map(n => `\u2022 ${n}`);
  if (names.length > shown) {
    listed.push(`and ${names.length - shown} more`);
  }
  return [
    ...listed,
    '',
    'Their folders (history, events, figure, TensorBoard files) are removed from the run store.'
  ].join('\n');
}
