"""`wb.ui.panel()`: pick where the notebook's step runs, Run and Stop it, copy the magic line.

The panel is a thin layer over `workbench._src.notebook.session` (ipywidgets 8): choosing a backend or a
replica count calls `session.choose`, exactly what `%replicate --backend ...` does, and the panel
follows choices made by the magic. Its state is plain traitlets (`backend`, `replicas`,
`workers`, `ps`, `cluster`, `steps`, `magic_line`, `status`), so it is testable without a browser.
`cluster` places a process backend's workers on a Ray cluster; the panel then shows its nodes.
"""

from __future__ import annotations

import html

import ipywidgets as w
import traitlets

from workbench._src.core import registry
from workbench._src.core.errors import ConfigurationError
from workbench._src.core.tf_setup import device_summary
from workbench._src.notebook import session
from workbench._src.notebook.panel_pools import follow_pools, pool_line
from workbench._src.notebook.session import equivalent_magic  # (re-exported: tests import it here)
from workbench._src.placements.ray.cluster import RayCluster
from workbench._src.sinks.dashboard import Dashboard

CHOICES = ("backend", "replicas", "workers", "ps", "steps", "cluster", "max_restarts", "min_workers")


class Panel(w.VBox):
    """Devices found; backend, replicas, sync/async, workers, steps; Run / Stop; the magic line."""

    backend = traitlets.Unicode("mirrored", help="the chosen backend; unavailable ones are refused")
    replicas = traitlets.Int(2, help="replicas (mirrored); single and tpu fix their own")
    workers = traitlets.Int(2, help="worker processes (multi-worker, async-ps)")
    ps = traitlets.Int(1, help="parameter servers (async-ps)")
    steps = traitlets.Int(300, help="steps Run trains")
    max_restarts = traitlets.Int(0, min=0, help="heals of a run on worker processes (0: a lost one ends it)")
    min_workers = traitlets.Int(0, min=0, help="multi-worker: fewest workers a heal goes on with (0: all)")
    magic_line = traitlets.Unicode("", help="the %replicate line that does what Run does")
    status = traitlets.Unicode("", help="what the panel last did, or why it could not")
    pool_text = traitlets.Unicode("", help="the warm worker pools of this kernel ('' when none)")
    cluster = traitlets.Unicode(
        "", help="where worker processes run: '' (this machine), 'ray', 'ray=ADDRESS' or 'ray=local'"
    )
    cluster_text = traitlets.Unicode("", help="the Ray cluster's nodes and free CPUs/GPUs ('' when none)")

    def __init__(self, namespace: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        self._namespace = namespace
        self._syncing = False
        self.run = None  # the last wb.Run started here
        self.devices = device_summary()
        self.max_replicas = max(1, len(self.devices["gpus"]) or self.devices["virtual_cpus"])
        self.reasons = {name: spec.unavailable_reason() for name, spec in registry.BACKENDS.items()}
        self._build()
        choice = session.current_choice()
        if choice:  # open on what the session already uses
            self._follow(session.current_or_none(), choice)
        else:
            self._syncing = True  # a default, not a choice: the session is left alone
            self.replicas = min(2, self.max_replicas)
            self._syncing = False
        self._sync_widgets()
        self.refresh_pool()
        self._unobserve_session = session.observe(self._follow)
        follow_pools(self)

    # ----- traitlet rules -------------------------------------------------------------------
    @traitlets.validate("backend")
    def _valid_backend(self, proposal):
        name = session.normalize_backend(proposal["value"])
        if self.reasons.get(name):
            raise traitlets.TraitError(f"backend {name!r} cannot be chosen here: {self.reasons[name]}.")
        return name

    @traitlets.validate("replicas")
    def _valid_replicas(self, proposal):
        value = proposal["value"]
        if not 1 <= value <= self.max_replicas:
            raise traitlets.TraitError(
                f"replicas must be between 1 and {self.max_replicas} (the devices found); received {value}."
            )
        return value

    @traitlets.validate("cluster")
    def _valid_cluster(self, proposal):
        value = proposal["value"].strip()
        if value:
            try:
                RayCluster.from_option(value)
            except ConfigurationError as e:
                raise traitlets.TraitError(str(e)) from None
        return value

    @traitlets.observe(*CHOICES)
    def _on_choice(self, change):
        self._sync_widgets()
        if (
            change["name"] not in ("steps", "max_restarts") and not self._syncing
        ):  # (a run's, not the replicator's)
            self.apply()

    def apply(self):
        """Sets the session's replicator from the panel's choice (as the magic does); returns it."""
        try:
            elastic = {"min_workers": (self.min_workers or None) if self._elastic else None}
            repl = session.choose(self.backend, *self._counts(), cluster=self._cluster_choice(), **elastic)
        except Exception as e:  # noqa: BLE001 - shown in the panel, a button has no traceback
            self.status = f"error: {e}"
            return None
        self.status = f"session replicator: {repl!r}"
        if getattr(repl, "runs_in_processes", False):
            repl.prestart()  # its processes start now, so the first run finds them warm
        self.refresh_pool()  # (choosing another shape ended the old pool)
        self.refresh_cluster()
        return repl

    def refresh_cluster(self) -> None:
        """Shows the chosen Ray cluster's nodes and what it has free (connecting to it once)."""
        choice = self._cluster_choice()
        if choice is None:
            self.cluster_text = ""
        else:
            try:
                ray_cluster = RayCluster.from_option(choice)
                lines = [ray_cluster.describe()]
                lines += [
                    f"node {n['address']}{' (head)' if n['head'] else ''}: CPU {n['cpus']:g}, GPU {n['gpus']:g}"
                    for n in ray_cluster.nodes()
                ]
                self.cluster_text = "\n".join(lines)
            except Exception as e:  # noqa: BLE001 - shown in the panel
                self.cluster_text = f"error: {e}"
        self._cluster_info.value = "<br>".join(html.escape(line) for line in self.cluster_text.splitlines())

    def _cluster_choice(self) -> str | None:
        """The cluster option, when the backend has worker processes to place."""
        return self.cluster or None if self._spec.takes_workers else None

    # ----- warm worker pools ----------------------------------------------------------------
    def refresh_pool(self) -> None:
        """Shows this kernel's warm worker pools (launch/pool.py): backend, workers, state, and
        since when idle (a clock time: it stays true between refreshes); Shut down ends them.
        Called whenever a pool changes state (the pools' observer, as the sidebar is told), so
        the panel and the sidebar read the same pool.describe() at the same moments."""
        from workbench._src.launch import pool as pools

        lines = [pool_line(pool.describe()) for pool in pools.live_pools()]
        self.pool_text = "\n".join(lines)
        self._pool.value = "<br>".join(html.escape(line) for line in lines)
        self._pool_row.layout.display = "flex" if lines else "none"

    def shut_down_pools(self) -> None:
        """What the Shut down button does: ends every idle warm pool (a busy one after its run)."""
        from workbench._src.launch import pool as pools

        count = pools.shutdown(reason="Shut down in the panel")
        self.status = f"shut down {count} warm worker pool(s)"
        self.refresh_pool()

    # ----- Run and Stop ---------------------------------------------------------------------
    def start(self):
        """What the Run button does: trains in the background, on the chosen backend, the
        notebook's step_fn/input_fn (in-process backends) or the last `%%replicate` cell (process
        backends: the cell's source travels to the processes, as the magic sends it)."""
        ns = self._user_namespace()
        in_processes = self._spec.in_processes
        cell = session.last_replicate_cell() if in_processes else None
        missing = [n for n in ("step_fn", "input_fn") if not callable(ns.get(n))]
        if in_processes and cell is None:
            self.status = (
                f"error: {self.backend} runs the model in its own processes, so it needs the cell that "
                "builds it. Fix: run a %%replicate cell (e.g. `%%replicate --steps 1` with the model, "
                "step_fn and input_fn) once, then Run: the panel sends the last one."
            )
            return None
        if missing and not in_processes:
            self.status = (
                f"error: {' and '.join(missing)} not defined in the notebook. Fix: define "
                "input_fn(ctx) and step_fn(batch) in a cell (or a %%replicate cell), then Run."
            )
            return None
        if self.run is not None and self.run.running:
            self.status = f"error: {self.run.name} is still running; Stop it first."
            return None
        repl = self.apply()
        if repl is None:
            return None
        dashboard = Dashboard(display=False, frontend="widgets")
        self._live.children = [dashboard.widget]
        try:
            functions = (None, None) if in_processes else (ns["step_fn"], ns["input_fn"])
            run = session.train(
                repl, *functions, self.steps, background=True, dashboard=dashboard, cell=cell, namespace=ns,
                max_restarts=self.max_restarts if self._spec.takes_workers else 0,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001
            self._live.children = []
            self.status = f"error: {type(e).__name__}: {e}"
            return None
        self.run = run
        self._run_button.disabled, self._stop_button.disabled = True, False
        self.status = f"{run.name} running on {repl!r}"
        run.subscribe(self._on_event)
        return run

    def stop(self) -> None:
        """What the Stop button does: asks the running run to stop at the next step boundary."""
        if self.run is not None and self.run.running:
            self.run.stop()
            self._stop_button.disabled = True
            self.status = f"{self.run.name}: stopping at the next step boundary"

    def _on_event(self, event) -> None:  # on the training thread: only widget traits change
        if event.kind == "ended":
            from workbench._src.core.run_stats import shown_reason

            # Said once: "stopped at step N" beside "stopped at step N" adds nothing (issue 23).
            status = event.data.get("status")
            reason = shown_reason(status, event.data.get("reason"))
            self.status = f"{self.run.name} {status} at step {event.step}" + (
                f" ({reason})" if reason else ""
            )
            self._run_button.disabled, self._stop_button.disabled = False, True
            self.refresh_pool()

    def close(self):
        self._unobserve_session()
        super().close()

    # ----- widgets ----------------------------------------------------------------------------
    def _build(self) -> None:
        d = self.devices
        found = (
            f"{len(d['gpus'])} GPU \u00b7 {len(d['tpus'])} TPU \u00b7 {d['physical_cores']} physical cores "
            f"\u00b7 {d['virtual_cpus']} {'virtual ' if d['virtual_cpus'] > 1 else ''}CPU device(s)"
        )
        self._devices = w.HTML(f"<b>Replicator Workbench</b> &nbsp; devices found: {found}")
        self._backend_buttons = {}
        for name in registry.BACKENDS:
            reason = self.reasons[name]
            button = w.ToggleButton(
                description=name,
                disabled=bool(reason),
                tooltip=reason or f"use the {name} backend",
                layout=w.Layout(width="auto"),
            )
            button.observe(lambda change, name=name: self._on_button(name, change), "value")
            self._backend_buttons[name] = button
        async_reason = self.reasons[registry.DEFAULT_ASYNC]
        self._sync_button = w.ToggleButton(
            description="sync",
            tooltip="all replicas step together (all-reduce)",
            layout=w.Layout(width="auto"),
        )
        self._async_button = w.ToggleButton(
            description="async",
            disabled=bool(async_reason),
            tooltip=async_reason or "parameter servers",
            layout=w.Layout(width="auto"),
        )
        self._sync_button.observe(
            lambda c: c["new"] and not self._spec.synchronous and self._pick(registry.DEFAULT), "value"
        )
        self._async_button.observe(lambda c: c["new"] and self._pick(registry.DEFAULT_ASYNC), "value")
        unavailable = [f"{n}: {r}" for n, r in self.reasons.items() if r]
        self._reasons = w.HTML("<small>" + "<br>".join(html.escape(u) for u in unavailable) + "</small>")
        self._replicas = w.BoundedIntText(
            min=1, max=self.max_replicas, description="replicas", layout=w.Layout(width="170px")
        )
        self._workers = w.BoundedIntText(
            min=1, max=256, description="workers", layout=w.Layout(width="170px")
        )
        self._ps = w.BoundedIntText(min=1, max=64, description="ps", layout=w.Layout(width="170px"))
        self._steps = w.BoundedIntText(min=1, max=10**9, description="steps", layout=w.Layout(width="190px"))
        self._max_restarts = w.BoundedIntText(
            min=0, max=100, description="restarts", layout=w.Layout(width="170px"),
            tooltip="max_restarts: how often a run on worker processes heals itself after a lost "
            "worker (restarted from its last checkpoint); 0: a lost worker ends the run",
        )  # fmt: skip
        self._min_workers = w.BoundedIntText(
            min=0, max=256, description="min workers", layout=w.Layout(width="170px"),
            tooltip="min_workers (multi-worker, with restarts): when a heal finds no room for every "
            "worker (a Ray node gone), go on with fewer, not below this; 0: always every worker",
        )  # fmt: skip
        self._cluster = w.Combobox(
            options=["ray=local", "ray"],
            placeholder="this machine",
            description="cluster",
            tooltip="where the worker processes run: this machine (empty), or a Ray cluster "
            "(ray: the one this machine joined; ray=ADDRESS; ray=local: a Ray instance of this kernel)",
            ensure_option=False,
            continuous_update=False,
            layout=w.Layout(width="260px"),
        )
        self._cluster.observe(lambda c: self._set_from_widget("cluster", c["new"]), "value")
        self._cluster_info = w.HTML()
        for widget, trait in (
            (self._replicas, "replicas"),
            (self._workers, "workers"),
            (self._ps, "ps"),
            (self._steps, "steps"),
            (self._max_restarts, "max_restarts"),
            (self._min_workers, "min_workers"),
        ):
            widget.observe(lambda c, trait=trait: self._set_from_widget(trait, c["new"]), "value")
        self._run_button = w.Button(
            description="Run",
            icon="play",
            button_style="success",
            tooltip="train step_fn / input_fn in the background",
        )
        self._stop_button = w.Button(description="Stop", icon="stop", button_style="danger", disabled=True)
        self._run_button.on_click(lambda _: self.start())
        self._stop_button.on_click(lambda _: self.stop())
        self._status = w.HTML()
        self._pool = w.HTML()
        self._pool_button = w.Button(
            description="Shut down", icon="power-off", tooltip="end the warm worker processes now"
        )
        self._pool_button.on_click(lambda _: self.shut_down_pools())
        self._pool_row = w.HBox([self._pool, self._pool_button])
        self._magic = w.HTML()
        self._live = w.VBox()
        self.observe(lambda c: setattr(self._status, "value", _status_html(c["new"])), "status")
        self.children = [
            self._devices,
            w.HBox([w.Label("backend"), *self._backend_buttons.values()]),
            w.HBox([w.Label("mode"), self._sync_button, self._async_button]),
            self._reasons,
            w.HBox([self._replicas, self._workers, self._ps, self._steps]),
            w.HBox([self._cluster, self._max_restarts, self._min_workers, self._cluster_info]),
            w.HBox([self._run_button, self._stop_button]),
            self._status,
            self._pool_row,
            self._magic,
            self._live,
        ]

    def _pick(self, name: str) -> None:
        try:
            self.backend = name
        except traitlets.TraitError as e:
            self.status = f"error: {e}"
            self._sync_widgets()

    def _on_button(self, name: str, change) -> None:
        if self._syncing:
            return
        if change["new"]:
            self._pick(name)
        else:
            self._sync_widgets()  # a toggle cannot be switched off: pick another backend

    def _set_from_widget(self, trait: str, value) -> None:
        if not self._syncing:
            try:
                setattr(self, trait, value)
            except traitlets.TraitError as e:
                self.status = f"error: {e}"
                self._sync_widgets()

    def _sync_widgets(self) -> None:
        """Widgets show the traitlets (buttons pressed, counts, what is disabled, the line)."""
        self._syncing = True
        try:
            for name, button in self._backend_buttons.items():
                button.value = name == self.backend
            spec = self._spec
            asynchronous = not spec.synchronous
            self._sync_button.value, self._async_button.value = not asynchronous, asynchronous
            self._replicas.value = (
                self.replicas if spec.takes_replicas else (spec.fixed_replicas or self._replicas.value)
            )
            self._replicas.disabled = not spec.takes_replicas
            self._workers.value, self._workers.disabled = self.workers, not spec.takes_workers
            self._ps.value, self._ps.disabled = self.ps, not spec.takes_ps
            self._steps.value = self.steps
            self._cluster.value, self._cluster.disabled = self.cluster, not spec.takes_workers
            self._max_restarts.value = self.max_restarts
            self._max_restarts.disabled = not spec.takes_workers  # heals replace worker processes
            self._min_workers.value, self._min_workers.disabled = self.min_workers, not self._elastic
        finally:
            self._syncing = False
        self.magic_line = equivalent_magic(
            self.backend, self.replicas, self.workers, self.ps, self.cluster, steps=self.steps,
            max_restarts=self.max_restarts, min_workers=(self.min_workers or None) if self._elastic else None,
        )  # fmt: skip
        where = (
            "first line of the %%replicate cell that builds the model"
            if self.magic_line.startswith("%%")
            else "copy into a cell"
        )
        self._magic.value = (
            f"equivalent magic ({where}):<pre style='margin:2px 0'>{html.escape(self.magic_line)}</pre>"
        )

    def _counts(self) -> tuple:
        spec = self._spec
        return (
            self.replicas if spec.takes_replicas else None,
            self.workers if spec.takes_workers else None,
            self.ps if spec.takes_ps else None,
        )

    @property
    def _elastic(self) -> bool:  # min_workers: synchronous runs on worker processes (multi-worker)
        return self._spec.takes_workers and self._spec.synchronous

    @property
    def _spec(self):
        return registry.spec(self.backend)

    def _follow(self, repl, choice: dict | None) -> None:
        """Shows a choice made elsewhere (the magic, wb.use) without choosing again."""
        self._syncing = True
        try:
            backend = (choice or {}).get("backend") or getattr(repl, "backend", self.backend)
            if backend in self.reasons and not self.reasons[backend]:
                self.backend = backend
            if choice is not None:
                self.cluster = choice.get("cluster") or ""
                self.min_workers = choice.get("min_workers") or 0  # (0: the field's "all")
            for trait, key in (("replicas", "num_replicas"), ("workers", "num_workers"), ("ps", "num_ps")):
                value = (choice or {}).get(key)
                if value is None and trait == "replicas" and registry.spec(backend).takes_replicas and repl:
                    value = repl.describe().get("num_replicas")
                if value is not None:
                    setattr(self, trait, value)
        finally:
            self._syncing = False
        self._sync_widgets()

    def _user_namespace(self) -> dict:
        if self._namespace is not None:
            return self._namespace
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            return shell.user_ns
        import __main__

        return vars(__main__)


def _status_html(text: str) -> str:
    # The theme's colours (a fixed #333 was unreadable on the dark theme).
    color = "var(--jp-error-color1)" if text.startswith("error") else "var(--jp-ui-font-color1)"
    return f"<span style='color:{color}'>{html.escape(text)}</span>"
