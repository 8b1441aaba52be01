/**
 * The Replicator sidebar: devices, the session's replicator, its warm worker pools with Shut
 * down, active and recent runs with Stop.
 *
 * Plain DOM, redrawn from the latest snapshot (at most a few times a second: the kernel
 * rate-limits its pushes). Class names and data-* attributes are what the browser test reads.
 */

import { Widget } from '@lumino/widgets';

import {
  backendsOf,
  describeConfig,
  describeDevices,
  describeEta,
  describePool,
  describeProgress,
  describeReplicas,
  describeStatus,
  formatCount,
  formatNumber,
  hparamsOf,
  IRunInfo,
  isRunning,
  ISnapshot,
  IStoredRun,
  LinkState,
  LOAD_LINE,
  nameHoldsBackend,
  poolIdleSeconds,
  poolsOf,
  progressFraction,
  SortKey,
  sortAndFilter,
  stateHint,
  studyLineName,
  studyTitle,
  tagLabels
} from './model';

export interface ISidebarActions {
  stop(runId: string): void;
  openFigure(runId: string): void;
  insertTemplate(): void;
  /** Downloads the run's history (CSV) or its dashboard figure (PNG). */
  exportRun(runId: string, what: 'csv' | 'figure'): void;
  /** Opens the run's TensorBoard event files (a `%replicate --tensorboard` cell). */
  tensorboard(runId: string): void;
  /** Asks the kernel for the run store's table (answered with setStoredRuns). */
  requestRuns(): void;
  compare(runIds: string[]): void;
  deleteRuns(runIds: string[], names: string[]): void;
  /** Asks for a new name (unique in the store), then wb.rename_run in the kernel. */
  renameRun(row: IStoredRun): void;
  /** Asks for the run's tags, then wb.tag_run in the kernel. */
  tagRun(row: IStoredRun): void;
  /**
   * Ends the kernel's warm worker pools (idle ones now, a busy one after its run); false when
   * the request could not be sent.
   */
  shutdownPools(): boolean;
}

/** How often an idle pool's idle time is redrawn between snapshots (ms). */
const POOL_TICK_MS = 15000;

/**
 * The table's columns: few, narrow and with short labels, so all fit the default sidebar width
 * (the header's tooltip says what each is); the rest of a run's configuration (backend and
 * replicas unless its name says them, hparams, tags, source, start, global batch, steps per
 * execution, steps/s, loss) is under its name and in its tooltip, and every one of them can be
 * filtered on with the text box. (A config column beside default names, which begin with it,
 * said the backend twice and left the name a third of the width: 8 lines a name.)
 */
const TABLE_COLUMNS: [SortKey, string, string][] = [
  [
    'name',
    'run',
    'The run\u2019s name in the run store; under it its backend (unless the name says it), hparams, tags, notebook and start'
  ],
  ['steps', 'steps', 'Steps done'],
  ['examples_per_sec', 'ex/s', 'Examples per second over the whole run']
];

type Tab = 'kernel' | 'store';

export class ReplicatorSidebar extends Widget {
  constructor(private readonly actions: ISidebarActions) {
    super();
    this.addClass('wb-sidebar');
    this.render('no-kernel', null, '');
    this._ticker = window.setInterval(() => this.updatePools(), POOL_TICK_MS);
  }

  dispose(): void {
    window.clearInterval(this._ticker);
    super.dispose();
  }

