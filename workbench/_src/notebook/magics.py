"""`%replicate` / `%%replicate`: pick where a step runs and train it, from a notebook.

A thin layer over `workbench._src.notebook.session` (the same calls `wb.use`, the panel and
`repl.train` make). Three forms:

  %replicate --backend mirrored --replicas 4   set the session's replicator (wb.current())
  %%replicate --steps 300 [--backend ...]      run the cell in repl.context() (`repl` is in
                                               scope), then train the step_fn/input_fn it defines
  %replicate step_fn input_fn --steps 300      train functions already defined
  %%replicate --scaling 1,2,4,8 [--mode strong] a scaling study of the cell (or of named
                                               functions: %replicate step_fn input_fn --scaling ...)
  %%replicate --compare [--replicas 4]         one device vs the replicator, value by value
                                               (or %replicate setup input_fn --compare)

The study forms live in `magic_studies.py`. Mistakes raise UsageError (IPython shows the message without a traceback) saying the fix.
"""

from __future__ import annotations

import difflib

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from workbench._src import options
from workbench._src.core import cells
from workbench._src.core.errors import ConfigurationError, DeviceError
from workbench._src.core.tracebacks import user_facing
from workbench._src.notebook import magic_studies, session
from workbench._src.notebook.tensorboard_view import open_tensorboard

USAGE = """Usage:
  %replicate --backend mirrored --replicas 4   set the session's replicator
  %replicate step_fn input_fn --steps 300      train functions defined in the notebook
  %%replicate --steps 300                      (a cell's first line) run the cell in
                                               repl.context(), then train its step_fn/input_fn
  %%replicate --scaling 1,2,4,8 [--mode strong] scaling study: the cell is run once per replica
                                               count (same initial weights), step_fn measured
  %replicate step_fn input_fn --scaling 1,2,4  scaling study of notebook functions
  %%replicate --compare [--replicas 4]         one device vs the replicator: the cell is run once
                                               on each, differences per output and variable
  %replicate setup input_fn --compare          the same with setup(repl) returning step_fn
Every option: %replicate?"""


