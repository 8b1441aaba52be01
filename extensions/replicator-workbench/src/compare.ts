/**
 * The compare view (the sidebar's Compare): the picked runs' loss and examples/s as interactive
 * uPlot charts (values on hover, TensorBoard-style smoothing, a log/linear loss axis) in the
 * JupyterLab theme's colours, the kernel's table under them, and its PNG (wb.compare_runs).
 *
 * The data logic (smoothing, log filtering, one x axis) is in series.ts; this file is the DOM.
 * Class names and data-* attributes are what the browser test reads.
 */

import { Widget } from '@lumino/widgets';
import uPlot from 'uplot';

import { formatCount, formatNumber, IStoredRun } from './model';
import { el } from './sidebar';
import {
  alignSeries,
  Curve,
  DEFAULT_SMOOTHING,
  forLogScale,
  formatPowerOfTen,
  IRunSeries,
  logSplits,
  MAX_SMOOTHING,
  nearestValueIndex,
  parseSeries,
  prefersLog,
  smooth
} from './series';

/** The compare table's columns (the kernel's compare_runs DataFrame), labelled as what they are. */
const TABLE_COLUMNS: [string, string][] = [
  ['name', 'run'],
  ['backend', 'backend'],
  ['num_replicas', 'replicas'],
  ['steps', 'steps'],
  ['steps_per_sec', 'steps/s'],
  ['examples_per_sec', 'examples/s'],
  ['median_examples_per_sec', 'median compiled step examples/s'],
  ['loss', 'loss']
];

/** One colour a run, as matplotlib's (the PNG's) on the light theme, lighter on the dark one. */
const LIGHT_COLOURS = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f'];
const DARK_COLOURS = ['#5aa9e6', '#ffa24d', '#5fd35f', '#ff6b6b', '#b592d9', '#c9a093', '#f7a8d8', '#b0b0b0'];

const PANELS: [Curve, string][] = [
  ['loss', 'loss'],
  ['examples_per_sec', 'examples/s per step']
];

const CHART_HEIGHT = 260;

/** The contents of a compare tab, made from the kernel's "compare" reply. */
export class CompareView extends Widget {
  constructor(reply: { [key: string]: unknown }) {
    super();
    this.addClass('wb-figure-view');
    this.addClass('wb-compare-view');
    this._series = parseSeries(reply.series);
    this._log = prefersLog(this._series);
    this._canLog = this._series.some(s => forLogScale(s.loss ?? []).some(v => v !== null));

    const controls = el('div', 'wb-compare-controls');
    const slider = document.createElement('input');
    slider.type = 'range';
    slider.className = 'wb-smoothing';
    slider.min = '0';
    slider.max = String(MAX_SMOOTHING);
    slider.step = '0.01';
    slider.value = String(this._smoothing);
    slider.title = 'Exponential moving average of each curve, as TensorBoard smooths (0: raw values)';
    const shown = el('span', 'wb-smoothing-value', this._smoothing.toFixed(2));
    slider.addEventListener('input', () => {
      this._smoothing = Number(slider.value);
      shown.textContent = this._smoothing.toFixed(2);
      this.updateData();
    });
    const smoothing = el('label', 'wb-control');
    smoothing.append('Smoothing ', slider, shown);

    const log = document.createElement('input');
    log.type = 'checkbox';
    log.className = 'wb-log-scale';
    log.checked = this._log;
    log.disabled = !this._canLog;
    const logLabel = el('label', 'wb-control');
    logLabel.title = this._canLog
      ? 'Loss on a log axis (steps with a zero or negative loss are left out of it)'
      : 'No positive loss to show on a log axis';
    logLabel.append(log, ' Log loss axis');
    log.addEventListener('change', () => {
      this._log = log.checked;
      this.rebuild();
    });
    controls.append(smoothing, logLabel);

    const charts = el('div', 'wb-compare-charts');
    for (const [curve, title] of PANELS) {
      const panel = el('div', `wb-chart wb-chart-${curve}`);
      panel.append(el('div', 'wb-chart-title', title));
      const host = el('div', 'wb-chart-host');
      panel.append(host);
      this._hosts.set(curve, host);
      charts.append(panel);
    }
    if (!this._series.length) {
      charts.append(el('div', 'wb-empty', 'This kernel sent no series (an older workbench): the figure is below.'));
    }

    const table = compareTable((reply.rows as IStoredRun[]) ?? []);
    const figure = document.createElement('details');
    figure.className = 'wb-compare-png';
    const summary = document.createElement('summary');
    summary.textContent = 'Figure (PNG, as wb.compare_runs draws it)';
    const img = document.createElement('img');
    img.src = `data:image/png;base64,${String(reply.png)}`;
    img.alt = 'loss and throughput of the compared runs';
    figure.append(summary, img);
    this.node.append(controls, charts, table, figure);
    this.updateState();

    // Sized to their panels (known once attached, and again whenever the tab is resized); drawn
    // anew in the theme's colours when the theme changes.
    this._resize = new ResizeObserver(() => this.fitCharts());
    this._resize.observe(charts);
    this._theme = new MutationObserver(() => {
      // The attribute may flip before the new theme's stylesheet applies: again a moment later.
      this.rebuild();
      window.setTimeout(() => !this.isDisposed && this.rebuild(), 300);
    });
    this._theme.observe(document.body, { attributes: true, attributeFilter: ['data-jp-theme-light'] });
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._resize.disconnect();
    this._theme.disconnect();
    this._charts.forEach(chart => chart.destroy());
    this._charts.clear();
    super.dispose();
  }

