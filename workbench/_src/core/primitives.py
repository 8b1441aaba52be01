"""Cross-replica communication primitives, callable anywhere inside step_fn.

All of them are collective: every replica must call them, in the same order, with values of the
same structure and shape. They accept nested structures (dicts, lists, tuples) of tensors and
are differentiable where the underlying tf.distribute operation is (sum, mean, gather).

Definitions (N replicas, replica r holds x_r):
  all_reduce(x, op)   every replica gets op(x_0, ..., x_{N-1}); op in sum, mean, max, min.
  all_sum(x)          all_reduce(x, "sum").
  all_gather(x, axis) every replica gets concat([x_0, ..., x_{N-1}], axis).
  broadcast(x, src)   every replica gets x_src.
  map_gather(fn, x)   parallel map over a value every replica holds the same of: x is cut along
                      axis 0 into N equal shards, replica r computes fn(shard_r), and every
                      replica gets concat([fn(shard_0), ..., fn(shard_{N-1})], axis 0), i.e.
                      fn(x) for a row-wise fn, at 1/N of the work per replica.
  map_reduce(fn, x, op)  the same cut, then op over the shard results instead of concat: e.g.
                      the sum of a loss over a large shared evaluation batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from workbench._src.core.errors import ReplicaContextError
from workbench._src.core.tf_setup import tf

ReduceOp = Literal["sum", "mean", "max", "min"]
_OPS = ("sum", "mean", "max", "min")


def replica_context(strategy, primitive: str):
    """The current replica context, or a clear error when not inside this replicator's step."""
    t = tf()
    ctx = t.distribute.get_replica_context()
    if ctx is None or not t.distribute.has_strategy():
        where = "in cross-replica code" if ctx is None else "outside any replicator"
        raise ReplicaContextError(
            f"repl.{primitive}() was called {where}. Communication primitives only work inside "
            "step_fn while a replicator runs it (repl.run / repl.train / %replicate). Fix: move "
            "the call into step_fn, or reduce the per-replica outputs that repl.run returns."
        )
    if t.distribute.get_strategy() is not strategy:
        raise ReplicaContextError(
            f"repl.{primitive}() was called while a different replicator is running "
            f"({type(t.distribute.get_strategy()).__name__}). Fix: call the primitives of the "
            "replicator that runs this step_fn."
        )
    return ctx


def all_reduce(strategy, x, op: ReduceOp = "sum", name: str = "all_reduce"):
    t = tf()
    if op not in _OPS:
        raise ValueError(f"all_reduce op must be one of {_OPS}; received op={op!r}.")
    ctx = replica_context(strategy, name)
    if op in ("sum", "mean"):
        return ctx.all_reduce(op.upper(), x)
    reduce = t.reduce_max if op == "max" else t.reduce_min

    def one(v):
        v = t.convert_to_tensor(v)
        stacked = ctx.all_gather(v[None], axis=0)  # [N, ...]
        return reduce(stacked, axis=0)

    return t.nest.map_structure(one, x)


def all_gather(strategy, x, axis: int = 0):
    t = tf()
    ctx = replica_context(strategy, "all_gather")

    def one(v):
        v = t.convert_to_tensor(v)
        if v.shape.rank == 0:
            raise ValueError(
                "all_gather concatenates along an axis, so it needs tensors of rank >= 1; "
                f"received a scalar {v}. Fix: all_gather(x[None]) stacks scalars into a vector."
            )
        return ctx.all_gather(v, axis=axis)

    return t.nest.map_structure(one, x)


def broadcast(strategy, x, source: int = 0):
    t = tf()
    n = strategy.num_replicas_in_sync
    if not 0 <= source < n:
        raise ValueError(f"broadcast source must be a replica id in [0, {n}); received {source}.")
    ctx = replica_context(strategy, "broadcast")
    is_source = t.equal(ctx.replica_id_in_sync_group, source)

    def masked(v):
        v = t.convert_to_tensor(v)
        # where, not multiply: a NaN on another replica must not leak into the result.
        return t.where(is_source, v, t.zeros_like(v))

    return ctx.all_reduce("SUM", t.nest.map_structure(masked, x))


def _my_shard(strategy, x, primitive: str):
    t = tf()
    ctx = replica_context(strategy, primitive)
    n = strategy.num_replicas_in_sync
    rid = ctx.replica_id_in_sync_group

    def shard(v):
        v = t.convert_to_tensor(v)
        rows = v.shape[0] if v.shape.rank else None
        if v.shape.rank == 0 or (rows is not None and rows % n):
            raise ValueError(
                f"{primitive} cuts x along axis 0 into {n} equal shards (one per replica); "
                f"received shape {v.shape}. Fix: pad x to a multiple of {n} rows."
            )
        size = t.shape(v)[0] // n
        return v[rid * size : (rid + 1) * size]

    return t.nest.map_structure(shard, x)


def map_gather(strategy, fn: Callable, x):
    return all_gather(strategy, fn(_my_shard(strategy, x, "map_gather")), axis=0)


def map_reduce(strategy, fn: Callable, x, op: ReduceOp = "sum"):
    return all_reduce(strategy, fn(_my_shard(strategy, x, "map_reduce")), op)
