"""`workbench run FILE.py`: the notebook's %%replicate, for a script, on any backend.

The file plays the part of a `%%replicate` cell: it runs inside the replicator's context with
`repl` defined, builds its model and optimizer, and defines input_fn and step_fn, which are then
trained. For multi-worker with local processes the file's source travels to every worker (as a
cell does); on a real cluster every host runs the same command with its own TF_CONFIG.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from workbench._src.core import registry, tf_setup
from workbench._src.core.cluster_resolver import checked_tf_config_env, cluster_resolver
from workbench._src.core.current import set_current
from workbench._src.core.default_sinks import register_default, unregister_default
from workbench._src.core.errors import ConfigurationError, WorkbenchError
from workbench._src.core.run import set_source
from workbench._src.core.run_loop import PreemptOnSigterm
from workbench._src.core.run_stats import fmt
from workbench._src.core.tracebacks import cause_line, shown_text
from workbench._src.launch.shipping import CellSetup
from workbench._src.placements.ray.cluster import RayCluster
from workbench._src.scripts import serve_task
from workbench._src.sinks.progress import ProgressPrinter, say
from workbench._src.studies.scaling import SUMMARY_COLUMNS, scaling_study

# `workbench run`'s exit status when preempted (SIGTERM): sysexits.h's EX_TEMPFAIL, "a temporary
# failure: try again later". Not 0 (a scheduler would take the job as done) and not 1 (failed).
PREEMPTED_EXIT = 75


def run_file(args) -> int:
    path = Path(args.file)
    if not path.is_file():
        print(
            f"workbench run: no such file: {args.file!r}. Give a Python file that defines input_fn and step_fn.",
            file=sys.stderr,
        )
        return 2
    source = path.read_text()

    if args.cluster and not _on_ray(args) and not tf_setup.tf_logs_wanted():
        # On a real cluster a failing peer makes TensorFlow's C++ side log ERROR lines (aborted
        # collectives, functions it could not remove remotely) as it happens, before the run's
        # own sentence; the exception carries the same message into "--- details ---". Set
        # before TensorFlow's import; a level the user set is kept (WORKBENCH_TF_LOGS=1: all).
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if args.cpus:
        tf_setup.configure_devices(cpus=args.cpus)
    try:
        _check_options(args)
        if args.cluster and args.cluster.upper() == "TF_CONFIG":  # refused before TensorFlow's import
            checked_tf_config_env()
        backend = registry.spec(args.backend)
        if (
            args.cluster
            and not _on_ray(args)
            and not backend.synchronous
            and serve_task.is_server_task(args.cluster)
        ):
            return serve_task.serve(args.cluster, args.startup_timeout)  # ps/worker: only the chief runs FILE
        if backend.in_processes and not args.cluster:
            from workbench._src.placements.local import fork_client

            fork_client.prestart()  # its TensorFlow import starts now, while this process goes on
        # What the next seconds (up to a minute on Ray) do, said before they start.
        ships = backend.in_processes and (not args.cluster or _on_ray(args))
        if not ships:
            say(f"importing TensorFlow, then running {path.name}...")
        repl = _make_replicator(args)
        if ships:
            where = f"on Ray ({args.cluster}), which starts first" if args.cluster else "here"
            say(f"starting {_processes(repl)} {where}; each imports TensorFlow and runs {path.name}...")
        namespace = {"__name__": "__workbench_run__", "__file__": str(path.resolve())}
        # Processes this one starts (locally or on Ray) run the file themselves: it runs only there,
        # as the notebook's cell would without the notebook's copy of the model, which a script
        # has no use for. This process then never imports TensorFlow (4-5 CPU-seconds and as many
        # of start-up that the workers' own imports need). A real cluster's task is a worker itself.
        ships_the_file = backend.in_processes and (not args.cluster or _on_ray(args))
        if ships_the_file:
            compile(source, str(path), "exec")  # a SyntaxError shows here, before any process starts
        # SIGTERM (a scheduler preempting the job, `kill`): every process saves at the next step
        # boundary and the command exits PREEMPTED_EXIT; the same command then finishes the run.
        preemption = PreemptOnSigterm("SIGTERM to workbench run")
        options = {
            "steps_per_execution": args.steps_per_execution,
            "sinks": [ProgressPrinter(args.steps), preemption],
            "name": args.name,
            "tags": tuple(t.strip() for t in (args.tags or "").split(",") if t.strip()),
        }
        if args.checkpoint:
            options["checkpoint_dir"] = args.checkpoint
        if args.checkpoint_every:
            options["checkpoint_every"] = args.checkpoint_every
        if args.max_restarts:
            options["max_restarts"] = args.max_restarts
        folder = str(path.resolve().parent)
        sys.path.insert(0, folder)  # the file's own helper modules

        set_current(repl, None)
        set_source(path.resolve())  # the run store names the script as the runs' source
        with preemption:
            if ships_the_file:
                setup = CellSetup(source, namespace, filename=str(path), import_paths=(folder,))
                run = repl.train(setup=setup, steps=args.steps, **options)
            else:
                run = repl.train_cell(source, namespace, args.steps, filename=str(path), **options)
    except Exception as e:  # noqa: BLE001 - one sentence first, the details after it
        return _report_failure(e, args)
    summary = run.summary()
    table = run.breakdown()
    if not table.empty:  # this process's workers: milliseconds per step of each part
        parts = table.drop(columns="steps") * 1e3
        summary["breakdown_ms"] = {
            str(w): {k: round(v, 3) for k, v in row.items()} for w, row in parts.iterrows()
        }
        summary["collective_bytes"] = int(table.attrs.get("collective_bytes") or 0)
    if args.history:
        _make_folder(args.history)
        run.history.to_csv(args.history, index=False)
        summary["history_csv"] = args.history
    print(json.dumps(summary, default=str))
    if run.status == "preempted":
        where = f"its checkpoint is in {args.checkpoint}" if args.checkpoint else "no --checkpoint was given"
        print(
            f"workbench run: preempted at step {run.steps} ({where}): run the same command again to "
            f"finish the run (exit status {PREEMPTED_EXIT}: preempted, not failed).",
            file=sys.stderr,
        )
        return PREEMPTED_EXIT
    return 0 if run.status in ("finished", "stopped") else 1


def scale_file(args) -> int:
    """`workbench scale FILE.py`: the file as the setup of wb.scaling_study (as a
    `%%replicate --scaling` cell is); prints the table, writes the PNG and, if asked, a CSV."""
    path = Path(args.file)
    if not path.is_file():
        print(
            f"workbench scale: no such file: {args.file!r}. Give a Python file that builds its model "
            "and defines input_fn(ctx) (batching to ctx.global_batch_size) and step_fn.",
            file=sys.stderr,
        )
        return 2
    counts = args.replicas  # a list: options.replica_counts parsed it

    backend = registry.spec(args.backend)
    say(
        f"importing TensorFlow, then timing {args.steps} steps at each of {len(counts)} replica counts "
        f"({','.join(map(str, counts))}), each compiled first..."
    )
    if backend.takes_replicas:  # devices of this process (a machine with GPUs keeps its GPUs)
        tf_setup.configure_devices(cpus=args.cpus or max(8, *counts))
    # A fresh namespace per configuration; the source (not a code object) so that it also
    # travels to worker processes, and the file's name so tracebacks and AutoGraph find it. Its
    # folder goes first on the import path wherever it runs, this process included (its helpers).
    setup = CellSetup(
        path.read_text(),
        {"__file__": str(path.resolve())},
        filename=str(path),
        import_paths=(str(path.resolve().parent),),
    )
    options = {backend.threads_option: args.threads} if backend.threads_option and args.threads else {}
    register_default(_say_each_configuration)
    try:
        study = scaling_study(
            setup=setup, backend=args.backend, replicas=counts, mode=args.mode,
            batch_size=args.batch_size, steps=args.steps, warmup=args.warmup,
            steps_per_execution=args.steps_per_execution, path=_figure_path(args), live=False,
            repeats=getattr(args, "repeats", 1), **options,
        )  # fmt: skip
    except WorkbenchError as e:
        print(f"workbench scale: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        unregister_default(_say_each_configuration)
    table = study.table
    if args.csv:
        _make_folder(args.csv)
        table.to_csv(args.csv, index=False)
    columns = [c for c in (*SUMMARY_COLUMNS, "devices_kind") if c in table]
    print(table[columns].to_string(index=False, float_format=fmt))  # 11,050, not 1.105e+04
    for note in study.notes():  # busy-machine flags and each configuration's breakdown sentence
        print(f"note: {note}")
    if table["threads_note"].iloc[-1]:  # the most replicas: the strongest caveat
        print(f"note: {table['threads_note'].iloc[-1]}")
    figure = study.path or "not written (--out PNG, or --csv, says where)"
    print(f"figure: {figure}" + (f"\ntable: {args.csv}" if args.csv else ""))
    return 0


def _say_each_configuration(run):
    """A sink for each run of `workbench scale`'s study: a line as each configuration starts (the
    run's name says which) and what its processes say while they start. Without it the command
    was silent from its first line to the table (30-60 s here, issue 41)."""

    def sink(event) -> None:
        if event.kind == "message":
            say(event.data.get("text"))
        elif event.kind == "started":
            say(f"{run.name}: compiling step_fn, then the warm-up and the timed steps...")

    return sink


def _report_failure(error: Exception, args) -> int:
    """A failed run: one workbench sentence first (what failed, at which step), the history
    written up to the failure, then TensorFlow's details for anything that is not ours."""
    failed = getattr(error, "run", None)
    where = f" after step {failed.steps}" if failed is not None else ""  # (in a fused chunk: somewhere after)
    first = cause_line(error)  # the innermost error's own sentence, not a wrapper's first line
    # (Ours already says what failed; only TensorFlow's errors are read for a lost peer.)
    peer = None if isinstance(error, WorkbenchError) else _lost_peer(error, args)
    if isinstance(error, WorkbenchError):
        print(f"workbench run: {type(error).__name__}: {error}", file=sys.stderr)
    elif peer:
        print(
            f"workbench run: the run failed{where}: {peer} ({type(error).__name__}).{_resume_hint(args)}",
            file=sys.stderr,
        )
    else:
        print(f"workbench run: the run failed{where}: {first}", file=sys.stderr)
    if args.history and failed is not None:  # the rows up to the failure are kept
        _make_folder(args.history)
        failed.history.to_csv(args.history, index=False)
        print(f"workbench run: history up to step {failed.steps}: {args.history}", file=sys.stderr)
    if not isinstance(error, WorkbenchError):
        print("--- details ---", file=sys.stderr)  # the file's frames (every one: WORKBENCH_TRACEBACKS=full)
        print(shown_text(error), file=sys.stderr, end="")
    return 2 if isinstance(error, ConfigurationError) else 1