  /** Each chart's width follows its panel; the first call with a width draws them. */
  private fitCharts(): void {
    if (!this._charts.size) {
      this.rebuild();
      return;
    }
    for (const [curve, chart] of this._charts) {
      const width = this.widthOf(curve);
      if (width && width !== chart.width) {
        chart.setSize({ width, height: CHART_HEIGHT });
      }
    }
  }

  private widthOf(curve: Curve): number {
    return Math.floor(this._hosts.get(curve)?.clientWidth ?? 0);
  }

  /** Draws both charts anew (a new axis distribution or theme needs new uPlot options). */
  private rebuild(): void {
    this._charts.forEach(chart => chart.destroy());
    this._charts.clear();
    if (!this._series.length) {
      return;
    }
    for (const [curve] of PANELS) {
      const host = this._hosts.get(curve) as HTMLElement;
      const width = this.widthOf(curve);
      if (!width) {
        return; // not attached yet: fit() draws them when the panel gets its size
      }
      host.replaceChildren();
      this._charts.set(curve, new uPlot(this.options(curve, width), this.data(curve), host));
    }
    this.updateState();
  }

  /** New smoothing: the same charts, new data. */
  private updateData(): void {
    for (const [curve, chart] of this._charts) {
      chart.setData(this.data(curve));
    }
    this.updateState();
  }

  private updateState(): void {
    this.node.dataset.smoothing = this._smoothing.toFixed(2);
    this.node.dataset.lossScale = this._log ? 'log' : 'linear';
  }

  private data(curve: Curve): uPlot.AlignedData {
    const [steps, ...columns] = alignSeries(this._series, curve);
    const log = curve === 'loss' && this._log;
    return [
      steps,
      ...columns.map(values => {
        const smoothed = smooth(values, this._smoothing);
        return log ? forLogScale(smoothed) : smoothed;
      })
    ] as uPlot.AlignedData;
  }

  private options(curve: Curve, width: number): uPlot.Options {
    const dark = document.body.dataset.jpThemeLight === 'false';
    const colours = dark ? DARK_COLOURS : LIGHT_COLOURS;
    const style = getComputedStyle(this.node);
    const text = style.getPropertyValue('--jp-ui-font-color1').trim() || (dark ? '#ddd' : '#222');
    const grid = style.getPropertyValue('--jp-border-color2').trim() || (dark ? '#444' : '#ddd');
    const axis: uPlot.Axis = {
      stroke: text,
      grid: { stroke: grid, width: 1 },
      ticks: { stroke: grid, width: 1 },
      font: '11px sans-serif'
    };
    const log = curve === 'loss' && this._log;
    return {
      width,
      height: CHART_HEIGHT,
      scales: { x: { time: false }, y: log ? { distr: 3, log: 10 } : { distr: 1 } },
      series: [
        { label: 'step', value: (_u, v) => (v === null || v === undefined ? '\u2013' : formatCount(v)) },
        ...this._series.map((run, i) => ({
          label: run.name,
          stroke: colours[i % colours.length],
          width: 1.8,
          spanGaps: true,
          points: { show: false },
          value: (_u: uPlot, v: number | null) => formatNumber(v)
        }))
      ],
      axes: [
        { ...axis, label: "step (from each run's start)", labelFont: '11px sans-serif' },
        log
          ? {
              ...axis,
              size: 64,
              // Powers of ten only, about one label every 28 px of the plot's height.
              splits: (u, _i, min, max) => logSplits(min, max, Math.floor(u.bbox.height / devicePixelRatio / 28)),
              filter: (_u, splits) => splits, // every split labelled (uPlot's log filter blanks some)
              values: (_u, splits) => splits.map(v => (v === null ? '' : formatPowerOfTen(v)))
            }
          : { ...axis, size: 64, values: (_u, splits) => splits.map(v => formatNumber(v)) }
      ],
      cursor: {
        sync: { key: this._syncKey },
        // A run thinned differently from the others has no value at every step: the nearest one.
        dataIdx: (u, seriesIdx, closestIdx) => nearestValueIndex(u.data[seriesIdx] ?? [], closestIdx) ?? closestIdx
      },
      legend: { live: true }
    };
  }

  private _series: IRunSeries[];
  private _smoothing = DEFAULT_SMOOTHING;
  private _log: boolean;
  private _canLog: boolean;
  private _hosts = new Map<Curve, HTMLElement>();
  private _charts = new Map<Curve, uPlot>();
  private _resize: ResizeObserver;
  private _theme: MutationObserver;
  private _syncKey = `wb-compare-${++views}`;
}

let views = 0;

/** The kernel's compare table (one row per run, in the order picked), under the charts. */
function compareTable(rows: IStoredRun[]): HTMLElement {
  const table = el('table', 'wb-compare-table');
  const head = document.createElement('tr');
  for (const [, label] of TABLE_COLUMNS) {
    head.append(el('th', '', label));
  }
  table.append(head);
  for (const row of rows) {
    const tr = document.createElement('tr');
    tr.dataset.runId = row.id;
    for (const [key] of TABLE_COLUMNS) {
      const value = row[key];
      const td = el('td', '', typeof value === 'number' ? formatNumber(value) : String(value ?? '\u2013'));
      td.dataset.key = key;
      tr.append(td);
    }
    table.append(tr);
  }
  return table;
}