  /**
   * Shows the active notebook's kernel (`notebookName` for the header). While only numbers
   * change (a run training), the rows are updated in place: a Stop button under the pointer is
   * never replaced between mouse down and up.
   */
  render(state: LinkState, snapshot: ISnapshot | null, notebookName: string): void {
    this._last = [state, snapshot, notebookName];
    const key = `${this._tab}|${structureKey(state, snapshot, notebookName)}`;
    if (key === this._key && snapshot) {
      for (const run of snapshot.runs) {
        this._rows.get(run.id)?.(run);
      }
      this.updatePools();
      return;
    }
    this._key = key;
    this._rows.clear();
    this._poolTexts = [];
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
    // Two tabs: this kernel's runs (cards) and the run store's table, one click apart however
    // many cards there are.
    const tabs = el('div', 'wb-tabs');
    for (const [tab, label] of [
      ['kernel', 'This kernel'],
      ['store', `Run store (${this._storedRows.length})`]
    ] as [Tab, string][]) {
      const node = button(label, `wb-tab wb-tab-${tab}`, () => this.showTab(tab));
      node.classList.toggle('wb-tab-active', tab === this._tab);
      node.setAttribute('aria-selected', String(tab === this._tab));
      tabs.append(node);
    }
    root.append(tabs);
    if (this._tab === 'store') {
      root.append(this._store);
      return;
    }
    root.append(this.section('Devices', [el('div', 'wb-devices', describeDevices(snapshot.devices))]));
    const repl = snapshot.replicator;
    const replText = repl
      ? describeReplicas(repl.backend, repl.num_replicas, repl.num_workers)
      : 'none chosen yet: %replicate --backend mirrored --replicas 2';
    const template = button('Insert input_fn/step_fn cell', 'wb-insert', () => this.actions.insertTemplate());
    root.append(this.section('Session replicator', [el('div', 'wb-replicator', replText), template]));
    const pools = this.poolsSection(snapshot);
    if (pools) {
      root.append(pools);
    }
    const active = snapshot.runs.filter(isRunning);
    const recent = snapshot.runs.filter(r => !isRunning(r));
    root.append(
      this.section(
        'Active runs',
        active.length ? active.map(r => this.runRow(r)) : [el('div', 'wb-empty', 'No run is training.')]
      )
    );
    const plain = recent.filter(r => !r.group && !r.warmup); // ended warm-ups: untimed, not shown
    if (plain.length) {
      root.append(this.section('Recent runs', plain.map(r => this.runRow(r))));
    }
    // A scaling study: one group, one line per configuration (its warm-up runs hidden once done).
    const groups = new Map<string, IRunInfo[]>();
    for (const r of recent.filter(r => r.group && !r.warmup)) {
      groups.set(r.group as string, [...(groups.get(r.group as string) ?? []), r]);
    }
    for (const [group, runs] of groups) {
      const lines = [...runs].reverse().map(r => this.studyLine(r)); // in the order measured: n=1, 2, 4...
      const node = this.section(studyTitle(group), lines);
      node.classList.add('wb-study');
      root.append(node);
    }
  }

  /** Switches between this kernel's runs and the run store's table. */
  showTab(tab: Tab): void {
    if (tab === this._tab) {
      return;
    }
    this._tab = tab;
    if (tab === 'store') {
      this.actions.requestRuns();
    }
    this.render(...this._last);
  }

  /** The run store's table (every recorded run): sort, filter by backend, pick, compare, delete. */
  setStoredRuns(rows: IStoredRun[]): void {
    this._storedRows = rows;
    const ids = new Set(rows.map(r => r.id));
    this._selected = new Set([...this._selected].filter(id => ids.has(id)));
    this.renderStore();
    const tab = this.node.querySelector('.wb-tab-store');
    if (tab) {
      tab.textContent = `Run store (${rows.length})`;
    }
  }

