"""Single-device vs distributed numerics: one computation run twice and compared value by value.

A model is built twice from one `setup(repl)` function: on one device (the reference, stepping
on each global batch) and under N replicas (each stepping on its slice of that batch). The
replicated build starts from the reference's weights (copied, so initialisers and seeds cannot
make them differ) and both read the same batches in the same order. After every step each output
and each variable is compared; for variables every replica's copy is read, because some (plain
batch norm's moving statistics in Keras 3) are kept separately on each replica.

The two builds are `twin.Side`s, shared with the batch-norm report and the loss-scaling check.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from workbench._src.backends.single import NonReplicator
from workbench._src.core.errors import ConfigurationError, StepFunctionError
from workbench._src.core.inputs import InputContext, call_input_fn
from workbench._src.core.tf_setup import tf
from workbench._src.numerics.twin import (
    SetupFn,
    Side,
    check_count,
    check_fingerprints,
    check_same_variables,
    diff,
    fingerprinted,
    make_replicator,
    variable_names,
)


def output_rows(step: int, ref: Any, per_replica: list, reduce: dict[str, str]) -> list[dict]:
    """One row per output leaf: concatenated (batch-shaped) or reduced (mean/sum) comparison."""
    n = len(per_replica)
    ref_leaves = leaves_with_paths(ref)
    replica_leaves = [dict(leaves_with_paths(o)) for o in per_replica]
    rows = []
    for path, value in ref_leaves:
        name = path or "output"
        ref_value = np.asarray(value)
        parts = [np.asarray(leaves[path]) for leaves in replica_leaves]
        row = {"step": step, "kind": "output", "name": name, "shape": tuple(ref_value.shape)}
        if ref_value.ndim and all(
            p.ndim == ref_value.ndim
            and p.shape[0] * n == ref_value.shape[0]
            and p.shape[1:] == ref_value.shape[1:]
            for p in parts
        ):
            # a per-example output: replica r's rows are rows [r*b, (r+1)*b) of the global batch
            size = parts[0].shape[0]
            per = [diff(p, ref_value[r * size : (r + 1) * size])[0] for r, p in enumerate(parts)]
            worst = int(np.argmax(per)) if max(per) > 0 else None
            row.update(how="concatenated", per_replica_max_abs_diff=per, worst_replica=worst)
            row["max_abs_diff"], row["max_rel_diff"] = diff(np.concatenate(parts), ref_value)
        elif all(p.shape == ref_value.shape for p in parts):
            op = reduce.get(name, "mean")
            combined = np.sum(parts, axis=0) if op == "sum" else np.mean(parts, axis=0)
            row.update(how=op, per_replica_max_abs_diff=None, worst_replica=None)
            row["max_abs_diff"], row["max_rel_diff"] = diff(combined, ref_value)
        else:
            row.update(
                how=f"not comparable: replica shapes {[p.shape for p in parts][:3]}",
                per_replica_max_abs_diff=None,
                worst_replica=None,
                max_abs_diff=np.nan,
                max_rel_diff=np.nan,
            )
        rows.append(row)
    return rows


def leaves_with_paths(obj, path: str = "") -> list[tuple[str, Any]]:
    """[("a/0/b", leaf), ...] for nested dicts, lists and tuples, dict keys in sorted order."""
    join = (lambda key: f"{path}/{key}") if path else str
    if isinstance(obj, dict):
        return [leaf for k in sorted(obj) for leaf in leaves_with_paths(obj[k], join(k))]
    if isinstance(obj, (list, tuple)):
        return [leaf for i, v in enumerate(obj) for leaf in leaves_with_paths(v, join(i))]
    return [(path, obj)]


def variable_rows(step: int, ref: Side, dist: Side, names: list[str]) -> list[dict]:
    """One row per variable; every replica's copy is compared with the one-device value."""
    rows = []
    for name, ref_var, var in zip(names, ref.variables, dist.variables):
        ref_value = np.asarray(ref_var.numpy())
        copies = dist.copies(var)
        per = [diff(c, ref_value)[0] for c in copies]
        agree = all(np.array_equal(c, copies[0]) for c in copies[1:])
        worst = int(np.argmax(per))
        rows.append(
            {
                "step": step,
                "kind": "variable",
                "name": name,
                "shape": tuple(ref_value.shape),
                "how": "mirrored" if agree else "per-replica",
                "max_abs_diff": per[worst],
                "max_rel_diff": diff(copies[worst], ref_value)[1],
                # per-replica copies are listed copy by copy; mirrored ones have no worst copy
                "worst_replica": None if agree else worst,
                "per_replica_max_abs_diff": None if agree else per,
            }
        )
    return rows


