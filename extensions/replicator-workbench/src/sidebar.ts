/**
 * The Replicator sidebar: devices, the session's replicator, active and recent runs with Stop.
 *
 * Plain DOM, redrawn from the latest snapshot (at most a few times a second: the kernel
 * rate-limits its pushes). Class names and data-* attributes are what the browser test reads.
 */

import { Widget } from '@lumino/widgets';

import {
  describeDevices,
  describeProgress,
  describeReplicas,
  describeStatus,
  formatNumber,
  IRunInfo,
  isRunning,
  ISnapshot,
  LinkState,
  LOAD_LINE,
  progressFraction,
  stateHint
} from './model';

export interface ISidebarActions {
  stop(runId: string): void;
  openFigure(runId: string): void;
  insertTemplate(): void;
}

export class ReplicatorSidebar extends Widget {
  constructor(private readonly actions: ISidebarActions) {
    super();
    this.addClass('wb-sidebar');
    this.render('no-kernel', null, '');
  }

  /**
   * Shows the active notebook's kernel (`notebookName` for the header). While only numbers
   * change (a run training), the rows are updated in place: a Stop button under the pointer is
   * never replaced between mouse down and up.
   */
  render(state: LinkState, snapshot: ISnapshot | null, notebookName: string): void {
    const key = structureKey(state, snapshot, notebookName);
    if (key === this._key && snapshot) {
      for (const run of snapshot.runs) {
        this._rows.get(run.id)?.(run);
      }
      return;
    }
    this._key = key;
    this._rows.clear();
    const root = this.node;
    root.replaceChildren();
    root.dataset.state = state;
    root.append(el('h2', 'wb-title', 'Replicator'));
    if (notebookName) {
      root.append(el('div', 'wb-notebook', notebookName));
    }
    if (state !== 'ready' || !snapshot) {
      const hint = el('div', 'wb-hint', stateHint(state));
      if (state === 'absent') {
        hint.append(el('pre', 'wb-load-line', LOAD_LINE));
      }
      root.append(hint);
      return;
    }
    root.append(this.section('Devices', [el('div', 'wb-devices', describeDevices(snapshot.devices))]));
    const repl = snapshot.replicator;
    const replText = repl
      ? describeReplicas(repl.backend, repl.num_replicas, repl.num_workers)
      : 'none chosen yet: %replicate --backend mirrored --replicas 2';
    const template = button('Insert input_fn/step_fn cell', 'wb-insert', () => this.actions.insertTemplate());
    root.append(this.section('Session replicator', [el('div', 'wb-replicator', replText), template]));
    const active = snapshot.runs.filter(isRunning);
    const recent = snapshot.runs.filter(r => !isRunning(r));
    root.append(
      this.section(
        'Active runs',
        active.length ? active.map(r => this.runRow(r)) : [el('div', 'wb-empty', 'No run is training.')]
      )
    );
    if (recent.length) {
      root.append(this.section('Recent runs', recent.map(r => this.runRow(r))));
    }
  }

  private section(title: string, children: HTMLElement[]): HTMLElement {
    const node = el('section', 'wb-section');
    node.append(el('h3', 'wb-section-title', title), ...children);
    return node;
  }

  private runRow(run: IRunInfo): HTMLElement {
    const row = el('div', 'wb-run');
    row.dataset.runId = run.id;
    row.dataset.status = run.status;
    const head = el('div', 'wb-run-head');
    head.append(
      el('span', 'wb-run-name', run.name),
      el('span', `wb-run-status wb-status-${run.status}`, describeStatus(run))
    );
    row.append(head);
    row.append(el('div', 'wb-run-config', describeReplicas(run.backend, run.num_replicas, run.num_workers)));
    const stats = el('div', 'wb-run-stats');
    const step = el('span', 'wb-run-step');
    const loss = el('span', 'wb-run-loss');
    const rate = el('span', 'wb-run-rate');
    const throughput = el('span', 'wb-run-throughput');
    stats.append(step, loss, rate, throughput);
    row.append(stats);
    const bar = el('div', 'wb-progress');
    const fill = el('div', 'wb-progress-fill');
    bar.append(fill);
    if (isRunning(run)) {
      row.append(bar);
    }
    const update = (r: IRunInfo) => {
      step.textContent = describeProgress(r);
      loss.textContent = `loss ${formatNumber(r.loss)}`;
      rate.textContent = `${formatNumber(r.steps_per_sec)} steps/s`;
      throughput.textContent = `${formatNumber(r.examples_per_sec)} examples/s`;
      const fraction = progressFraction(r);
      bar.hidden = fraction === null;
      fill.style.width = `${(100 * (fraction ?? 0)).toFixed(1)}%`;
    };
    update(run);
    this._rows.set(run.id, update);
    if (isRunning(run)) {
      const stop = button('Stop', 'wb-stop', () => this.actions.stop(run.id));
      stop.title = run.foreground
        ? 'Interrupts the kernel: the run stops cleanly at the next step boundary'
        : 'Asks the background run to stop at the next step boundary';
      stop.disabled = run.stop_requested;
      row.append(stop);
    } else {
      if (run.reason) {
        row.append(el('div', 'wb-run-reason', run.reason));
      }
      row.append(button('Dashboard figure', 'wb-figure', () => this.actions.openFigure(run.id)));
    }
    return row;
  }

  private _key = '';
  private _rows = new Map<string, (run: IRunInfo) => void>();
}

/** Everything but the numbers of a run: when it changes, the sidebar is rebuilt. */
function structureKey(state: LinkState, snapshot: ISnapshot | null, notebookName: string): string {
  return JSON.stringify([
    state,
    notebookName,
    snapshot?.devices ?? null,
    snapshot?.replicator ?? null,
    (snapshot?.runs ?? []).map(r => [r.id, r.status, r.stop_requested, r.reason])
  ]);
}

function el(tag: string, className: string, text?: string): HTMLElement {
  const node = document.createElement(tag);
  node.className = className;
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

function button(label: string, className: string, onClick: () => void): HTMLButtonElement {
  const node = document.createElement('button');
  node.className = `jp-mod-styled wb-button ${className}`;
  node.textContent = label;
  node.addEventListener('click', onClick);
  return node;
}
