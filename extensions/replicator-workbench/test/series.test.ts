/**
 * Unit tests of the compare view's data (src/series.ts) and the run table's hparams
 * (src/model.ts) under node's test runner: `jlpm test`.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';

import { formatHparam, hparamsOf, IStoredRun, rowText, sortAndFilter } from '../src/model';
import {
  alignSeries,
  DEFAULT_SMOOTHING,
  forLogScale,
  formatPowerOfTen,
  IRunSeries,
  logSplits,
  nearestValueIndex,
  parseSeries,
  prefersLog,
  smooth
} from '../src/series';

function close(actual: (number | null)[], expected: (number | null)[]): void {
  assert.equal(actual.length, expected.length);
  actual.forEach((v, i) => {
    const e = expected[i];
    if (v === null || e === null) {
      assert.equal(v, e, `at ${i}`);
    } else {
      assert.ok(Math.abs(v - e) < 1e-9, `at ${i}: ${v} != ${e}`);
    }
  });
}

test('smoothing is TensorBoard\u2019s debiased moving average: 0 raw, constants stay, gaps kept', () => {
  assert.equal(DEFAULT_SMOOTHING, 0.6);
  close(smooth([3, 1, 2], 0), [3, 1, 2]);
  close(smooth([5, 5, 5, 5], 0.9), [5, 5, 5, 5]); // debiased: no pull towards zero at the start
  // By hand, w = 0.5: last = 0.5, 1.5 (/0.5, /0.75) -> 1, 2; a missing value stays missing and
  // does not move the average.
  close(smooth([1, null, 3], 0.5), [1, null, (0.25 + 1.5) / 0.75]);
  close(smooth([1, NaN, 3], 0.5), [1, null, (0.25 + 1.5) / 0.75]);
  // Heavier smoothing lags a step more.
  const step = [0, 0, 0, 10, 10, 10];
  assert.ok((smooth(step, 0.9)[4] as number) < (smooth(step, 0.5)[4] as number));
  // Above the slider's maximum: clamped, not a flat line.
  assert.ok((smooth([0, 10], 1)[1] as number) > 0);
});

test('a log axis drops zeros and negatives instead of breaking; it starts on when the loss spans decades', () => {
  assert.deepEqual(forLogScale([1, 0, -2, null, 1e-12]), [1, null, null, null, 1e-12]);
  const runs = (loss: (number | null)[] | null): IRunSeries[] => [
    { id: 'a', name: 'a', step: loss ? loss.map((_, i) => i + 1) : [], loss, examples_per_sec: null }
  ];
  assert.equal(prefersLog(runs([10, 1, 0.01])), true);
  assert.equal(prefersLog(runs([10, 5, 1])), false);
  assert.equal(prefersLog(runs([10, 0, 0.01])), false); // a zero: linear (as the PNG decides)
  assert.equal(prefersLog(runs(null)), false);
});

test('runs with different steps share one x axis; the hovered value is the nearest step a run has', () => {
  const series = parseSeries([
    { id: 'a', name: 'from b', step: [1, 2, 3], loss: [3, 2, 1], examples_per_sec: [null, 10, 12] },
    { id: 'b', name: 'shared', step: [1, 3, 5], loss: null, examples_per_sec: [5, 6, 7] },
    'junk'
  ]);
  assert.deepEqual(series.map(s => s.name), ['from b', 'shared']);
  assert.deepEqual(alignSeries(series, 'loss'), [[1, 2, 3, 5], [3, 2, 1, null], [null, null, null, null]]);
  assert.deepEqual(alignSeries(series, 'examples_per_sec'), [[1, 2, 3, 5], [null, 10, 12, null], [5, null, 6, 7]]);
  assert.equal(nearestValueIndex([5, null, 6, 7], 1), 0); // the earlier of two equally near
  assert.equal(nearestValueIndex([null, null, 6], 0), 2);
  assert.equal(nearestValueIndex([null, null], 1), null);
  assert.deepEqual(parseSeries(undefined), []); // an older kernel side sends none
});

test('hparams show as name=value, are in the filter\u2019s text, and "lr=0.1" finds those runs', () => {
  assert.equal(formatHparam('lr', 0.1), 'lr=0.1');
  assert.equal(formatHparam('lr', 1e-3), 'lr=0.001');
  assert.equal(formatHparam('opt', 'adam'), 'opt=adam');
  assert.equal(formatHparam('layers', [64, 32]), 'layers=[64,32]');
  assert.equal(formatHparam('nesterov', true), 'nesterov=true');
  const row = (id: string, hparams: IStoredRun['hparams']): IStoredRun =>
    ({ id, name: id, status: 'finished', backend: 'mirrored', steps: 1, duration_s: 1, steps_per_sec: 1, examples_per_sec: 1, loss: 1, hparams }) as IStoredRun;
  const rows = [row('a', { lr: 0.1, batch: 64 }), row('b', { lr: 0.01 }), row('c', null)];
  assert.deepEqual(hparamsOf(rows[0]), ['lr=0.1', 'batch=64']);
  assert.deepEqual(hparamsOf(rows[2]), []);
  assert.match(rowText(rows[0]), /lr=0\.1 batch=64/);
  assert.deepEqual(sortAndFilter(rows, 'id', false, null, 'lr=0.1').map(r => r.id), ['a']);
  assert.deepEqual(sortAndFilter(rows, 'id', false, null, 'LR=').map(r => r.id), ['a', 'b']);
  assert.deepEqual(sortAndFilter(rows, 'id', false, null, 'batch=64 mirrored').map(r => r.id), ['a']);
});

test('a log axis is labelled at powers of ten only, thinned to fit, as 0.001 .. 10,000 or 1e-6', () => {
  assert.deepEqual(logSplits(0.05, 200, 10), [0.1, 1, 10, 100]);
  // Fifteen decades in five labels: every third, counted down from the top.
  assert.deepEqual(logSplits(1e-12, 100, 5), [1e-10, 1e-7, 1e-4, 0.1, 100]);
  assert.deepEqual(logSplits(0, 1, 5), []); // no log axis below zero
  assert.deepEqual([1e-3, 0.1, 1, 1e4, 1e-6, 1e8].map(formatPowerOfTen), ['0.001', '0.1', '1', '10,000', '1e-6', '1e8']);
});