def layer_step(layer, training: bool) -> Callable:
    def apply_layer(x):
        return {"output": layer(x, training=training)}

    return apply_layer


def array_input(data, global_batch_size: int | None, where: str) -> Callable:
    """input_fn yielding `data` in global batches, in order, repeated."""
    data = np.asarray(data)
    if data.ndim < 1 or not global_batch_size or len(data) < global_batch_size:
        raise ConfigurationError(
            f"{where}(data=...) needs an array with at least one global batch of rows and "
            f"global_batch_size=...; received data of shape {data.shape} and "
            f"global_batch_size={global_batch_size!r}. Example: data=x (shape [1024, 64]), "
            "global_batch_size=256."
        )
    usable = len(data) // global_batch_size * global_batch_size

    def input_fn(ctx):
        return tf().data.Dataset.from_tensor_slices(data[:usable]).batch(global_batch_size).repeat()

    return input_fn


def feature_shape(input_fn: Callable) -> tuple:
    """The per-example shape of input_fn's first element (to build a returned layer)."""
    spec = call_input_fn(input_fn, InputContext(None, 1)).element_spec
    first = tf().nest.flatten(spec)[0]
    return tuple(first.shape[1:])


def compare_numerics(
    setup: SetupFn,
    input_fn: Callable | None = None,
    *,
    replicas: int = 2,
    steps: int = 1,
    backend: str = "mirrored",
    data=None,
    global_batch_size: int | None = None,
    training: bool = True,
    reduce: dict[str, Literal["mean", "sum"]] | None = None,
    plot: str | os.PathLike | None = None,
):
    """Runs the same computation on one device and on N replicas; returns their differences.

    `setup(repl)` is called twice, inside each replicator's context: once for one device, once
    for `replicas` replicas. It builds the model (and optimizer) and returns `step_fn`, or a Keras
    layer to apply to each batch. The replicated copy starts from the one-device weights, and
    both read the same global batches (the replicas split each one along axis 0).

    Args:
      setup: builds the model inside the replicator and returns step_fn or a Keras layer.
      input_fn: yields global batches (as for repl.run); or pass `data` and `global_batch_size`.
      replicas: replica count (or a Replicator to use as the distributed side).
      steps: steps to run and compare.
      backend: backend name for the distributed side.
      data, global_batch_size: an array to feed in order, in global batches, instead of input_fn.
      training: for a returned layer: call it with training=True (or False).
      reduce: how scalar outputs of the replicas are combined before comparing ("mean" default,
        "sum" e.g. for counts). Outputs with a batch dimension are concatenated instead.
      plot: a path to save the differences-over-steps plot to (PNG).

    Returns:
      A pandas DataFrame, one row per step, output and variable: `max_abs_diff`,
      `max_rel_diff` (divided by the largest one-device magnitude), `how` the values were
      matched ("concatenated"/"mean"/"sum" outputs; "mirrored" variables whose copies agree, or
      "per-replica" ones whose copies differ), `worst_replica` and `per_replica_max_abs_diff`
      (every copy, for per-replica variables and per-example outputs).

    Example:
      >>> import workbench as wb, tensorflow as tf, keras, numpy as np
      >>> def setup(repl):
      ...     model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
      ...     opt = repl.wrap_optimizer(keras.optimizers.SGD(0.1))
      ...     def step_fn(x):
      ...         with tf.GradientTape() as tape:
      ...             loss = tf.reduce_mean(model(x) ** 2)
      ...         opt.apply_gradients(zip(tape.gradient(loss, model.weights), model.weights))
      ...         return {"loss": loss}
      ...     return step_fn
      >>> df = wb.compare_numerics(setup, data=np.ones([64, 8], "float32"), global_batch_size=32,
      ...                          replicas=4, steps=3)
      >>> bool(df.max_abs_diff.max() < 1e-5)
      True
    """
    import pandas as pd

    check_count("steps", steps)
    for name, op in (reduce or {}).items():
        if op not in ("mean", "sum"):
            raise ConfigurationError(
                f"reduce[{name!r}] must be 'mean' or 'sum'; received {op!r}. Example: "
                "reduce={'correct': 'sum'} for a count that each replica makes over its own rows."
            )
    if input_fn is None:
        input_fn = array_input(data, global_batch_size, "compare_numerics")
    elif data is not None:
        raise ConfigurationError(
            "compare_numerics takes input_fn or data=..., not both; received both. Fix: drop "
            "data=... (input_fn is used), or drop input_fn to feed the array in global batches."
        )
    dist_repl = make_replicator(replicas, backend)

    ref, dist = Side(NonReplicator(), setup), Side(dist_repl, setup)
    ref_step, dist_step = (_as_step_fn(side, input_fn, training) for side in (ref, dist))
    names = check_same_variables(ref, dist)
    dist.load(ref.values())
    ref_step, dist_step = fingerprinted(ref_step), fingerprinted(dist_step)
    rows = []
    for step in range(1, steps + 1):
        ref_out, dist_out = ref.run(ref_step, input_fn), dist.run(dist_step, input_fn)
        check_fingerprints(ref_out, dist_out, step)
        rows += output_rows(step, ref_out[0]["outputs"], [o["outputs"] for o in dist_out], reduce or {})
        names += variable_names(ref)[len(names) :]  # optimizer slots built on the first step
        rows += variable_rows(step, ref, dist, names)
    table = pd.DataFrame(rows)
    table["worst_replica"] = table["worst_replica"].astype("Int64")  # a replica id or <NA>
    table.attrs.update(replicas=dist_repl.num_replicas, backend=dist_repl.backend, steps=steps)
    if plot is not None:
        plot_numerics(table, plot)
    return table