_UNHEALTHY = re.compile(r"unhealthy \(stopped sending heartbeats\):\s*/job:(\w+)/replica:\d+/task:(\d+)")
_REMOTE = re.compile(r"from (?:remote target )?/job:(\w+)/(?:replica:\d+/)?task:(\d+)")


def _lost_peer(error: BaseException, args) -> str | None:
    """Which task of a real cluster a TensorFlow failure is about, in words ("worker 1 at
    10.0.0.2:2222 stopped answering ..."), read from TensorFlow's message; None if it names none."""
    if not args.cluster or _on_ray(args):
        return None
    text = str(error)
    try:
        resolver = cluster_resolver(args.cluster)
        spec = resolver.cluster_spec().as_dict()
    except Exception:  # noqa: BLE001 - no cluster to name tasks from: the plain sentence
        return None
    me = f"{resolver.task_type} {resolver.task_id}"

    def at(job: str, index: str) -> str:
        tasks = spec.get(job, [])
        address = tasks[int(index)] if isinstance(tasks, list) and int(index) < len(tasks) else "?"
        return f"{job} {index} at {address}"

    where = "; its host is down or cut off from this one"
    found = _UNHEALTHY.search(text)
    if found:
        return f"{at(*found.groups())} stopped answering: no heartbeat reached TensorFlow's coordination service{where}"
    if "CoordinationService/Heartbeat" in text:
        leader = ("chief", "0") if "chief" in spec else ("worker", "0")
        return f"this task ({me}) lost the coordination service on {at(*leader)}: its heartbeats got no answer{where}"
    found = _REMOTE.search(text)
    if found and f"{found.group(1)} {found.group(2)}" != me:
        return f"{at(*found.groups())} failed or cannot be reached{where}"
    return None