  private renderStore(): void {
    const store = this._store;
    const title = el('h3', 'wb-section-title', 'Run store');
    title.title = 'Every run recorded in the runs directory: wb.runs() in the notebook';
    store.replaceChildren(title);
    const tools = el('div', 'wb-store-tools');
    const filter = document.createElement('select');
    filter.className = 'wb-filter-backend';
    for (const backend of ['', ...backendsOf(this._storedRows)]) {
      const option = document.createElement('option');
      option.value = backend;
      option.textContent = backend || 'all backends';
      option.selected = backend === (this._backend ?? '');
      filter.append(option);
    }
    filter.addEventListener('change', () => {
      this._backend = filter.value || null;
      this.renderStore();
    });
    const compare = button(`Compare (${this._selected.size})`, 'wb-compare', () =>
      this.actions.compare([...this._selected])
    );
    compare.disabled = this._selected.size < 2;
    compare.title = 'Overlay the loss and throughput of the picked runs (wb.compare_runs)';
    const remove = button('Delete', 'wb-delete', () => {
      const picked = this._storedRows.filter(r => this._selected.has(r.id));
      this.actions.deleteRuns(
        picked.map(r => r.id),
        picked.map(r => r.name || r.id)
      );
    });
    remove.disabled = this._selected.size === 0;
    const refresh = button('Refresh', 'wb-refresh', () => this.actions.requestRuns());
    const one = this._storedRows.find(r => this._selected.size === 1 && this._selected.has(r.id));
    const rename = button('Rename', 'wb-rename', () => one && this.actions.renameRun(one));
    rename.disabled = !one;
    rename.title = 'Rename the picked run (wb.rename_run): names are unique in the run store';
    const tag = button('Tag', 'wb-tag', () => one && this.actions.tagRun(one));
    tag.disabled = !one;
    tag.title = 'Set the picked run\u2019s tags (wb.tag_run)';
    const search = document.createElement('input');
    search.type = 'search';
    search.className = 'wb-filter-text';
    search.placeholder = 'filter: name, #tag, lr=0.1';
    search.title = 'Runs whose name, tags, hparams (as lr=0.1), notebook, backend, status or id hold every word';
    search.value = this._text;
    search.addEventListener('input', () => {
      this._text = search.value;
      this.renderRows();
    });
    tools.append(filter, compare, rename, tag, remove, refresh);
    store.append(tools, search);
    const table = el('table', 'wb-runs-table');
    const head = el('tr', 'wb-runs-head');
    head.append(el('th', 'wb-pick', ''));
    for (const [key, label, title] of TABLE_COLUMNS) {
      const arrow = key === this._sortKey ? (this._descending ? '\u25bc' : '\u25b2') : '';
      const th = el('th', `wb-sort wb-sort-${key}`, label);
      if (arrow) {
        th.append(el('span', 'wb-sort-arrow', arrow)); // its own box: wraps under a long label, never cut
      }
      th.title = `${title} (click to sort)`;
      th.addEventListener('click', () => {
        this._descending = key === this._sortKey ? !this._descending : key !== 'name' && key !== 'backend';
        this._sortKey = key;
        this.renderStore();
      });
      head.append(th);
    }
    table.append(head);
    this._table = table;
    this.renderRows();
    const scroller = el('div', 'wb-runs-scroll');
    scroller.append(table);
    store.append(scroller);
    if (!this._storedRows.length) {
      store.append(el('div', 'wb-empty', 'No recorded run yet.'));
    }
  }

  /** The table's rows (the filter box re-renders only these, so it keeps its focus). */
  private renderRows(): void {
    const table = this._table;
    table.querySelectorAll('.wb-stored-run').forEach(node => node.remove());
    const rows = sortAndFilter(this._storedRows, this._sortKey, this._descending, this._backend, this._text);
    for (const row of rows) {
      const tr = el('tr', 'wb-stored-run');
      tr.dataset.runId = row.id;
      tr.dataset.backend = row.backend ?? '';
      const pick = document.createElement('input');
      pick.type = 'checkbox';
      pick.className = 'wb-pick-run';
      pick.checked = this._selected.has(row.id);
      pick.addEventListener('change', () => {
        if (pick.checked) {
          this._selected.add(row.id);
        } else {
          this._selected.delete(row.id);
        }
        this.renderStore();
      });
      const cell = el('td', 'wb-pick');
      cell.append(pick);
      const name = el('td', 'wb-col-name');
      name.append(el('div', 'wb-stored-name', row.name ?? row.id));
      const hparams = hparamsOf(row);
      if (hparams.length) {
        name.append(el('div', 'wb-stored-hparams', hparams.join(' ')));
      }
      const config = nameHoldsBackend(row.name, row.backend) ? '' : describeConfig(row);
      const details = [config, tagLabels(row).join(' '), sourceName(row.source), startedAt(row.started)];
      name.append(el('div', 'wb-stored-details', details.filter(Boolean).join(' \u00b7 ')));
      tr.dataset.status = row.status ?? '';
      tr.append(
        cell,
        name,
        el('td', 'wb-col-steps', formatCount(row.steps)),
        el('td', 'wb-col-examples_per_sec', formatNumber(row.examples_per_sec))
      );
      tr.title = [
        `${row.name ?? row.id} (${row.id})`,
        `status: ${row.status ?? '?'}`,
        `${describeReplicas(row.backend, row.replicas, row.workers)}${row.ps ? ` \u00b7 ${row.ps} ps` : ''}`,
        `global batch ${formatCount(row.global_batch)} \u00b7 steps/execution ${row.steps_per_execution ?? '\u2013'}`,
        `${formatNumber(row.steps_per_sec)} steps/s \u00b7 ${formatNumber(row.examples_per_sec)} examples/s \u00b7 loss ${formatNumber(row.loss)}`,
        `source: ${row.source ?? '\u2013'}`,
        `tags: ${row.tags || '\u2013'}`,
        ...(hparams.length ? [`hparams: ${hparams.join(', ')}`] : [])
      ].join('\n');
      table.append(tr);
    }
  }

