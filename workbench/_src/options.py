"""The options `%replicate` and `workbench run`/`workbench scale` share, declared once.

Each is an argparse argument (flags, type, metavar, help); the magic applies them with IPython's
magic_arguments, the CLI with argparse, so a flag means the same and says the same in
`%replicate?` and `workbench run --help` (ipyparallel declares its magics' argument groups the
same way). A tool may change a declaration's default or help with `Option.but(...)`.
"""

from __future__ import annotations

import argparse
import dataclasses

from workbench._src.core import registry


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, received {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, received {text!r}")
    return value


def steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of steps such as 300, received {text!r}"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number of steps, received {text!r}")
    return value


def restarts(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"expected a number of restarts such as 3 (0: none), received {text!r}"
        )
    return value


def steps_per_execution(text: str):
    return "auto" if text.strip().lower() == "auto" else positive_int(text)


def replica_counts(text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        counts = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected replica counts separated by commas, such as 1,2,4,8; received {text!r}"
        ) from None
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(
            f"expected positive replica counts separated by commas, such as 1,2,4,8; received {text!r}"
        )
    return counts


@dataclasses.dataclass(frozen=True)
class Option:
    """One argparse argument: its flags and add_argument's keyword arguments."""

    flags: tuple[str, ...]
    kwargs: dict

    def but(self, **changes) -> Option:
        return Option(self.flags, {**self.kwargs, **changes})

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(*self.flags, **self.kwargs)


def _option(*flags: str, **kwargs) -> Option:
    return Option(flags, kwargs)


BACKEND = _option("--backend", "-b", metavar="NAME", help=" | ".join(registry.BACKENDS))
REPLICAS = _option(
    "--replicas",
    "-r",
    type=positive_int,
    metavar="N",
    help="replicas (default: every device the backend can use)",
)
WORKERS = _option(
    "--workers",
    type=positive_int,
    metavar="N",
    help=f"worker processes ({', '.join(registry.names(takes_workers=True))}; default 2)",
)
MIN_WORKERS = _option(
    "--min-workers",
    type=positive_int,
    metavar="N",
    help="multi-worker with --max-restarts: when the cluster has no room for every worker, go on "
    "with fewer, not below N, keeping the global batch; grow back at a checkpoint once room returns",
)
PS = _option(
    "--ps",
    type=positive_int,
    metavar="N",
    help=f"parameter servers ({', '.join(registry.names(takes_ps=True))}; default 1)",
)
CLUSTER = _option(
    "--cluster",
    metavar="ray[=ADDRESS]",
    help="place the worker processes on a Ray cluster: ray (the one this machine joined), "
    "ray=ADDRESS (e.g. ray://head:10001) or ray=local (a Ray instance of this kernel)",
)
STEPS = _option("--steps", "-s", type=steps, metavar="N", help="train this many steps")
STEPS_PER_EXECUTION = _option(
    "--steps-per-execution",
    type=steps_per_execution,
    metavar="K",
    default="auto",
    help="steps fused per compiled call, or auto (default)",
)
CHECKPOINT = _option("--checkpoint", metavar="DIR", help="save checkpoints in DIR (and resume from it)")
CHECKPOINT_EVERY = _option(
    "--checkpoint-every", type=positive_int, metavar="N", help="also save every N steps"
)
MAX_RESTARTS = _option(
    "--max-restarts",
    type=restarts,
    metavar="N",
    default=0,
    help="on worker processes: heal the run up to N times when a worker, parameter server or "
    "host is lost or preempted (new processes resume from the last checkpoint; default 0)",
)
NAME = _option("--name", metavar="NAME", help="the run's name (unique in the run store)")
TAGS = _option("--tags", metavar="A,B", help="the run's tags, separated by commas")
MODE = _option("--mode", choices=("weak", "strong"), help="scaling: weak (default) or strong scaling")
WARMUP = _option("--warmup", type=positive_int, metavar="N", help="untimed steps first (default 10)")
BATCH_SIZE = _option(
    "--batch-size",
    type=positive_int,
    metavar="B",
    help="scaling: batch per replica (weak) or global (strong), default 32; input_fn reads ctx.global_batch_size",
)

# Where a run happens, and how a training run is told apart and kept.
WHERE = (BACKEND, REPLICAS, WORKERS, MIN_WORKERS, PS)
TRAINING = (STEPS, STEPS_PER_EXECUTION, CHECKPOINT, CHECKPOINT_EVERY, MAX_RESTARTS, NAME, TAGS)
STUDY = (MODE, WARMUP, BATCH_SIZE)


def magic_arguments(*options: Option):
    """A decorator adding `options` to a magic, in the order given (IPython's magic_arguments)."""
    from IPython.core import magic_arguments as ipython

    def decorate(func):
        for option in reversed(options):  # decorators apply bottom-up: reversed keeps the order
            func = ipython.argument(*option.flags, **option.kwargs)(func)
        return func

    return decorate


def add_arguments(parser: argparse.ArgumentParser, *options: Option) -> None:
    for option in options:
        option.add_to(parser)
