"""The study forms of `%replicate`: `--scaling` (wb.scaling_study) and `--compare` (wb.compare_numerics).

Both need the model built more than once, each time from the same initial weights: once per
replica count for a scaling study, once on one device and once under the replicator for a
comparison. The cell form therefore treats the cell body as the library's `setup(repl)`: the
cell is compiled once and executed once per build, inside that build's `repl.context()`, with
`repl` bound to that build's replicator; the `step_fn` and `input_fn` it defines are what the
study runs. The line form names notebook functions and maps one to one onto the Python call:
  %replicate step_fn input_fn --scaling 1,2,4   wb.scaling_study(step_fn, input_fn, replicas=[1, 2, 4])
  %replicate setup input_fn --compare           wb.compare_numerics(setup, input_fn, replicas=repl)
"""

from __future__ import annotations

import io

from IPython.core.error import UsageError

from workbench._src.core import cells, registry
from workbench._src.core.errors import ConfigurationError, DeviceError
from workbench._src.core.inputs import call_input_fn
from workbench._src.notebook import session
from workbench._src.numerics.differences import compare_numerics, plot_numerics
from workbench._src.studies.scaling import scaling_study


def scaling_form(magics, args, cell: str | None):
    """`%replicate ... --scaling 1,2,4`: runs wb.scaling_study; returns the wb.ScalingStudy."""

    _refuse(
        args,
        "--scaling",
        "a scaling study builds one replicator per count in --scaling (on multi-worker, "
        "the counts are replicas: one worker each on CPUs) and measures in the foreground",
        background=args.background,
        checkpoint=args.checkpoint,
        logdir=args.logdir,
        replicas=args.replicas,
        workers=args.workers,
        ps=args.ps,
    )
    if args.steps == 0:
        raise UsageError("--steps must be at least 1 for a scaling study (measured steps). Fix: --steps 50.")
    options = {
        "backend": _study_backend(args.backend),
        "replicas": args.scaling,
        "mode": args.mode or "weak",
        "live": False if args.no_live else None,  # None: the live plot when in a kernel
    }
    for name, value in (("steps", args.steps), ("warmup", args.warmup), ("batch_size", args.batch_size)):
        if value is not None:
            options[name] = value
    if args.steps_per_execution != "auto":
        options["steps_per_execution"] = args.steps_per_execution
    ns = magics.shell.user_ns
    previous = ns.get("repl", _MISSING)
    if cell is not None:
        _no_function_names(args, "%%replicate --scaling 1,2,4")
        if registry.spec(options["backend"]).in_processes:  # the cell runs here, then in the workers
            call = lambda: scaling_study(  # noqa: E731
                setup=_cell_for_workers(magics, cell, options["backend"], max(args.scaling)), **options
            )
        else:
            code = magics.compile_cell(cell)

            def setup(repl):  # called by the study inside each configuration's repl.context()
                ns["repl"] = repl  # the cell's functions use this configuration's replicator
                cells.execute_source(code, ns)
                return magics.defined_functions()

            call = lambda: scaling_study(setup=setup, **options)  # noqa: E731
    else:
        names = _two_names(args, "step_fn input_fn", f"--scaling {_counts(args.scaling)}")
        step_fn, input_fn = magics.lookup_functions(
            names, ("step_fn", "input_fn"), f"--scaling {_counts(args.scaling)}"
        )
        call = lambda: scaling_study(step_fn, input_fn, **options)  # noqa: E731
    try:
        return call()
    except (ConfigurationError, DeviceError) as e:
        raise UsageError(str(e)) from None
    except RuntimeError as e:
        if cell is None and "Mixing different tf.distribute.Strategy" in str(e):
            raise UsageError(
                f"{args.functions[0]} uses variables created under another replicator (e.g. a model "
                "built in the session's repl.context()), but a scaling study runs every replica "
                "count on its own replicator, with the model built again from the same initial "
                "weights. Received a stateful step_fn in the line form. Fix: put "
                f"%%replicate --scaling {_counts(args.scaling)} at the top of the cell that builds "
                "the model and defines step_fn and input_fn (or call wb.scaling_study(setup=...))."
            ) from None
        raise
    finally:  # `repl` is the session's again, not the last configuration's
        if previous is _MISSING:
            ns.pop("repl", None)
        else:
            ns["repl"] = previous


def _cell_for_workers(magics, cell: str, backend: str, replicas: int):
    """The cell as a setup that travels to each configuration's worker processes.

    The cell runs here first, in a launcher's local context (as a multi-worker training cell
    does), so its mistakes show at once and the notebook has its names; then its source and the
    notebook's picklable names go to the workers, which build the model themselves.
    """
    ns = magics.shell.user_ns
    ns["repl"] = launcher = registry.replicator(backend, num_replicas=replicas)
    setup, _variables_here = launcher.setup_from_cell(magics.shell.transform_cell(cell), ns)
    magics.defined_functions()  # the cell must define step_fn and input_fn
    return setup