  /**
   * One configuration of a scaling study: the run's steps/s and examples/s, the figures every
   * card, the study's table and its plot show, and the median compiled step's examples/s,
   * labelled as what it is (the compiled calls alone, without the loop's overhead).
   */
  private studyLine(run: IRunInfo): HTMLElement {
    const line = el('div', 'wb-study-line');
    line.dataset.runId = run.id;
    line.dataset.status = run.status;
    const stats = el('div', 'wb-run-stats');
    stats.append(
      el('span', 'wb-run-rate', `${formatNumber(run.steps_per_sec)} steps/s`),
      el('span', 'wb-run-throughput', `${formatNumber(run.examples_per_sec)} examples/s`),
      el('span', 'wb-run-median', `median compiled step ${formatNumber(run.median_examples_per_sec)} examples/s`)
    );
    line.append(el('span', 'wb-run-name', studyLineName(run.name)), stats);
    return line;
  }

  /**
   * The kernel's warm worker pools, one line each, and one Shut down for all; null when there
   * are none. The idle times are redrawn in place (updatePools).
   */
  private poolsSection(snapshot: ISnapshot): HTMLElement | null {
    const pools = poolsOf(snapshot);
    if (!pools.length) {
      return null;
    }
    const lines = pools.map(pool => {
      const line = el('div', 'wb-pool');
      line.dataset.backend = pool.backend;
      line.dataset.state = pool.state;
      const text = el('span', 'wb-pool-text');
      this._poolTexts.push(text);
      line.append(text);
      if (pool.placement) {
        line.append(el('div', 'wb-pool-placement', pool.placement));
      }
      return line;
    });
    this.updatePools();
    const shut = button('Shut down', 'wb-shutdown-pools', () => {
      // Until the next snapshot redraws the section (the kernel answers when its shell is free).
      if (this.actions.shutdownPools()) {
        shut.disabled = true;
        shut.textContent = 'Shutting down\u2026';
      }
    });
    shut.title =
      'End these worker processes: idle pools now, a busy one after its run (the next run starts fresh ones)';
    shut.disabled = pools.every(p => p.state === 'retiring');
    const node = this.section('Worker pools', [...lines, shut]);
    node.classList.add('wb-pools');
    node.title =
      'Worker processes kept up between runs of the same shape: the next such run starts in about a second';
    return node;
  }

