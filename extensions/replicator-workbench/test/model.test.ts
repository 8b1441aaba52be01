/**
 * Unit tests of the extension's logic (src/model.ts, src/templates.ts) under node's test runner:
 * `jlpm test` (tests/test_lab_extension.py runs it too).
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';

import {
  backendsOf,
  describeDevices,
  describeEta,
  describeProgress,
  describeReplicas,
  describeStatus,
  formatDuration,
  formatNumber,
  IRunInfo,
  IStoredRun,
  describeConfig,
  formatCount,
  studyLineName,
  studyTitle,
  newlyEndedLongRuns,
  ISnapshot,
  lastEndedRun,
  parseSnapshot,
  progressFraction,
  runningRun,
  sortAndFilter,
  deleteRunsText,
  stateHint,
  statusBarText,
  stopAction
} from '../src/model';
import { templateCell } from '../src/templates';

function run(fields: Partial<IRunInfo>): IRunInfo {
  return {
    id: 'r1',
    name: 'run 1',
    backend: 'mirrored',
    num_replicas: 2,
    num_workers: null,
    status: 'running',
    reason: null,
    foreground: false,
    stop_requested: false,
    first_step: 1,
    step: 0,
    target_step: 1000,
    loss: null,
    metrics: {},
    examples_per_sec: null,
    steps_per_sec: null,
    started: 0,
    ended: null,
    ...fields
  };
}

function snapshot(runs: IRunInfo[], replicator: ISnapshot['replicator'] = null): ISnapshot {
  const devices = { gpus: [], tpus: [], cpus: ['c0', 'c1', 'c2', 'c3'], virtual_cpus: 4, physical_cores: 2 };
  return { type: 'snapshot', protocol: 1, devices, replicator, runs };
}

test('parseSnapshot accepts the kernel snapshot and rejects other messages', () => {
  const s = parseSnapshot({ type: 'snapshot', protocol: 1, devices: null, replicator: null, runs: [] });
  assert.deepEqual(s?.runs, []);
  assert.equal(parseSnapshot({ type: 'figure', png: '' }), null);
  assert.equal(parseSnapshot({ type: 'snapshot' }), null);
  assert.equal(parseSnapshot(null), null);
  assert.equal(parseSnapshot('snapshot'), null);
});

test('Stop interrupts the kernel for a foreground run and sends a message for a background one', () => {
  const fg = run({ id: 'fg', foreground: true });
  const bg = run({ id: 'bg', foreground: false });
  const done = run({ id: 'done', status: 'finished' });
  assert.deepEqual(stopAction(snapshot([fg, done])), { kind: 'interrupt', run: fg });
  assert.deepEqual(stopAction(snapshot([bg, done])), { kind: 'message', run: bg });
  assert.deepEqual(stopAction(snapshot([bg, fg]), 'fg'), { kind: 'interrupt', run: fg });
  assert.deepEqual(stopAction(snapshot([done])), { kind: 'none', run: null });
  assert.deepEqual(stopAction(snapshot([bg]), 'done'), { kind: 'none', run: null });
  assert.deepEqual(stopAction(null), { kind: 'none', run: null });
});

test('the status bar shows backend, replicas and steps/s of the running run', () => {
  const training = run({ steps_per_sec: 1234.4, num_replicas: 4 });
  assert.equal(statusBarText('ready', snapshot([training])), 'mirrored \u00b7 4 replicas \u00b7 1,234 steps/s');
  assert.equal(
    statusBarText('ready', snapshot([run({ steps_per_sec: null })])),
    'mirrored \u00b7 2 replicas \u00b7 compiling'
  );
  const idle = snapshot([run({ status: 'stopped' })], { backend: 'single', num_replicas: 1 });
  assert.equal(statusBarText('ready', idle), 'single \u00b7 1 replica');
  const after = snapshot([run({ status: 'finished', steps_per_sec: 812.4 })], { backend: 'single', num_replicas: 1 });
  assert.equal(statusBarText('ready', after), 'single \u00b7 1 replica \u00b7 run 1: 812 steps/s');
  // A default name holds the backend already: not named twice.
  const named = snapshot(
    [run({ status: 'finished', steps_per_sec: 812, backend: 'single', name: 'single \u00b7 nb01 \u00b7 14:02' })],
    { backend: 'single', num_replicas: 1 }
  );
  assert.equal(statusBarText('ready', named), 'single \u00b7 1 replica \u00b7 last run: 812 steps/s');
  assert.equal(statusBarText('ready', snapshot([])), '');
  assert.equal(statusBarText('absent', snapshot([training])), '');
  assert.equal(statusBarText('connecting', null), '');
});

test('runningRun and lastEndedRun pick the newest of their kind (snapshots are newest first)', () => {
  const runs = [run({ id: 'a', status: 'running' }), run({ id: 'b', status: 'stopped' }), run({ id: 'c', status: 'finished' })];
  assert.equal(runningRun(snapshot(runs))?.id, 'a');
  assert.equal(lastEndedRun(snapshot(runs))?.id, 'b');
  assert.equal(runningRun(snapshot([runs[2]])), null);
  assert.equal(lastEndedRun(null), null);
});

test('numbers, devices, replicas and progress read as a person writes them', () => {
  assert.equal(formatNumber(1234.5), '1,235');
  assert.equal(formatNumber(12.345), '12.3');
  assert.equal(formatNumber(0.5), '0.5');
  assert.equal(formatNumber(0.01234), '0.012');
  assert.equal(formatNumber(0.000123), '0.000123');
  assert.equal(formatNumber(0), '0');
  assert.equal(formatNumber(null), '\u2013');
  assert.equal(formatNumber(Number.NaN), '\u2013');
  assert.equal(describeReplicas('multi-worker', 4, 2), 'multi-worker \u00b7 4 replicas \u00b7 2 workers');
  assert.equal(describeReplicas('single', 1), 'single \u00b7 1 replica');
  assert.equal(describeDevices(snapshot([]).devices), '4 CPU devices (virtual) \u00b7 2 cores');
  assert.equal(
    describeDevices({ gpus: ['g0', 'g1'], tpus: [], cpus: ['c0'], virtual_cpus: 1, physical_cores: null }),
    '2 GPUs'
  );
  assert.equal(describeDevices(null), 'unknown');
  assert.equal(describeProgress(run({ step: 1200, target_step: 5000 })), 'step 1,200 / 5,000');
  assert.equal(describeProgress(run({ step: 7, target_step: null })), 'step 7');
  assert.equal(progressFraction(run({ step: 250, target_step: 1000 })), 0.25);
  // A resumed run (first step 501) counts its own steps: the kernel sends them relative.
  assert.equal(progressFraction(run({ first_step: 501, step: 500, target_step: 1000 })), 0.5);
  assert.equal(describeEta(run({ eta_seconds: 185.2 })), 'ETA 3 min 5 s');
  assert.equal(describeEta(run({ eta_seconds: null })), 'ETA \u2013');
  assert.equal(describeEta(run({ status: 'finished', eta_seconds: 3 })), '');
  assert.equal(formatDuration(42.4), '42 s');
  assert.equal(formatDuration(7800), '2 h 10 min');
  assert.equal(progressFraction(run({ target_step: null })), null);
  assert.equal(describeStatus(run({ stop_requested: true })), 'stopping\u2026');
  assert.equal(describeStatus(run({ status: 'stopped', stop_requested: true })), 'stopped');
});

test('without the kernel helper the sidebar says how to load it', () => {
  assert.match(stateHint('absent'), /%load_ext workbench/);
  assert.match(stateHint('no-kernel'), /Open a notebook/);
  assert.equal(stateHint('ready'), '');
});

test('the template cell is a %%replicate cell defining input_fn and step_fn', () => {
  const fresh = templateCell(null);
  assert.match(fresh, /^%%replicate --backend mirrored --replicas 2 --steps 300\n/);
  assert.match(fresh, /\ndef input_fn\(ctx\):\n/);
  assert.match(fresh, /\ndef step_fn\(x, y\):\n/);
  assert.match(fresh, /repl\.wrap_optimizer/);
  // With a session replicator the cell reuses it.
  const chosen = templateCell(snapshot([], { backend: 'mirrored', num_replicas: 4 }), 50);
  assert.match(chosen, /^%%replicate --steps 50\n/);
});

test('the runs table sorts (missing values last), filters by backend, lists the backends', () => {
  const row = (id: string, backend: string, sps: number | null): IStoredRun => ({
    id, name: id, status: 'finished', backend, num_replicas: 2, steps: 10, duration_s: 1,
    steps_per_sec: sps, examples_per_sec: null, loss: null
  });
  const rows = [row('a', 'mirrored', 5), row('b', 'single', null), row('c', 'mirrored', 9)];
  assert.deepEqual(sortAndFilter(rows, 'steps_per_sec', true, null).map(r => r.id), ['c', 'a', 'b']);
  assert.deepEqual(sortAndFilter(rows, 'steps_per_sec', false, null).map(r => r.id), ['a', 'c', 'b']);
  assert.deepEqual(sortAndFilter(rows, 'id', false, 'mirrored').map(r => r.id), ['a', 'c']);
  assert.deepEqual(backendsOf(rows), ['mirrored', 'single']);
});

test('a notification is due for a long run that just ended, not for short ones or warm-ups', () => {
  const before = snapshot([run({ id: 'long', started: 0 }), run({ id: 'short', started: 0 })]);
  const after = snapshot([
    run({ id: 'long', status: 'finished', started: 0, ended: 45 }),
    run({ id: 'short', status: 'finished', started: 0, ended: 5 })
  ]);
  assert.deepEqual(newlyEndedLongRuns(before, after).map(r => r.id), ['long']);
  assert.deepEqual(newlyEndedLongRuns(after, after), []);
  // The kernel sets the threshold (WORKBENCH_NOTIFY_AFTER): 1 s makes the 5 s run long too.
  assert.deepEqual(newlyEndedLongRuns(before, { ...after, notify_after_seconds: 1 }).map(r => r.id), ['long', 'short']);
});

test('store table: text filter over name, tags, source; counts as integers; configs; study labels', () => {
  const rows = [
    { id: 'a', name: 'baseline', status: 'finished', backend: 'mirrored', replicas: 4, tags: 'best, lr', source: 'nb01.ipynb', steps: 40, duration_s: 1, steps_per_sec: 1, examples_per_sec: 1, loss: 1 },
    { id: 'b', name: 'other', status: 'failed', backend: 'async-ps', replicas: 2, workers: 2, ps: 1, tags: '', source: 'train.py', steps: 3, duration_s: 1, steps_per_sec: 1, examples_per_sec: 1, loss: 1 }
  ] as IStoredRun[];
  assert.deepEqual(sortAndFilter(rows, 'id', false, null, 'best').map(r => r.id), ['a']);
  // The tag as the table shows it ("#best") finds the run too; "#other" (a name) does not.
  assert.deepEqual(sortAndFilter(rows, 'id', false, null, '#best').map(r => r.id), ['a']);
  assert.deepEqual(sortAndFilter(rows, 'id', false, null, '#other').map(r => r.id), []);
  // The delete dialog names the runs it deletes.
  assert.match(deleteRunsText(['baseline', 'other']), /^\u2022 baseline\n\u2022 other\n\nTheir folders/);
  const many = deleteRunsText(Array.from({ length: 11 }, (_, i) => `run ${i}`));
  assert.match(many, /\u2022 run 7\nand 3 more\n/);
  assert.deepEqual(sortAndFilter(rows, 'id', false, null, 'train failed').map(r => r.id), ['b']);
  assert.deepEqual(sortAndFilter(rows, 'id', false, null, '').map(r => r.id), ['a', 'b']);
  assert.equal(formatCount(40.0), '40');
  assert.equal(formatCount(1200.4), '1,200');
  assert.equal(formatCount(null), '\u2013');
  assert.equal(describeConfig(rows[0]), 'mirrored x4');
  assert.equal(describeConfig(rows[1]), 'async-ps 2w 1ps');
  assert.equal(studyTitle('scaling weak \u00b7 mirrored \u00b7 14:02:33'), 'Scaling study \u00b7 weak \u00b7 mirrored \u00b7 14:02:33');
  assert.equal(studyLineName('scaling weak n=2 \u00b7 mirrored \u00b7 14:02:33'), 'n=2');
});