def compare_form(magics, args, cell: str | None):
    """`%replicate ... --compare`: runs wb.compare_numerics against the session's (or chosen)
    replicator, shows the differences plot and returns the DataFrame."""

    _refuse(
        args,
        "--compare",
        "a comparison runs a few steps in the foreground and returns the differences",
        background=args.background,
        checkpoint=args.checkpoint,
        logdir=args.logdir,
        steps_per_execution=args.steps_per_execution != "auto",
    )
    if args.steps == 0:
        raise UsageError("--steps must be at least 1 for --compare (steps compared). Fix: --steps 3.")
    repl = magics.choose(args)
    if repl.num_replicas < 2:
        raise UsageError(
            f"--compare checks the replicated run against one device, but the replicator has one "
            f"replica ({repl!r}): both sides would be one device. Fix: %%replicate --compare "
            "--backend mirrored --replicas 4."
        )
    ns = magics.shell.user_ns
    steps = args.steps or 1
    try:
        if cell is not None:
            _no_function_names(args, "%%replicate --compare")
            code = magics.compile_cell(cell)
            sides: list[dict] = []

            def setup(side_repl):  # called inside each side's repl.context()
                # Each side runs the cell in its own copy of the notebook namespace: the two
                # step_fns are traced after both builds, and must each find their own model and
                # optimizer behind the global names the cell uses.
                side_ns = {**ns, "repl": side_repl}
                cells.execute_source(code, side_ns)
                sides.append(side_ns)
                return magics.defined_functions(side_ns)[0]

            def input_fn(ctx):  # the cell's input_fn (the last side's), once the cell has run
                return call_input_fn(sides[-1]["input_fn"], ctx)

            # The replicated side builds on the session's replicator: a re-run releases it.
            with cells.owned_by_cell(repl, cells.cell_key(magics.shell)):
                table = compare_numerics(setup, input_fn, replicas=repl, steps=steps)
            # The notebook keeps what the cell defined on the replicated side (as a training
            # cell leaves its model in the namespace).
            ns.update({k: v for k, v in sides[-1].items() if k != "repl" and ns.get(k, _MISSING) is not v})
        else:
            names = _two_names(args, "setup input_fn", "--compare")
            if names[0].startswith("step"):
                raise UsageError(
                    f"--compare builds the model twice (one device, then {repl.num_replicas} replicas), "
                    f"so it needs setup(repl), a function that builds the model and returns step_fn; "
                    f"received {names[0]!r}. Fix: %%replicate --compare at the top of the cell that "
                    "builds the model, or `def setup(repl): ...; return step_fn` then "
                    f"%replicate setup {names[1]} --compare."
                )
            setup, input_fn = magics.lookup_functions(names, ("setup", "input_fn"), "--compare")
            table = compare_numerics(setup, input_fn, replicas=repl, steps=steps)
    except (ConfigurationError, DeviceError) as e:
        raise UsageError(str(e)) from None
    finally:
        ns["repl"] = repl  # as after any %replicate: the session's replicator
    if not args.no_live:
        _show_figure(plot_numerics(table))
    return table


_MISSING = object()


def _refuse(args, form: str, why: str, **given) -> None:
    flags = [f"--{name.replace('_', '-')}" for name, value in given.items() if value not in (None, False)]
    if flags:
        raise UsageError(
            f"{', '.join(flags)} cannot be used with {form}: {why}. Received {' '.join(flags)}. "
            f"Fix: drop {' and '.join(flags)}."
        )


def _no_function_names(args, example: str) -> None:
    if args.functions:
        raise UsageError(
            f"A %%replicate cell takes no function names (received {' '.join(args.functions)}); the "
            f"cell defines step_fn and input_fn. Fix: {example}."
        )


def _two_names(args, expected: str, options: str) -> list[str]:
    if len(args.functions) != 2:
        got = " ".join(args.functions) or "none"
        raise UsageError(
            f"The line form of {options.split()[0]} takes two notebook functions, {expected}; "
            f"received {got}. Fix: %replicate {expected} {options}, or put %%replicate {options} "
            "at the top of the cell that builds the model and defines step_fn and input_fn."
        )
    return args.functions


def _counts(counts: list[int]) -> str:
    return ",".join(str(n) for n in counts)


def _study_backend(backend: str | None) -> str:
    """--backend, else the session's backend, else mirrored; the session itself is unchanged."""
    if backend is None:
        choice = session.current_choice() or {}
        backend = (
            choice.get("backend") or getattr(session.current_or_none(), "backend", None) or registry.DEFAULT
        )
    try:
        return session.normalize_backend(backend)
    except ConfigurationError as e:
        raise UsageError(str(e)) from None


def _show_figure(fig) -> None:
    """Displays a matplotlib Figure as a PNG (no pyplot, whatever the notebook's backend)."""
    from IPython.display import Image, display

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    display(Image(data=buf.getvalue(), format="png"))