  /** Redraws the pool lines' text (an idle pool's idle time goes on between snapshots). */
  private updatePools(): void {
    const snapshot = this._last[1];
    if (!snapshot || !this._poolTexts.length) {
      return;
    }
    const now = Date.now() / 1000;
    poolsOf(snapshot).forEach((pool, i) => {
      const text = this._poolTexts[i];
      if (text) {
        text.textContent = describePool(pool, poolIdleSeconds(pool, snapshot, now));
      }
    });
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
    const config = el('div', 'wb-run-config', describeReplicas(run.backend, run.num_replicas, run.num_workers));
    config.hidden = nameHoldsBackend(run.name, run.backend); // the backend named once
    row.append(config);
    const stats = el('div', 'wb-run-stats');
    const step = el('span', 'wb-run-step');
    const loss = el('span', 'wb-run-loss');
    const rate = el('span', 'wb-run-rate');
    const throughput = el('span', 'wb-run-throughput');
    const eta = el('span', 'wb-run-eta');
    stats.append(step, loss, rate, throughput, eta);
    row.append(stats);
    // Before step 1: what the run is doing (as the cell's header says); the step count replaces it.
    const doing = el('div', 'wb-run-doing');
    row.append(doing);
    const bar = el('div', 'wb-progress');
    const fill = el('div', 'wb-progress-fill');
    bar.append(fill);
    if (isRunning(run)) {
      row.append(bar);
    }
    if (run.heal) {
      row.append(el('div', 'wb-run-heal', run.heal));
    }
    const update = (r: IRunInfo) => {
      row.dataset.snapshot = String(r.snapshot_seq ?? 0); // (what the browser test compares)
      step.textContent = describeProgress(r);
      loss.textContent = `loss ${formatNumber(r.loss)}`;
      rate.textContent = `${formatNumber(r.steps_per_sec)} steps/s`;
      throughput.textContent = `${formatNumber(r.examples_per_sec)} examples/s`;
      eta.textContent = describeEta(r);
      eta.hidden = !eta.textContent;
      doing.textContent = r.doing ?? '';
      doing.hidden = !r.doing;
      const fraction = progressFraction(r);
      bar.hidden = fraction === null;
      fill.style.width = `${(100 * (fraction ?? 0)).toFixed(1)}%`;
    };
    update(run);
    this._rows.set(run.id, update);
    if (run.breakdown) {
      row.append(el('div', 'wb-run-breakdown', run.breakdown));
    }
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
      const actions = el('div', 'wb-run-actions');
      actions.append(
        button('Figure', 'wb-figure', () => this.actions.openFigure(run.id)),
        button('CSV', 'wb-export-csv', () => this.actions.exportRun(run.id, 'csv')),
        button('PNG', 'wb-export-png', () => this.actions.exportRun(run.id, 'figure')),
        button('TensorBoard', 'wb-tensorboard', () => this.actions.tensorboard(run.id))
      );
      row.append(actions);
    }
    return row;
  }

  private _key = '';
  private _last: [LinkState, ISnapshot | null, string] = ['no-kernel', null, ''];
  private _tab: Tab = 'kernel';
  private _text = '';
  private _table: HTMLElement = el('table', 'wb-runs-table');
  private _rows = new Map<string, (run: IRunInfo) => void>();
  private _poolTexts: HTMLElement[] = [];
  private _ticker = 0;
  private _store = el('section', 'wb-section wb-store');
  private _storedRows: IStoredRun[] = [];
  private _selected = new Set<string>();
  private _sortKey: SortKey = 'id';
  private _descending = true;
  private _backend: string | null = null;
}

/** Everything but the numbers of a run and a pool's idle time: when it changes, the sidebar is rebuilt. */
function structureKey(state: LinkState, snapshot: ISnapshot | null, notebookName: string): string {
  return JSON.stringify([
    state,
    notebookName,
    snapshot?.devices ?? null,
    snapshot?.replicator ?? null,
    (snapshot?.runs ?? []).map(r => [r.id, r.status, r.stop_requested, r.reason, r.heal ?? null, r.breakdown ?? null]),
    poolsOf(snapshot).map(p => [p.backend, p.workers, p.processes, p.state, p.runs, p.idle_timeout, p.placement])
  ]);
}

/** 'work/nb01.ipynb' -> 'nb01.ipynb' (the table is narrow; the tooltip has the path). */
function sourceName(source: string | null | undefined): string {
  return source ? source.split('/').pop() ?? source : '';
}

/** Seconds since the epoch -> "Nov 24 14:02" (local time). */
function startedAt(started: number | null | undefined): string {
  if (typeof started !== 'number') {
    return '';
  }
  const d = new Date(started * 1000);
  const month = d.toLocaleString('en-US', { month: 'short' });
  const pad = (n: number) => String(n).padStart(2, '0');
  return `${month} ${d.getDate()} ${pad(d.getHours())}:${pad(d.getMinutes())}`;
}

/** An element with a class (and its text): the sidebar's and the compare view's DOM builder. */
export function el(tag: string, className: string, text?: string): HTMLElement {
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
