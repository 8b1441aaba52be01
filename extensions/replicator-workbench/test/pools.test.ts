/**
 * The sidebar's worker pool lines (src/model.ts describePool, poolIdleSeconds): `jlpm test`.
 */

import assert from 'node:assert/strict';
import { test } from 'node:test';

import {
  describePool,
  formatIdle,
  formatSetting,
  IPoolInfo,
  parseSnapshot,
  poolIdleSeconds,
  poolsOf
} from '../src/model';

function pool(fields: Partial<IPoolInfo>): IPoolInfo {
  return {
    backend: 'multi-worker',
    workers: 2,
    processes: 3,
    state: 'idle',
    runs: 3,
    idle_seconds: 0,
    idle_since: null,
    idle_timeout: 600,
    ...fields
  };
}

test('a pool line says backend, workers, processes and state', () => {
  assert.equal(
    describePool(pool({}), 125),
    'multi-worker \u00b7 2 workers \u00b7 3 processes \u00b7 idle 2 min (ends after 10 min idle)'
  );
  assert.equal(
    describePool(pool({ state: 'busy', idle_since: null }), 0),
    'multi-worker \u00b7 2 workers \u00b7 3 processes \u00b7 busy (run 3)'
  );
  assert.equal(
    describePool(pool({ backend: 'async-ps', workers: 1, processes: 1, state: 'retiring', runs: 1 }), 0),
    'async-ps \u00b7 1 worker \u00b7 1 process \u00b7 ends after its run (run 1)'
  );
  assert.equal(
    describePool(pool({ idle_timeout: null }), 10),
    'multi-worker \u00b7 2 workers \u00b7 3 processes \u00b7 idle < 1 min (kept until shut down)'
  );
  assert.match(
    describePool(pool({ idle_timeout: 90 }), 3900),
    /idle 1 h 5 min \(ends after 1 min 30 s idle\)$/
  );
});

test('idle times are coarse, settings exact', () => {
  assert.deepEqual([0, 59, 60, 3599, 3600, 3660].map(formatIdle), [
    '< 1 min',
    '< 1 min',
    '1 min',
    '59 min',
    '1 h',
    '1 h 1 min'
  ]);
  assert.deepEqual([30, 600, 90, 3600, 5400, 0].map(formatSetting), [
    '30 s',
    '10 min',
    '1 min 30 s',
    '1 h',
    '1 h 30 min',
    '0 s'
  ]);
});

test('the idle time goes on from the snapshot, whatever the kernel clock says', () => {
  const message = {
    type: 'snapshot',
    protocol: 1,
    devices: null,
    replicator: null,
    runs: [],
    // A kernel whose clock is an hour behind the browser's: idle_since is not compared with it.
    pools: [pool({ idle_seconds: 100, idle_since: 1000 - 3600 - 100 }), pool({ state: 'busy' })]
  };
  const snapshot = parseSnapshot(message, 1000);
  assert.ok(snapshot);
  const [idle, busy] = poolsOf(snapshot);
  assert.equal(poolIdleSeconds(idle, snapshot, 1000), 100);
  assert.equal(poolIdleSeconds(idle, snapshot, 1045), 145);
  assert.match(describePool(idle, poolIdleSeconds(idle, snapshot, 1045)), / idle 2 min \(ends after 10 min idle\)$/);
  assert.equal(poolIdleSeconds(busy, snapshot, 1045), 0);
  // Without a receipt time (a snapshot made by hand): from idle_since.
  assert.equal(poolIdleSeconds(idle, { ...snapshot, received: undefined }, 1000), 3700);
  // A kernel side without the pool list: none.
  assert.deepEqual(poolsOf(parseSnapshot({ ...message, pools: undefined })), []);
  assert.deepEqual(poolsOf(null), []);
});
