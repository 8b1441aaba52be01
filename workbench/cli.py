"""`workbench` command line: `workbench demo`, `workbench run FILE.py`, `workbench scale FILE.py`."""

from __future__ import annotations

import argparse
import sys

from workbench._src import options
from workbench._src.core import registry
from workbench._src.scripts.demo import default_out
from workbench._src.scripts.demo import demo as run_demo
from workbench._src.scripts.run_file import run_file, scale_file
from workbench._src.sinks.progress import say

RUN_EXAMPLES = """examples:
  workbench run examples/train.py --backend mirrored --replicas 4 --steps 500
  workbench run examples/train.py --backend multi-worker --workers 2 --steps 500
  workbench run examples/train.py --backend async-ps --workers 2 --ps 1 --steps 500
  # on a real cluster, every host runs the same line with its own TF_CONFIG (or under srun):
  workbench run examples/train.py --backend multi-worker --cluster TF_CONFIG --steps 500
  # async-ps: the chief runs the file, the ps and worker tasks serve until the chief has gone:
  workbench run examples/train.py --backend async-ps --cluster TF_CONFIG --steps 500
  # or from one machine, the processes placed on a Ray cluster (`ray start` ran on every node):
  workbench run examples/train.py --backend multi-worker --workers 4 --cluster ray --steps 500

FILE.py is run inside the replicator's context (as a %%replicate cell is): it builds its model
and optimizer and defines input_fn(ctx) and step_fn(batch); `repl` (or wb.current()) is the
replicator. It may be run once per worker process, so keep other side effects out of it.
examples/train.py (in the repository) is such a file: an MLP on scikit-learn's digits."""

SCALE_EXAMPLES = """examples:
  workbench scale examples/train.py --replicas 1,2,4,8 --mode weak --batch-size 32
  workbench scale examples/train.py --backend multi-worker --replicas 1,2 --mode strong --batch-size 256
  workbench scale examples/train.py --replicas 1,2,4 --csv /tmp/workbench-results/study.csv

FILE.py is run once per configuration inside that configuration's replicator context (on
multi-worker, in its worker processes), after seeding: it builds its model and optimizer and
defines input_fn(ctx), which must batch to ctx.global_batch_size, and step_fn(batch)."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Epilogs as written; every option's help ends with its default (unless it names one)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and default not in (None, False, argparse.SUPPRESS)
            and "default" not in text
        ):
            shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
            text += f" (default: {str(shown).replace('%', '%%')})"
        return text


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        say("importing TensorFlow and building the model...")  # (what the next seconds do)
        run_demo(replicas=args.replicas, steps=args.steps, out=args.out)
        return 0
    if args.command == "scale":
        return scale_file(args)
    return run_file(args)


def build_parser() -> argparse.ArgumentParser:
    """The `workbench` parser and its three subcommands (every option's help shows its default)."""
    parser = argparse.ArgumentParser(prog="workbench", description="Replicator Workbench")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a small model on digits over mirrored virtual CPUs",
        description="Trains an MLP on scikit-learn's digits on the mirrored backend (virtual CPUs "
        "when there is no GPU), then prints a summary (throughput, loss, test accuracy) and writes "
        "a plot of the run.",
        formatter_class=HelpFormatter,
    )
    demo.add_argument(
        "--replicas",
        type=options.positive_int,
        default=4,
        metavar="N",
        help="mirrored replicas (one device each)",
    )
    demo.add_argument(
        "--steps",
        type=options.positive_int,
        default=600,
        metavar="N",
        help="training steps (global batch 128)",
    )
    demo.add_argument(
        "--out",
        default=default_out(),
        metavar="PNG",
        help="where to write the plot (its folder is created)",
    )
    run = sub.add_parser(
        "run",
        help="train the input_fn/step_fn a Python file defines, on any backend",
        epilog=RUN_EXAMPLES,
        formatter_class=HelpFormatter,
    )
    run.add_argument("file", help="a Python file defining input_fn and step_fn")
    options.add_arguments(
        run,
        options.BACKEND.but(default="mirrored"),
        *options.WHERE[1:],
        options.STEPS.but(required=True),
        options.STEPS_PER_EXECUTION,
        options.CHECKPOINT,
        options.CHECKPOINT_EVERY,
        options.MAX_RESTARTS,
        options.NAME,
        options.TAGS,
    )
    run.add_argument("--history", metavar="CSV", help="write the run's history to this CSV file")
    run.add_argument(
        "--cluster",
        help="join a real cluster: TF_CONFIG (the environment variable) or slurm; or place the worker "
        "processes on a Ray cluster: ray, ray=ADDRESS, ray=local; default: start local processes",
    )
    run.add_argument(
        "--startup-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="seconds to wait for the processes or the cluster to be ready",
    )
    run.add_argument(
        "--worker-timeout",
        type=float,
        metavar="SECONDS",
        help="async-ps on a cluster: seconds a worker may not answer before it is declared lost and "
        "the run goes on without it (default 60)",
    )
    run.add_argument(
        "--cpus", type=int, metavar="N", help="virtual CPU devices in this process (default 8 without GPUs)"
    )
    scale = sub.add_parser(
        "scale",
        help="a scaling study of the model a Python file builds (as %%%%replicate --scaling)",
        epilog=SCALE_EXAMPLES,
        formatter_class=HelpFormatter,
    )
    scale.add_argument("file", help="a Python file building its model and defining input_fn and step_fn")
    options.add_arguments(
        scale,
        options.BACKEND.but(default="mirrored", help=" | ".join(registry.names(synchronous=True))),
        options.REPLICAS.but(
            type=options.replica_counts, default=[1, 2, 4, 8], metavar="1,2,4,8", help="replica counts"
        ),
        options.STEPS.but(default=50, help="measured steps per configuration"),
        options.STEPS_PER_EXECUTION.but(
            default=10, help="steps fused per compiled call, or auto (default 10)"
        ),
        options.MODE.but(default="weak"),
        options.WARMUP.but(default=10),
        options.BATCH_SIZE.but(default=32, help="per replica (weak) or global (strong)"),
    )
    scale.add_argument(
        "--out",
        metavar="PNG",
        help="where to write the figure (default: beside --csv, as .png; without either, none)",
    )
    scale.add_argument("--csv", help="also write the table to this CSV file (its folder is created)")
    scale.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="measure each configuration this many times, interleaved (spread)",
    )
    scale.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="TensorFlow threads per worker (multi-worker; default: TensorFlow's)",
    )
    scale.add_argument(
        "--cpus", type=int, metavar="N", help="virtual CPU devices here (mirrored; default max(8, counts))"
    )
    return parser


if __name__ == "__main__":
    sys.exit(main())