@magics_class
class ReplicateMagics(Magics):
    """The workbench's magics; registered by `%load_ext workbench`."""

    @magic_arguments.magic_arguments()
    @magic_arguments.argument(
        "functions",
        nargs="*",
        help="step_fn input_fn: names of notebook functions to train or study (line form); "
        "with --compare: setup input_fn",
    )
    @options.magic_arguments(
        options.BACKEND.but(help=options.BACKEND.kwargs["help"] + " (default: the session's)"),
        options.REPLICAS,
        options.WORKERS,
        options.MIN_WORKERS,
        options.PS,
        options.CLUSTER,
        options.STEPS.but(
            help="train this many steps (training forms); measured steps per configuration "
            "(--scaling, default 50); steps compared (--compare, default 1)"
        ),
        options.STEPS_PER_EXECUTION,
        options.CHECKPOINT,
        options.CHECKPOINT_EVERY,
        options.MAX_RESTARTS,
        options.NAME,
        options.TAGS,
    )
    @magic_arguments.argument(
        "--scaling",
        type=options.replica_counts,
        metavar="1,2,4,8",
        help="scaling study over these replica counts (wb.scaling_study); returns a wb.ScalingStudy",
    )
    @options.magic_arguments(*options.STUDY)
    @magic_arguments.argument(
        "--compare",
        action="store_true",
        help="one device on the global batch vs the replicator (wb.compare_numerics); returns "
        "the DataFrame of differences",
    )
    @magic_arguments.argument(
        "--background",
        action="store_true",
        help="return the run at once and train in a thread (run.stop(), run.wait())",
    )
    @magic_arguments.argument("--no-live", action="store_true", help="no live dashboard and progress bar")
    @magic_arguments.argument(
        "--logdir", metavar="DIR", help="record this run under DIR/<run id> instead of the runs directory"
    )
    @magic_arguments.argument(
        "--tensorboard",
        nargs="?",
        const="latest",
        metavar="RUN",
        help="open TensorBoard on a recorded run's event files (RUN: an id, latest (default), or all)",
    )
    @line_cell_magic
    @user_facing
    def replicate(self, line: str = "", cell: str | None = None):
        """Sets the session's replicator, or trains step_fn/input_fn on it; training returns the wb.Run.

        With --scaling it runs a scaling study and returns the wb.ScalingStudy; with --compare
        it compares one device with the replicator and returns the DataFrame of differences.

        Examples:
          %replicate --backend mirrored --replicas 4
          %replicate step_fn input_fn --steps 300 --background
          %%replicate --steps 300
          model = make_model()
          ...
          %%replicate --scaling 1,2,4,8 --mode strong --steps 50
          %%replicate --compare --replicas 4 --steps 3
        """
        # IPython hands a line magic the whole rest of the line, a trailing `# comment` included
        # (the README's lines have one); drop it as a shell would, or its words become arguments.
        line = strip_comment(line)
        try:
            args = magic_arguments.parse_argstring(self.replicate, line)
        except UsageError as e:
            raise UsageError(f"%replicate {line.strip()!s}: {e}.\n{USAGE}") from None
        if args.tensorboard is not None:
            return open_tensorboard(self.shell, args.tensorboard)
        if args.scaling is not None and args.compare:
            raise UsageError(
                "--scaling and --compare are two different studies; received both. Fix: run "
                "them as two cells, e.g. %%replicate --compare --replicas 4, then "
                "%%replicate --scaling 1,2,4."
            )
        if args.scaling is not None:
            return magic_studies.scaling_form(self, args, cell)
        study_only = [
            flag
            for flag, value in (
                ("--mode", args.mode),
                ("--warmup", args.warmup),
                ("--batch-size", args.batch_size),
            )
            if value is not None
        ]
        if study_only:
            raise UsageError(
                f"{', '.join(study_only)} only apply to a scaling study, but this line has no --scaling. "
                f"Fix: add the replica counts, e.g. --scaling 1,2,4,8 {' '.join(study_only)} ...\n{USAGE}"
            )
        if args.compare:
            return magic_studies.compare_form(self, args, cell)
        if cell is not None:
            return self._cell_form(args, cell)
        if args.functions and args.steps is None and len(args.functions) != 2 and _choice_given(args):
            # Choosing a backend, with stray words on the line: say so in terms of backends.
            choice = _choice_text(args)
            raise UsageError(
                f"%replicate {choice} chooses the session's replicator, but the line also has words "
                f"that are not options: received {' '.join(args.functions)}. Fix: %replicate {choice} "
                f"alone (a comment after it starts with #); to train notebook functions on it, name "
                f"both and the steps: %replicate step_fn input_fn {choice} --steps 300.\n{USAGE}"
            )
        if args.functions or args.steps is not None:
            return self._line_form(args)
        return self._set_form(args)

    # ----- the three forms ------------------------------------------------------------------
    def _set_form(self, args):
        training_only = [
            f
            for f, on in (
                ("--background", args.background),
                ("--no-live", args.no_live),
                ("--checkpoint", args.checkpoint),
                ("--checkpoint-every", args.checkpoint_every),
                ("--max-restarts", args.max_restarts),
                ("--logdir", args.logdir),
                ("--name", args.name),
                ("--tags", args.tags),
                ("--steps-per-execution", args.steps_per_execution != "auto"),
            )
            if on
        ]
        if training_only:
            raise UsageError(
                f"Training options given ({', '.join(training_only)}), but this line trains nothing. "
                f"Fix: name the functions and the steps, e.g. %replicate step_fn input_fn --steps 300 {' '.join(training_only)}.\n{USAGE}"
            )
        if not _choice_given(args):
            repl = session.current_or_none()
            if repl is None:
                raise UsageError(f"No replicator chosen yet, and this line names none.\n{USAGE}")
            return repl
        repl = self._choose(args)
        self.shell.user_ns["repl"] = repl
        if getattr(repl, "runs_in_processes", False):
            # The cell that trains comes next: its processes start now, in the background, and
            # import TensorFlow and form the cluster while the user writes it.
            repl.prestart()
        return repl

    def _line_form(self, args):
        if len(args.functions) != 2:
            got = " ".join(args.functions) or "none"
            raise UsageError(
                f"The line form trains two notebook functions, step_fn and input_fn; received {got}. "
                "Fix: %replicate step_fn input_fn --steps 300 (or start a cell with %%replicate --steps 300)."
            )
        if args.steps is None:
            raise UsageError(f"How many steps? Fix: %replicate {' '.join(args.functions)} --steps 300.")
        step_fn, input_fn = (
            self._lookup(name, role) for name, role in zip(args.functions, ("step_fn", "input_fn"))
        )
        if "input" in args.functions[0] and "step" in args.functions[1]:
            raise UsageError(
                f"The functions look swapped: received {args.functions[0]} {args.functions[1]}. The "
                f"step function comes first. Fix: %replicate {args.functions[1]} {args.functions[0]} --steps {args.steps}."
            )
        return self._train(self._choose(args), step_fn, input_fn, args)

    def _cell_form(self, args, cell: str):
        if args.functions:
            raise UsageError(
                f"%%replicate takes no function names (received {' '.join(args.functions)}); it trains "
                "the step_fn and input_fn that the cell defines. Fix: %%replicate --steps 300."
            )
        if args.steps is None:
            raise UsageError("How many steps? Fix: start the cell with %%replicate --steps 300.")
        repl = self._choose(args)
        self.shell.user_ns["repl"] = repl
        session.remember_replicate_cell(self.shell.transform_cell(cell))  # (the panel's Run sends it)
        if getattr(repl, "runs_in_processes", False):
            # multi-worker: the cell runs here (to define its names and model) and in every
            # worker process; the trained weights come back into this cell's variables.
            return self._train(repl, None, None, args, cell=self.shell.transform_cell(cell))
        code = self.compile_cell(cell)
        # A re-run of this cell first releases what its previous run left on the replicator
        # (variables, compiled programs; see cells.py), so re-runs start clean.
        with cells.owned_by_cell(repl, cells.cell_key(self.shell)) as owned:
            with repl.context():  # the model and optimizer built here are replicated
                cells.execute_source(code, self.shell.user_ns)  # errors show as in any cell
            step_fn, input_fn = self.defined_functions()
            run = self._train(repl, step_fn, input_fn, args)
            owned.track(run)
        return run

    # ----- shared with the study forms (magic_studies.py) ----------------------------------
    def compile_cell(self, cell: str):
        """The cell's code object; magics and shell escapes inside still work."""
        code = self.shell.transform_cell(cell)
        filename = self.shell.compile.cache(code, self.shell.execution_count, raw_code=cell)
        return compile(code, filename, "exec")

    def defined_functions(self, ns: dict | None = None):
        """(step_fn, input_fn) from the namespace (the notebook's) after a %%replicate cell ran."""
        try:
            return cells.functions_defined(self.shell.user_ns if ns is None else ns)
        except ConfigurationError as e:
            raise UsageError(str(e)) from None

    def lookup_functions(self, names: list[str], roles: tuple[str, str], options: str):
        """The two named notebook functions, checked (defined, callable, not swapped)."""
        first, second = (self._lookup(name, role) for name, role in zip(names, roles))
        if "input" in names[0] and "input" not in names[1]:
            raise UsageError(
                f"The functions look swapped: received {names[0]} {names[1]}. The {roles[0]} comes "
                f"first. Fix: %replicate {names[1]} {names[0]} {options}."
            )
        return first, second

    # ----- helpers ------------------------------------------------------------------------
    def choose(self, args):
        """The replicator the options name (and make the session's), or the session's."""
        return self._choose(args)

    def _choose(self, args):
        if not _choice_given(args):
            repl = session.current_or_none()
            if repl is None:
                raise UsageError(
                    "No replicator chosen for this session yet. Fix: add --backend mirrored --replicas 4 "
                    "to this line, run `%replicate --backend mirrored --replicas 4` first, or pick one "
                    "in wb.ui.panel()."
                )
            return repl
        try:
            return session.choose(
                args.backend,
                args.replicas,
                args.workers,
                args.ps,
                cluster=args.cluster,
                min_workers=args.min_workers,
            )
        except (ConfigurationError, DeviceError) as e:
            raise UsageError(str(e)) from None

    def _lookup(self, name: str, role: str):
        ns = self.shell.user_ns
        if name in ns:
            value = ns[name]
        else:
            try:
                value = self.shell.ev(name)  # dotted names: model.step_fn
            except Exception:  # noqa: BLE001 - any failure means the name is not there
                near = difflib.get_close_matches(
                    name, [k for k, v in ns.items() if callable(v) and not k.startswith("_")], n=1
                )
                hint = f" Did you mean {near[0]}?" if near else ""
                raise UsageError(
                    f"{name!r} (the {role}) is not defined in the notebook.{hint} Fix: define it in a cell "
                    "and run that cell first, or use %%replicate to define and train in one cell."
                ) from None
        if not callable(value):
            raise UsageError(
                f"{name!r} (the {role}) must be a function; received a {type(value).__name__}: {value!r:.60}."
            )
        return value

    def _train(self, repl, step_fn, input_fn, args, cell: str | None = None):
        return session.train(
            repl,
            step_fn,
            input_fn,
            args.steps,
            steps_per_execution=args.steps_per_execution,
            background=args.background,
            live=not args.no_live,
            checkpoint_dir=args.checkpoint,
            checkpoint_every=args.checkpoint_every,
            max_restarts=args.max_restarts,
            logdir=args.logdir,
            cell=cell,
            namespace=self.shell.user_ns,
            name=args.name,
            tags=[t.strip() for t in (args.tags or "").split(",") if t.strip()],
        )


def strip_comment(line: str) -> str:
    """The line without a trailing `# comment`, as a shell reads it: `#` starts a comment at the
    start of a word outside quotes (`--logdir 'runs #2'` and `--logdir runs#2` keep theirs).

    >>> strip_comment("--backend mirrored --replicas 4   # the session's replicator")
    '--backend mirrored --replicas 4'
    >>> strip_comment("--logdir 'runs #2' --steps 3 # three")
    "--logdir 'runs #2' --steps 3"
    """
    quote = None
    escaped = False
    for i, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line


def _choice_text(args) -> str:
    """The backend options the line gave, as they would be typed: --backend mirrored --replicas 4."""
    given = (
        ("--backend", args.backend),
        ("--replicas", args.replicas),
        ("--workers", args.workers),
        ("--min-workers", args.min_workers),
        ("--ps", args.ps),
        ("--cluster", args.cluster),
    )
    return " ".join(f"{flag} {value}" for flag, value in given if value is not None)


def _choice_given(args) -> bool:
    given = (args.backend, args.replicas, args.workers, args.min_workers, args.ps, args.cluster)
    return any(v is not None for v in given)
