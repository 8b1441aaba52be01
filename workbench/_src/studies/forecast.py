"""study.forecast(): what more workers would buy, from what one configuration measured.

The model (stated with every forecast, in its `assumptions`):

  step(N workers, d devices each) = input + compute + communication + other

  compute   the baseline's compute per replica; weak scaling keeps each replica's batch, so it
            stays; strong scaling splits the global batch, so it shrinks with the replica count
            (assumed linear in the batch)
  input     the baseline's input wait, times the examples each worker reads per step relative
            to the baseline's (a worker feeds its d devices from one pipeline)
  other     the baseline's host overhead, unchanged
  communication  a ring all-reduce of the measured gradient bytes B (what step_fn's collectives
            carried per replica; step_clock.py) across the N workers over the link:
              2 (N - 1) / N x B / bandwidth + 2 (N - 1) x latency
            plus, with d > 1, the same ring inside each worker over `intra_gbps` (None: free, as
            NVLink-class links are next to a network's). No overlap with compute (TensorFlow's
            collective all-reduce runs after the backward pass), full link bandwidth per worker,
            no stragglers.

Throughput = N d x per-replica batch / step; speed-up and efficiency are against the baseline
configuration's measured parts (the study's first row: input + compute + communication + other).
"""

from __future__ import annotations

from collections.abc import Sequence

from workbench._src.core.errors import ConfigurationError
from workbench._src.core.run_stats import fmt

COLUMNS = ("workers", "devices", "replicas", "input_ms", "compute_ms", "communication_ms", "other_ms",
           "step_ms", "examples_per_sec", "speedup", "efficiency")  # fmt: skip


def ring_allreduce_seconds(nbytes: float, members: int, gbps: float | None, latency_s: float) -> float:
    """A ring all-reduce of `nbytes` among `members` over links of `gbps` gigabits/s each."""
    if members <= 1 or gbps is None:
        return 0.0
    bandwidth = gbps * 1e9 / 8  # bytes/s
    return 2 * (members - 1) / members * nbytes / bandwidth + 2 * (members - 1) * latency_s


def forecast(
    baseline: dict,
    workers: Sequence[int],
    link_gbps: float,
    devices_per_worker: int = 1,
    latency_us: float = 50.0,
    intra_gbps: float | None = None,
    mode: str = "weak",
):
    """The forecast table from a measured baseline: a dict with input_s, compute_s,
    communication_s, other_s, gradient_bytes, per_replica_batch and replicas (a scaling study's
    row has them)."""
    _check(workers, link_gbps, devices_per_worker, latency_us, intra_gbps)
    base_replicas = int(baseline.get("replicas") or 1)
    nbytes = float(baseline.get("gradient_bytes") or 0.0)
    if nbytes != nbytes:  # NaN: nothing was measured
        nbytes = 0.0
    per_replica = float(baseline["per_replica_batch"])
    # Speed-ups against the same model at the baseline (its measured parts), so that the
    # forecast of the baseline itself is 1.0 whatever the run-level figure's noise.
    base_step = sum(baseline[k] for k in ("input_s", "compute_s", "communication_s", "other_s"))
    base_throughput = base_replicas * per_replica / base_step
    rows = []
    for n in workers:
        d = devices_per_worker
        replicas = n * d
        if mode == "weak":
            batch, compute = per_replica, baseline["compute_s"]
        else:  # the global batch is split: each replica's work shrinks with its batch
            batch = per_replica * base_replicas / replicas
            compute = baseline["compute_s"] * base_replicas / replicas
        examples_per_worker = batch * d
        input_s = baseline["input_s"] * examples_per_worker / per_replica
        latency = latency_us * 1e-6
        communication = ring_allreduce_seconds(nbytes, n, link_gbps, latency) + ring_allreduce_seconds(
            nbytes, d, intra_gbps, latency
        )
        step = input_s + compute + communication + baseline["other_s"]
        throughput = replicas * batch / step
        speedup = throughput / base_throughput
        rows.append(
            {"workers": n, "devices": d, "replicas": replicas, "input_ms": 1e3 * input_s,
             "compute_ms": 1e3 * compute, "communication_ms": 1e3 * communication,
             "other_ms": 1e3 * baseline["other_s"], "step_ms": 1e3 * step, "examples_per_sec": throughput,
             "speedup": speedup, "efficiency": speedup / (replicas / base_replicas)}
        )  # fmt: skip
    table = forecast_frame(rows)
    table.attrs["assumptions"] = assumptions(
        baseline, nbytes, link_gbps, latency_us, devices_per_worker, intra_gbps, mode
    )
    return table


