"""RunOptions: what `repl.train` accepts besides the functions, validated once for every backend
(in-process runs, and launched runs before any process starts)."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

from workbench._src.core.checkpoints import check_writable_directory
from workbench._src.core.errors import ConfigurationError, check_positive_int


@dataclasses.dataclass
class RunOptions:
    """What `repl.train` accepts besides the functions; validated once, for every backend.

    Attributes:
      steps: steps to run (each step: every replica takes one batch).
      steps_per_execution: steps fused into one compiled call, or "auto".
      reduce: how each scalar output is combined across replicas, e.g. {"correct": "sum"}; the
        default for every scalar is "mean". Non-scalar outputs are not recorded.
      checkpoint_dir: where to save checkpoints (at the end, every `checkpoint_every` steps, and
        when the run is stopped or fails); checked before the first step.
      checkpoint: what to save: a tf.train.Checkpoint or a dict of trackables (e.g.
        {"model": model, "optimizer": opt}); default: every variable created in repl.context().
      resume: restore the latest checkpoint in checkpoint_dir first, and go on counting from
        its step (False: start from the variables as they are, and save over it; a step number
        N: the checkpoint of step N, `ckpt-N`, which must be there).
      on_nonfinite: a NaN/Inf metric "stop"s the run with a warning, "raise"s NonFiniteError
        (the partial run in `err.run`), or is "ignore"d.
      warmup: steps run first, before the recorded ones: untimed and not in the history (they
        absorb tracing; `run.compile_seconds` is their first call's). They do train the model.
      background: return at once and train in a thread; use run.stop() / run.wait().
      sinks: callables (or objects with send) that receive the run's events.
      name: the run's name (default: what ran, where and when, e.g. "mirrored x4 · nb01 ·
        14:02"); the run store adds a suffix when another run there has it.
      tags: labels for finding the run later (wb.runs()["tags"], wb.tag_run).
      hparams: the run's hyperparameters, e.g. {"lr": 1e-3}: columns of wb.runs().
      breakdown: read the clock inside every step so run.breakdown() can say where the time
        goes (input, compute, communication, other); costs well under 3% of throughput.
      max_restarts: on worker processes (multi-worker, async-ps), how many times the run heals
        itself when a member is lost (killed, frozen, its host gone) or preempted: new processes,
        then the latest checkpoint restored, and training goes on (launch/heal.py; the record is
        `run.restarts`). Without checkpoint_dir a temporary folder holds the checkpoints; without
        checkpoint_every the run saves every 100 steps. In one process there is nothing to heal.
    """

    steps: int
    steps_per_execution: int | Literal["auto"] = "auto"
    reduce: dict | None = None
    checkpoint_dir: str | os.PathLike | None = None
    checkpoint: object = None
    checkpoint_every: int | None = None
    resume: bool | int = True
    on_nonfinite: Literal["stop", "raise", "ignore"] = "stop"
    warmup: int = 0
    background: bool = False
    sinks: tuple = ()
    name: str | None = None
    tags: tuple = ()
    hparams: dict | None = None
    breakdown: bool = True
    max_restarts: int = 0

    def __post_init__(self):
        steps = self.steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise ConfigurationError(
                f"steps must be a non-negative integer; received steps={steps!r}. Fix: e.g. steps=300."
            )
        if self.steps_per_execution != "auto":
            check_positive_int(
                "steps_per_execution", self.steps_per_execution, fix="a step count such as 20, or 'auto'"
            )
        for metric, op in (self.reduce or {}).items():
            if op not in ("mean", "sum"):
                raise ConfigurationError(
                    f"reduce[{metric!r}] must be 'mean' or 'sum'; received {op!r}. For max/min, "
                    "reduce inside step_fn with repl.all_reduce(x, 'max') and return the result."
                )
        if self.on_nonfinite not in ("stop", "raise", "ignore"):
            raise ConfigurationError(
                f"on_nonfinite must be 'stop', 'raise' or 'ignore'; received {self.on_nonfinite!r}."
            )
        if not isinstance(self.warmup, int) or isinstance(self.warmup, bool) or self.warmup < 0:
            raise ConfigurationError(
                f"warmup must be an integer >= 0 (steps); received warmup={self.warmup!r}. Fix: e.g. warmup=10."
            )
        if not isinstance(self.breakdown, bool):
            raise ConfigurationError(
                f"breakdown must be True or False; received breakdown={self.breakdown!r}."
            )
        if not isinstance(self.resume, int) or (not isinstance(self.resume, bool) and self.resume < 0):
            raise ConfigurationError(
                f"resume must be True, False or the step of a checkpoint to restore (an integer >= 0); "
                f"received resume={self.resume!r}."
            )
        if not isinstance(self.max_restarts, int) or isinstance(self.max_restarts, bool) or self.max_restarts < 0:
            raise ConfigurationError(
                f"max_restarts must be an integer >= 0 (heals of a run on worker processes); received "
                f"max_restarts={self.max_restarts!r}. Fix: e.g. max_restarts=3."
            )
        if self.checkpoint_every is not None and (
            not (self.checkpoint_dir or self.max_restarts)  # (a healing run has a folder of its own)
            or not isinstance(self.checkpoint_every, int)
            or isinstance(self.checkpoint_every, bool)
            or self.checkpoint_every < 1
        ):
            raise ConfigurationError(
                f"checkpoint_every needs a positive step count and a checkpoint_dir (or max_restarts, "
                f"which keeps its checkpoints in a temporary folder); received checkpoint_every="
                f"{self.checkpoint_every!r}, checkpoint_dir={self.checkpoint_dir!r}."
            )
        if self.checkpoint_dir is not None:
            self.checkpoint_dir = check_writable_directory(self.checkpoint_dir)
        self.sinks = tuple(self.sinks or ())
        if isinstance(self.tags, str):
            self.tags = (self.tags,)
        self.tags = tuple(str(t) for t in self.tags or ())
        if self.hparams is not None and not isinstance(self.hparams, dict):
            raise ConfigurationError(
                f"hparams must be a dict of name -> value; received hparams={self.hparams!r}. "
                "Fix: e.g. hparams={'lr': 1e-3, 'batch': 128}."
            )
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            raise ConfigurationError(f"name must be a non-empty string; received name={self.name!r}.")

    def for_workers(self) -> dict:
        """The options a launched process trains with (sinks, background and name stay here)."""
        keep = (
            "steps_per_execution",
            "reduce",
            "checkpoint_dir",
            "checkpoint_every",
            "resume",
            "on_nonfinite",
            "warmup",
            "breakdown",
            "max_restarts",  # (a healing run saves at its start: core/run_loop.py)
        )
        return {k: getattr(self, k) for k in keep}


def options_from(steps, options: dict) -> RunOptions:
    unknown = set(options) - {f.name for f in dataclasses.fields(RunOptions)}
    if unknown:
        valid = ", ".join(f.name for f in dataclasses.fields(RunOptions) if f.name != "steps")
        raise ConfigurationError(
            f"train() got unknown option(s) {sorted(unknown)}. Valid options: {valid}, and setup=."
        )
    return RunOptions(steps=steps, **options)