def _resume_hint(args) -> str:
    if args.checkpoint:
        return (
            f" Checkpoints are in {args.checkpoint}: start the same command on every host again to resume "
            "from the last one."
        )
    return (
        " No checkpoint was kept: give --checkpoint DIR (and --checkpoint-every N) to resume after a failure."
    )


def _check_options(args) -> None:
    """The counts and --cluster fit the backend: a sentence with the fix, not a TypeError."""
    backend = registry.spec(args.backend, example="workbench run FILE --backend mirrored")
    registry.check_counts(backend, args.replicas, args.workers, args.ps, args.min_workers)
    if args.worker_timeout is not None and backend.synchronous:
        raise ConfigurationError(
            f"--worker-timeout is how long an async-ps worker may be silent before the run goes on "
            f"without it; the {backend.name} backend is synchronous (every worker takes every step), so "
            f"it has none. Received --backend {args.backend} --worker-timeout {args.worker_timeout:g}. "
            "Fix: --backend async-ps, or leave --worker-timeout out."
        )
    if args.cluster and not backend.takes_workers:
        takers = " or ".join(registry.names(takes_workers=True))
        raise ConfigurationError(
            f"--cluster joins a cluster of worker processes, which the {backend.name} backend does not "
            f"have; received --backend {args.backend} --cluster {args.cluster}. Fix: --backend {takers}, "
            "or leave --cluster out to use this machine's devices."
        )