def assumptions(baseline, nbytes, link_gbps, latency_us, d, intra_gbps, mode) -> str:
    intra = "free (not modelled)" if intra_gbps is None else f"a ring at {intra_gbps:g} Gbit/s"
    return "\n".join(
        [
            f"measured at {int(baseline.get('replicas') or 1)} replica(s): compute {fmt(1e3 * baseline['compute_s'])} ms, "
            f"input {fmt(1e3 * baseline['input_s'])} ms, other {fmt(1e3 * baseline['other_s'])} ms per step; "
            f"gradients {fmt(nbytes / 1e6)} MB per replica per step"
            + (
                f"; {fmt(baseline['examples_per_sec'])} examples/s"
                if baseline.get("examples_per_sec")
                else ""
            ),
            f"collective: ring all-reduce across workers, 2(N-1)/N x bytes / {link_gbps:g} Gbit/s "
            f"+ 2(N-1) x {latency_us:g} us; inside a worker ({d} device(s)): {intra}",
            f"{mode} scaling; no overlap of all-reduce and compute; full link bandwidth per worker; "
            "no stragglers; input wait grows with the examples a worker reads per step",
        ]
    )


def _check(workers, link_gbps, devices_per_worker, latency_us, intra_gbps) -> None:
    try:
        counts = [int(n) for n in workers]
    except (TypeError, ValueError):
        counts = []
    if not counts or any(n < 1 for n in counts):
        raise ConfigurationError(
            f"workers must be a list of positive worker counts, e.g. [8, 16, 64]; received workers={workers!r}."
        )
    for name, value in (("link_gbps", link_gbps), ("latency_us", latency_us), ("intra_gbps", intra_gbps)):
        if value is None and name == "intra_gbps":
            continue
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or value < 0
            or (name == "link_gbps" and not value)
        ):
            raise ConfigurationError(
                f"{name} must be a positive number; received {name}={value!r}. Fix: e.g. link_gbps=10 "
                "(10 Gbit/s Ethernet), latency_us=50."
            )
    if (
        not isinstance(devices_per_worker, int)
        or isinstance(devices_per_worker, bool)
        or devices_per_worker < 1
    ):
        raise ConfigurationError(
            f"devices_per_worker must be an integer >= 1; received devices_per_worker={devices_per_worker!r}."
        )


_frame_class = None


def forecast_frame(rows):
    """A DataFrame whose printed form says the numbers as people read them, then the model's
    assumptions (its `.attrs["assumptions"]`)."""
    global _frame_class
    if _frame_class is None:
        import pandas as pd

        class Forecast(pd.DataFrame):
            _metadata = []

            @property
            def _constructor(self):
                return Forecast

            def __repr__(self):
                text = self.to_string(index=False, float_format=_readable)
                note = self.attrs.get("assumptions")
                return text + ("\nassumptions:\n  " + note.replace("\n", "\n  ") if note else "")

            def _repr_html_(self):
                import html

                table = self.to_html(index=False, float_format=_readable)
                note = html.escape(self.attrs.get("assumptions") or "").replace("\n", "<br>")
                return f"{table}<p><b>assumptions</b><br>{note}</p>"

        _frame_class = Forecast
    return _frame_class(rows, columns=list(COLUMNS))


def _readable(value) -> str:
    """Efficiencies and speed-ups with two decimals, the rest as run_stats.fmt (11,050; 4.2)."""
    return fmt(value) if abs(value) >= 10 else f"{value:.2f}"
