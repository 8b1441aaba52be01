/**
 * The compare view's chart data, without a browser: the kernel's series (labcomm "compare"
 * reply), TensorBoard's smoothing, what a log axis can show, one x axis for several runs.
 * Pure functions, unit-tested under node (test/series.test.ts); compare.ts draws them with uPlot.
 */

/** One run's curves as the kernel sends them (workbench/_src/store/compare.py `series`). */
export interface IRunSeries {
  id: string;
  /** The run's name in the run store (what the legend shows). */
  name: string;
  /** Steps counted from the run's start (thinned to at most ~2,000 by the kernel). */
  step: number[];
  /** null for a step without a finite value; the whole list null when the run has no loss. */
  loss: (number | null)[] | null;
  examples_per_sec: (number | null)[] | null;
}

export type Curve = 'loss' | 'examples_per_sec';

/** TensorBoard's default smoothing weight (its scalar dashboard's slider starts there). */
export const DEFAULT_SMOOTHING = 0.6;

/** The highest weight the slider offers (1 would be a flat line at the first value). */
export const MAX_SMOOTHING = 0.99;

/** The series of a compare reply (an older kernel side sends none: []). */
export function parseSeries(data: unknown): IRunSeries[] {
  if (!Array.isArray(data)) {
    return [];
  }
  return data
    .filter((s): s is { [key: string]: unknown } => typeof s === 'object' && s !== null)
    .filter(s => Array.isArray(s.step))
    .map(s => ({
      id: String(s.id ?? ''),
      name: String(s.name ?? s.id ?? ''),
      step: (s.step as unknown[]).map(Number),
      loss: Array.isArray(s.loss) ? (s.loss as unknown[]).map(finiteOrNull) : null,
      examples_per_sec: Array.isArray(s.examples_per_sec)
        ? (s.examples_per_sec as unknown[]).map(finiteOrNull)
        : null
    }));
}

function finiteOrNull(value: unknown): number | null {
  return typeof value === 'number' && Number.isFinite(value) ? value : null;
}

/**
 * TensorBoard's smoothing: an exponential moving average with weight `weight` (0: raw, 0.99:
 * very smooth), debiased so the first points are not pulled towards zero. Missing values stay
 * missing and do not move the average.
 */
export function smooth(values: (number | null)[], weight: number): (number | null)[] {
  const w = Math.min(Math.max(weight, 0), MAX_SMOOTHING);
  let last = 0;
  let count = 0;
  return values.map(v => {
    if (v === null || !Number.isFinite(v)) {
      return null;
    }
    if (w === 0) {
      return v;
    }
    last = last * w + (1 - w) * v;
    count += 1;
    return last / (1 - Math.pow(w, count));
  });
}

/** What a log axis can show: zeros and negatives dropped (null), not the whole chart broken. */
export function forLogScale(values: (number | null)[]): (number | null)[] {
  return values.map(v => (v !== null && v > 0 ? v : null));
}

/**
 * Whether the loss starts on a log axis: as the kernel's figure decides (compare.py `_draw`),
 * when every value is positive and they span more than two decades.
 */
export function prefersLog(series: IRunSeries[]): boolean {
  const values = series.flatMap(s => s.loss ?? []).filter((v): v is number => v !== null);
  if (!values.length) {
    return false;
  }
  const low = Math.min(...values);
  return low > 0 && Math.max(...values) > 100 * low;
}

/**
 * Several runs' `curve` on one x axis (uPlot's aligned data): the union of their steps, each
 * run's values at its own steps and null elsewhere.
 */
export function alignSeries(series: IRunSeries[], curve: Curve): [number[], ...(number | null)[][]] {
  const steps = [...new Set(series.flatMap(s => s.step))].sort((a, b) => a - b);
  const position = new Map(steps.map((step, i) => [step, i]));
  const columns = series.map(s => {
    const column: (number | null)[] = new Array(steps.length).fill(null);
    const values = s[curve];
    s.step.forEach((step, i) => {
      column[position.get(step) as number] = values ? values[i] ?? null : null;
    });
    return column;
  });
  return [steps, ...columns];
}

/**
 * The index nearest `index` where `values` has a value (null when it has none): the hovered
 * value of a run whose steps differ from the others' (thinned differently).
 */
export function nearestValueIndex(values: ArrayLike<number | null | undefined>, index: number): number | null {
  for (let d = 0; d < values.length; d++) {
    for (const i of [index - d, index + d]) {
      if (i >= 0 && i < values.length && values[i] !== null && values[i] !== undefined) {
        return i;
      }
    }
  }
  return null;
}

/**
 * Where a log axis from `min` to `max` gets its grid lines and labels: powers of ten only (not
 * uPlot's 2..9 of every decade, unreadable over many decades), every k-th decade so at most
 * `maxTicks` of them.
 */
export function logSplits(min: number, max: number, maxTicks: number): number[] {
  if (!(min > 0) || !(max >= min)) {
    return [];
  }
  const low = Math.ceil(Math.log10(min) - 1e-9);
  const high = Math.floor(Math.log10(max) + 1e-9);
  const every = Math.max(1, Math.ceil((high - low + 1) / Math.max(1, maxTicks)));
  const splits: number[] = [];
  for (let e = high; e >= low; e -= every) {
    splits.unshift(Number(`1e${e}`)); // exact, unlike Math.pow(10, e) for negative e
  }
  return splits;
}

/** A power of ten as a log axis labels it: "0.001" .. "10,000", else "1e-6", "1e8". */
export function formatPowerOfTen(value: number): string {
  const e = Math.round(Math.log10(value));
  if (e >= -3 && e <= 4) {
    return e < 0 ? value.toFixed(-e) : Math.round(value).toLocaleString('en-US');
  }
  return `1e${e}`;
}
