"""`%replicate` / `%%replicate`: pick where a step runs and train it, from a notebook.

A thin layer over `workbench._src.session` (the same calls `wb.use`, the panel and
`repl.train` make). Three forms:

  %replicate --backend mirrored --replicas 4   set the session's replicator (wb.current())
  %%replicate --steps 300 [--backend ...]      run the cell in repl.context() (`repl` is in
                                               scope), then train the step_fn/input_fn it defines
  %replicate step_fn input_fn --steps 300      train functions already defined

Mistakes raise UsageError (IPython shows the message without a traceback) saying the fix.
"""

from __future__ import annotations

import argparse
import difflib

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from workbench._src import session
from workbench._src.errors import ConfigurationError, DeviceError

USAGE = """Usage:
  %replicate --backend mirrored --replicas 4   set the session's replicator
  %replicate step_fn input_fn --steps 300      train functions defined in the notebook
  %%replicate --steps 300                      (a cell's first line) run the cell in
                                               repl.context(), then train its step_fn/input_fn
Every option: %replicate?"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, received {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, received {text!r}")
    return value


def _steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of steps such as 300, received {text!r}"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number of steps, received {text!r}")
    return value


def _steps_per_execution(text: str):
    return "auto" if text.strip().lower() == "auto" else _positive_int(text)


@magics_class
class ReplicateMagics(Magics):
    """The workbench's magics; registered by `%load_ext workbench`."""

    @magic_arguments.magic_arguments()
    @magic_arguments.argument(
        "functions", nargs="*", help="step_fn input_fn: names of notebook functions to train (line form)"
    )
    @magic_arguments.argument(
        "--backend",
        "-b",
        metavar="NAME",
        help="single | mirrored | multi-worker | async-ps | tpu (default: the session's)",
    )
    @magic_arguments.argument(
        "--replicas",
        "-r",
        type=_positive_int,
        metavar="N",
        help="replicas (default: every device the backend can use)",
    )
    @magic_arguments.argument(
        "--workers", type=_positive_int, metavar="N", help="worker processes (multi-worker, async-ps)"
    )
    @magic_arguments.argument("--ps", type=_positive_int, metavar="N", help="parameter servers (async-ps)")
    @magic_arguments.argument(
        "--steps", "-s", type=_steps, metavar="N", help="train this many steps (training forms)"
    )
    @magic_arguments.argument(
        "--steps-per-execution",
        type=_steps_per_execution,
        metavar="K",
        default="auto",
        help="steps fused per compiled call, or auto (default)",
    )
    @magic_arguments.argument(
        "--background",
        action="store_true",
        help="return the run at once and train in a thread (run.stop(), run.wait())",
    )
    @magic_arguments.argument("--no-live", action="store_true", help="no live dashboard and progress bar")
    @magic_arguments.argument(
        "--checkpoint", metavar="DIR", help="save checkpoints in DIR (and resume from it)"
    )
    @magic_arguments.argument(
        "--logdir", metavar="DIR", help="record this run under DIR/<run id> instead of the runs directory"
    )
    @line_cell_magic
    def replicate(self, line: str = "", cell: str | None = None):
        """Sets the session's replicator, or trains step_fn/input_fn on it; training returns the wb.Run.

        Examples:
          %replicate --backend mirrored --replicas 4
          %replicate step_fn input_fn --steps 300 --background
          %%replicate --steps 300
          model = make_model()
          ...
        """
        try:
            args = magic_arguments.parse_argstring(self.replicate, line)
        except UsageError as e:
            raise UsageError(f"%replicate {line.strip()!s}: {e}.\n{USAGE}") from None
        if cell is not None:
            return self._cell_form(args, cell)
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
                ("--logdir", args.logdir),
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
        code = self.shell.transform_cell(cell)  # magics and shell escapes inside still work
        filename = self.shell.compile.cache(code, self.shell.execution_count, raw_code=cell)
        with repl.context():  # the model and optimizer built here are replicated
            exec(compile(code, filename, "exec"), self.shell.user_ns)  # errors show as in any cell
        missing = [n for n in ("step_fn", "input_fn") if not callable(self.shell.user_ns.get(n))]
        if missing:
            raise UsageError(
                f"The %%replicate cell must define step_fn(batch) and input_fn(ctx); {' and '.join(missing)} "
                "is not defined (or not a function). Fix: add e.g.\n"
                "  def input_fn(ctx): return dataset\n  def step_fn(batch): ...; return {'loss': loss}"
            )
        return self._train(repl, self.shell.user_ns["step_fn"], self.shell.user_ns["input_fn"], args)

    # ----- helpers ------------------------------------------------------------------------
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
            return session.choose(args.backend, args.replicas, args.workers, args.ps)
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

    def _train(self, repl, step_fn, input_fn, args):
        return session.train(
            repl,
            step_fn,
            input_fn,
            args.steps,
            steps_per_execution=args.steps_per_execution,
            background=args.background,
            live=not args.no_live,
            checkpoint_dir=args.checkpoint,
            logdir=args.logdir,
        )


def _choice_given(args) -> bool:
    return any(v is not None for v in (args.backend, args.replicas, args.workers, args.ps))
