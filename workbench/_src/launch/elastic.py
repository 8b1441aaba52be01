"""Elastic worker counts for sync runs: `MultiWorkerReplicator(num_workers=4, min_workers=2)`.

When the cluster has no room for a whole pool (the Ray placement raises `CapacityError`: a node
gone and no other with room), the launch is tried again with one worker fewer, never below
`min_workers`: at the start of a run, and when a heal (launch/heal.py) cannot replace a lost
member. At each checkpoint a run on fewer workers probes for room (plan.room_to_grow: what the
nodes have free, no reservation); when there is, every member is asked to save and stop at the
next step boundary (the preemption path), and the run goes on from there on a whole pool. A
grow is not a heal: it uses none of `max_restarts`.

Why the data and the weights stay the same: the global batch is the run's, not the workers'.
Under PER_WORKER input (the default) every worker's pipeline yields the global batch and
tf.distribute keeps each worker's share, so step k's batch is the same whatever the count (each
worker takes a larger share when there are fewer). Exact resume's fast-forward (core/resume.py)
skips whole steps' batches before the split, so it is the same on any count too. A PER_REPLICA
input_fn sees `ctx.num_replicas` change: it stays exact only when it shards by it and batches
the global batch over it (`ds.shard(ctx.num_replicas, ctx.replica_id).batch(GLOBAL //
ctx.num_replicas)`: step k's replicas then take the examples k*GLOBAL .. (k+1)*GLOBAL - 1 between
them on any count); a fixed per-replica batch changes the global batch. That is said once, when
the count first changes. The global batch must divide by every count of replicas the run may
have (a split that does not divide is an error of the worker, not healed).
"""

from __future__ import annotations

from workbench._src.core.errors import CapacityError, ConfigurationError
from workbench._src.core.inputs import InputReplication

PER_REPLICA_NOTE = (
    "the worker count changed and input_fn runs PER_REPLICA: each step sees the same data only if "
    "input_fn shards by ctx.num_replicas and batches the global batch over it "
    "(ds.shard(ctx.num_replicas, ctx.replica_id).batch(GLOBAL // ctx.num_replicas)); a fixed "
    "per-replica batch makes the global batch change with the count"
)


class Elastic:
    """The worker count of one launched run: the plan of the next launch, when to shrink, when
    to grow back."""

    def __init__(self, plan, run, opts, replicator=None):
        self.full = plan
        self.plan = plan  # the plan of the next launch
        self.minimum = getattr(plan, "min_workers", None) or plan.num_workers
        self.run = run
        self.per_replica = getattr(replicator, "input_replication", None) is InputReplication.PER_REPLICA
        self.noted = False
        self.growing = False  # the running attempt was asked to stop so the run can grow back
        self.regrowing = False  # the next launch is a grow: no room for it means the probe was wrong
        self.probes_to_skip = 0  # checkpoints without a probe, after a grow that found no room
        self.backoff = 1
        if self.enabled and not opts.max_restarts:
            raise ConfigurationError(
                f"min_workers={self.minimum} lets a run go on with fewer workers when it heals, and "
                f"this run has max_restarts=0, so it never heals. Fix: repl.train(..., max_restarts=3) "
                "(--max-restarts 3), or leave min_workers out."
            )

    @property
    def enabled(self) -> bool:
        return self.minimum < self.full.num_workers

    @property
    def workers(self) -> int:
        return self.plan.num_workers

    def shrink(self, error: BaseException) -> bool:
        """After a launch failed for want of room: True when the next launch has one worker
        fewer (said in the run), False when the run may not shrink further."""
        if not (self.enabled and isinstance(error, CapacityError) and self.workers > self.minimum):
            return False
        if self.regrowing:
            self.grow_failed()
        self.plan = self.full.with_workers(self.workers - 1)
        self.growing = self.regrowing = False
        first = str(error).split(";")[0]
        self._say(
            f"{first}: going on with {self.workers} of {self.full.num_workers} workers "
            f"(min_workers={self.minimum}), the same global batch over fewer workers"
        )
        return True

    def at_checkpoint(self, pool, ask_to_stop) -> None:
        """Called as a checkpoint of the running attempt arrives: on fewer workers than asked,
        probe for room; when there is, `ask_to_stop(cause)` makes every member save and stop at
        the next step boundary (the launcher then starts the whole pool: `grow`)."""
        self.regrowing = False  # (this attempt's pool was placed)
        if self.growing or self.workers >= self.full.num_workers or self.run.stop_requested:
            return
        if self.probes_to_skip:
            self.probes_to_skip -= 1
            return
        busy = {getattr(m, "node_id", None) for m in pool.group.children} - {None}
        try:
            room = self.full.room_to_grow(self.full.num_workers - self.workers, busy)
        except Exception:  # noqa: BLE001 - a probe that cannot be answered is no room
            room = False
        if room:
            self.growing = True
            ask_to_stop(f"room for {self.full.num_workers} workers again: growing back")

    def grow(self) -> None:
        """The next launch is the whole pool again."""
        was = self.workers
        self.plan, self.growing, self.regrowing = self.full, False, True
        self._say(f"growing back from {was} to {self.full.num_workers} workers")

    def grow_failed(self) -> None:
        """A grow found no room after all (the probe's view was stale): probe less often."""
        self.probes_to_skip, self.backoff = self.backoff, min(self.backoff * 2, 16)

    def _say(self, text: str) -> None:
        self.run.publish("message", text=text)
        if self.per_replica and not self.noted:
            self.noted = True
            self.run.publish("message", text=PER_REPLICA_NOTE)