def _on_ray(args) -> bool:
    """--cluster ray[=ADDRESS]: this process places the workers on a Ray cluster (no TF_CONFIG)."""
    return bool(args.cluster) and args.cluster.partition("=")[0].strip() == "ray"


def _processes(repl) -> str:
    """'4 processes (2 workers, 1 parameter server, a coordinator)': what a run here starts."""
    coordinators = sum(role.count for role in repl.plan.roles() if role.name == "coordinator")
    workers, ps = repl.plan.num_workers, getattr(repl.plan, "num_ps", 0)
    parts = [f"{workers} worker{'s' * (workers != 1)}"]
    parts += [f"{ps} parameter server{'s' * (ps != 1)}"] if ps else []
    parts += ["a coordinator"] if coordinators else []
    return f"{workers + ps + coordinators} processes ({', '.join(parts)})"


def _make_replicator(args):
    extra = {}
    if args.workers is not None:
        extra["num_workers"] = args.workers
    if args.min_workers is not None:
        extra["min_workers"] = args.min_workers
    if args.ps is not None:
        extra["num_ps"] = args.ps
    if args.cluster:
        extra["cluster"] = RayCluster.from_option(args.cluster) if _on_ray(args) else args.cluster
    if registry.spec(args.backend).in_processes:
        extra["startup_timeout"] = args.startup_timeout
    if args.worker_timeout is not None:
        extra["worker_timeout"] = args.worker_timeout
    return registry.replicator(args.backend, num_replicas=args.replicas, **extra)


def _figure_path(args) -> str | None:
    """The scaling figure's file: --out, else beside --csv; none without either (the command
    writes into the working directory only what it is asked to)."""
    if args.out:
        return args.out
    if args.csv:
        return str(Path(args.csv).with_suffix(".png"))
    return None


def _make_folder(path: str) -> None:
    """The folder a file is asked for in (`--history runs/h.csv`): made, as the figure's is."""
    Path(path).resolve().parent.mkdir(parents=True, exist_ok=True)