def _as_step_fn(side: Side, input_fn: Callable, training: bool) -> Callable:
    product = side.product
    if _is_keras_layer(product):
        side.build_layer(feature_shape(input_fn))
        return layer_step(product, training)
    if callable(product):
        return product
    raise StepFunctionError(
        "setup must return step_fn (a function of the batch) or a Keras layer; it returned "
        f"{type(product).__module__}.{type(product).__qualname__}. Fix: end setup with "
        "`return step_fn`."
    )


def _is_keras_layer(obj) -> bool:
    return hasattr(obj, "build") and hasattr(obj, "trainable_weights") and callable(obj)


def plot_numerics(table, path: str | os.PathLike | None = None, *, top: int = 10):
    """Plots max abs difference over steps, one line per output/variable; saves to `path`.

    Args:
      table: what compare_numerics returned.
      path: where to save a PNG; None to only return the figure.
      top: label the `top` largest final differences in the legend (others are drawn grey).

    Returns:
      The matplotlib Figure (displayed inline in a notebook).
    """
    from matplotlib.figure import Figure  # no pyplot: never switches the notebook's backend

    needed = {"step", "kind", "name", "max_abs_diff"}
    if not needed <= set(getattr(table, "columns", ())):
        raise ConfigurationError(
            f"plot_numerics takes the DataFrame that compare_numerics returns (columns {sorted(needed)}); "
            f"received {type(table).__name__} with columns {list(getattr(table, 'columns', []))[:8]}."
        )
    fig = Figure(figsize=(7.5, 4.2))
    ax = fig.subplots()
    groups = list(table.groupby(["kind", "name"], sort=False))
    final = {key: g.max_abs_diff.iloc[-1] for key, g in groups}
    labelled = set(sorted(final, key=lambda k: -np.nan_to_num(final[k]))[:top])
    floor = 1e-12  # log axis: an exact zero is drawn at the floor
    for (kind, name), g in groups:
        style = {"label": f"{kind}: {name}"} if (kind, name) in labelled else {"color": "0.8"}
        ax.plot(
            g.step,
            g.max_abs_diff.clip(lower=floor),
            marker=".",
            linestyle="-" if kind == "output" else "--",
            **style,
        )
    ax.set_yscale("log")
    ax.xaxis.get_major_locator().set_params(integer=True)  # steps are whole numbers
    ax.set_xlabel("step")
    ax.set_ylabel("max |replicated - one device|")
    n = table.attrs.get("replicas", "N")
    ax.set_title(f"{n} replicas vs one device (exact zeros drawn at {floor:g})", fontsize="medium")
    ax.legend(fontsize="x-small", loc="best")
    fig.tight_layout()
    if path is not None:
        fig.savefig(os.fspath(path), dpi=100)
    return fig
