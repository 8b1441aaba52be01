"""`wb.check_loss_scaling`: are the gradients of one N-replica step those of one device?

The check builds the model twice from `setup(repl)` (one device, N replicas; identical weights),
takes a step on the same global batch on each, and records the gradients that step_fn hands to
each optimizer (wrapped by `repl.wrap_optimizer`, or a plain Keras one). The gradient a step
applies is then known exactly: the replicas' mean for a wrapped optimizer, their sum for a plain
one (tf.distribute's convention). Compared with the one-device gradient:
  scale k = <applied, one device> / |one device|^2     (1 when the loss is scaled correctly)
If the applied gradient is not k times the one-device one, a second batch separates the part of
the gradient that depends on the data from a part that does not (regularisation):
  applied = k * one_device + leftover, leftover the same for both batches.
The two numbers, with the optimizer's kind, name the usual mistakes (codes in MISTAKES).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from workbench._src.backends.single import NonReplicator
from workbench._src.core.errors import ConfigurationError, StepFunctionError
from workbench._src.numerics.gradient_recorder import GradientRecorder
from workbench._src.numerics.twin import (
    Side,
    check_fingerprints,
    check_same_variables,
    fingerprinted,
    make_replicator,
    tf_variable,
)

MISTAKES = {
    "none": "the distributed step applies the one-device gradient",
    "mean-loss-with-summing-optimizer": "loss averaged per replica with a plain (summing) Keras optimizer: N times too large",
    "global-batch-loss-with-wrap-optimizer": "loss divided by the global batch with repl.wrap_optimizer: N times too small",
    "regularization-not-scaled": "regularisation added unscaled on every replica with a plain (summing) optimizer: counted N times",
    "regularization-scaled-with-wrap-optimizer": "regularisation divided by the replica count with repl.wrap_optimizer: N times too small",
    "gradient-scale": "the applied gradient is a constant multiple of the one-device gradient other than 1",
    "inconsistent": "the applied gradient differs from one device in a way that depends on the data",
    "no-gradient": "the one-device gradient is zero, so there is nothing to compare",
}
SCALE_RTOL = 1e-2  # how close k must be to 1, N or 1/N
RESIDUAL_RTOL = 1e-3  # a relative leftover below this is float32 rounding


@dataclasses.dataclass
class LossScalingReport:
    """The check's verdict, as text (print it) and as fields (for code and the magic).

    Attributes:
      ok: True when every optimizer applies the one-device gradient.
      mistake: a key of MISTAKES ("none" when ok).
      message: what the check sees, in words.
      fix: what to change.
      gradient_scale: applied / one-device gradient (data part) of the first problem found.
      replicas, global_batch_size: what was compared.
      optimizers: one dict per apply_gradients call in step_fn (kind, scale, leftover, mistake).
      per_variable: a DataFrame: per variable, the scale and max abs difference.
    """

    ok: bool
    mistake: str
    message: str
    fix: str
    gradient_scale: float
    replicas: int
    global_batch_size: int | None
    optimizers: list
    per_variable: object

    def __str__(self) -> str:
        head = "Loss scaling OK" if self.ok else f"Loss scaling MISTAKE ({self.mistake})"
        return f"{head}: {self.message}" + ("" if self.ok else f"\nFix: {self.fix}")

    def _repr_pretty_(self, printer, cycle):  # IPython shows the text, not the dataclass repr
        printer.text(str(self))

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "per_variable"}


def check_loss_scaling(
    setup: Callable, input_fn: Callable, replicas: int = 2, *, backend: str = "mirrored"
) -> LossScalingReport:
    """Compares the gradients of one N-replica step with one device on the global batch.

    Args:
      setup: `setup(repl)` builds the model and optimizer inside the replicator (it is called
        inside `repl.context()`) and returns step_fn. It is called twice (one device, N
        replicas); the N-replica copy gets the one-device weights. Build plain Keras
        optimizers here (`opt.build(model.trainable_variables)`).
      input_fn: yields global batches, the same every time it is called (seed any shuffle).
      replicas: replica count (>= 2), or a Replicator to check under.
      backend: backend name for the distributed side.

    Returns:
      A LossScalingReport; `print(report)` says which mistake it sees and the fix.

    Example:
      >>> import workbench as wb, tensorflow as tf, keras, numpy as np
      >>> x = np.random.RandomState(0).randn(64, 8).astype("float32")
      >>> def input_fn(ctx):
      ...     return tf.data.Dataset.from_tensor_slices(x).repeat().batch(32)
      >>> def setup(repl):
      ...     model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
      ...     opt = keras.optimizers.SGD(0.1)           # plain: sums over replicas
      ...     opt.build(model.trainable_variables)
      ...     def step_fn(x):
      ...         with tf.GradientTape() as tape:
      ...             loss = tf.reduce_mean(model(x) ** 2)  # per-replica mean: the mistake
      ...         grads = tape.gradient(loss, model.trainable_variables)
      ...         opt.apply_gradients(zip(grads, model.trainable_variables))
      ...         return {"loss": loss}
      ...     return step_fn
      >>> wb.check_loss_scaling(setup, input_fn, replicas=4).mistake
      'mean-loss-with-summing-optimizer'
    """

    dist_repl = make_replicator(replicas, backend)
    n = dist_repl.num_replicas
    if n < 2:
        raise ConfigurationError(
            f"check_loss_scaling compares one device with several replicas; received a replicator "
            f"with {n} replica. Fix: replicas=2 or more (e.g. replicas=4)."
        )
    ref, dist = (
        Side(NonReplicator(), setup, "check_loss_scaling(setup)"),
        Side(dist_repl, setup, "check_loss_scaling(setup)"),
    )
    for side in (ref, dist):
        if not callable(side.product):
            raise StepFunctionError(
                f"setup must return step_fn; it returned {type(side.product).__name__}. "
                "Fix: end setup with `return step_fn`."
            )
    names = check_same_variables(ref, dist)
    initial = ref.values()
    recorder = GradientRecorder()
    probes = [fingerprinted(recorder.probe(side.product)) for side in (ref, dist)]
    batches = []
    with recorder:
        for step in (1, 2):  # both probes start from the initial weights
            ref.load(initial)
            dist.load(initial)
            ref_out = ref.run(probes[0], input_fn)
            dist_out = _run_translating(dist, probes[1], input_fn)
            check_fingerprints(ref_out, dist_out, step)
            batches.append((ref_out[0]["outputs"], [o["outputs"] for o in dist_out]))
    calls = probes[0].__wrapped__.calls
    if not calls:
        raise StepFunctionError(
            "step_fn applied no gradients: check_loss_scaling looks at the gradients that step_fn "
            "passes to optimizer.apply_gradients (a Keras optimizer, wrapped or not). Fix: apply "
            "the gradients in step_fn, e.g. `opt.apply_gradients(zip(grads, model.trainable_variables))`."
        )
    return _diagnose(calls, probes[1].__wrapped__.calls, dist.variables, names, batches, n)


def _run_translating(side: Side, step_fn, input_fn):
    try:
        return side.run(step_fn, input_fn)
    except Exception as error:  # noqa: BLE001 - one known TensorFlow message is re-worded
        if "placeholder" in str(error).lower():
            raise ConfigurationError(
                "A plain Keras optimizer was built on its first step inside the replicated step, "
                "which TensorFlow cannot do (its slots must exist before the step is traced). "
                "Fix: in setup, call `optimizer.build(model.trainable_variables)`, or use "
                "repl.wrap_optimizer(optimizer), which builds itself."
            ) from None
        raise


def _diagnose(ref_calls, dist_calls, dist_vars, names, batches, n) -> LossScalingReport:
    import pandas as pd

    index_of = {id(tf_variable(v)): i for i, v in enumerate(dist_vars)}
    global_batch = int(batches[0][0]["batch_size"])
    findings, rows = [], []
    for j, ((kind, opt_name, dist_call_vars), _) in enumerate(zip(dist_calls, ref_calls)):
        factor = 1.0 / n if kind == "wrapped" else 1.0  # what the optimizer does across replicas
        applied, one = [], []
        for ref_out, dist_outs in batches:
            one.append([np.asarray(g, np.float64) for g in ref_out["grads"][j]])
            applied.append(
                [
                    factor * sum(np.asarray(o["grads"][j][i], np.float64) for o in dist_outs)
                    for i in range(len(dist_call_vars))
                ]
            )
        finding = _analyse([_flat(a) for a in applied], [_flat(o) for o in one], n, kind)
        finding.update(index=j, kind=kind, optimizer=opt_name)
        findings.append(finding)
        for i, var in enumerate(dist_call_vars):
            k = index_of.get(id(tf_variable(var)))
            a, o = applied[0][i], one[0][i]
            rows.append(
                {
                    "optimizer": j,
                    "kind": kind,
                    "variable": names[k]
                    if k is not None and k < len(names)
                    else getattr(var, "path", var.name),
                    "scale": float(np.vdot(a, o) / max(np.vdot(o, o), 1e-300)),
                    "max_abs_diff": float(np.max(np.abs(a - o))) if a.size else 0.0,
                }
            )
    problem = next((f for f in findings if f["mistake"] != "none"), findings[0])
    message, fix = _words(problem, n, global_batch)
    if problem["mistake"] != "none" and len(findings) > 1:
        message = f"Optimizer #{problem['index']} ({problem['optimizer']}, {problem['kind']}): {message}"
    return LossScalingReport(
        ok=problem["mistake"] == "none",
        mistake=problem["mistake"],
        message=message,
        fix=fix,
        gradient_scale=problem["scale"],
        replicas=n,
        global_batch_size=global_batch,
        optimizers=findings,
        per_variable=pd.DataFrame(rows),
    )


def _analyse(applied: list[np.ndarray], one: list[np.ndarray], n: int, kind: str) -> dict:
    """Scale k and data-independent leftover of applied vs one-device gradients (two batches)."""
    a1, o1 = applied[0], one[0]
    norm = float(np.linalg.norm(o1))
    if norm == 0.0:
        return {"scale": float("nan"), "leftover": 0.0, "residual": 0.0, "mistake": "no-gradient"}
    k = float(np.vdot(a1, o1) / norm**2)
    residual = float(np.linalg.norm(a1 - k * o1) / max(np.linalg.norm(a1), 1e-300))
    leftover, consistent = 0.0, True
    if residual > RESIDUAL_RTOL:
        a2, o2 = applied[1], one[1]
        d_one, d_applied = o1 - o2, a1 - a2
        if np.linalg.norm(d_one) <= 1e-3 * norm:  # the same batch twice: cannot separate the parts
            consistent = False
        else:
            k = float(np.vdot(d_applied, d_one) / np.vdot(d_one, d_one))
            e1, e2 = a1 - k * o1, a2 - k * o2
            leftover = float(np.linalg.norm(e1) / norm)
            consistent = bool(np.linalg.norm(e1 - e2) <= 0.05 * np.linalg.norm(e1))
    return {
        "scale": k,
        "leftover": leftover,
        "residual": residual,
        "mistake": _classify(k, leftover, consistent, n, kind),
    }


def _near(k: float, target: float) -> bool:
    return abs(k / target - 1.0) <= SCALE_RTOL


def _classify(k: float, leftover: float, consistent: bool, n: int, kind: str) -> str:
    if not consistent:
        return "inconsistent"
    if _near(k, 1.0):
        if leftover <= RESIDUAL_RTOL:
            return "none"
        return "regularization-not-scaled" if kind == "plain" else "regularization-scaled-with-wrap-optimizer"
    if _near(k, n) and kind == "plain":
        return "mean-loss-with-summing-optimizer"
    if _near(k, 1.0 / n) and kind == "wrapped":
        return "global-batch-loss-with-wrap-optimizer"
    return "gradient-scale"


def _words(finding: dict, n: int, global_batch: int | None) -> tuple[str, str]:
    """(what the check sees, the fix) for a finding, in words."""
    kind, k, leftover, mistake = finding["kind"], finding["scale"], finding["leftover"], finding["mistake"]
    gb = global_batch or "GLOBAL_BATCH"
    also = (
        " A batch-independent part of the gradient (regularisation) is also scaled differently from the "
        "data part; run the check again after this fix."
        if leftover > RESIDUAL_RTOL
        else ""
    )
    if mistake == "none":
        return (
            f"the {n}-replica step applies the one-device gradient on the global batch (scale {k:.6f}).",
            "",
        )
    if mistake == "no-gradient":
        return (
            "the one-device gradient is exactly zero on this batch, so the scale cannot be measured.",
            "Check with data that gives a non-zero gradient.",
        )
    if mistake == "inconsistent":
        return (
            "the applied gradient is not a constant multiple of the one-device gradient (relative residual "
            f"{finding['residual']:.3g}), and the difference depends on the data. Usual causes: per-replica "
            "statistics (plain BatchNormalization), randomness that differs per replica (dropout), or a loss "
            "normalised by a per-replica count.",
            "Use wb.CrossReplicaBatchNorm (or BatchNormalization(synchronized=True)) instead of plain batch norm; "
            "normalise by global counts (`repl.all_sum(count)`); check without dropout. Then run the check again.",
        )
    if mistake == "regularization-not-scaled":
        return (
            "the data part of the gradient matches one device, but a part that does not depend on the batch "
            f"(regularisation, e.g. sum(model.losses)) does not: a plain Keras optimizer adds up the {n} replicas' "
            f"gradients, so a term added unscaled on every replica counts {n} times.",
            "Scale it: `loss += tf.nn.scale_regularization_loss(sum(model.losses))` (divides by the replica count), "
            "or use repl.wrap_optimizer(optimizer) with the loss written as on one device.",
        )
    if mistake == "regularization-scaled-with-wrap-optimizer":
        return (
            "the data part of the gradient matches one device, but a part that does not depend on the batch "
            "(regularisation) does not: repl.wrap_optimizer averages over replicas, so regularisation is added as "
            f"on one device; dividing it by the replica count (tf.nn.scale_regularization_loss) makes it {n} times too small.",
            "Add it unscaled: `loss += sum(model.losses)`.",
        )
    if mistake == "mean-loss-with-summing-optimizer":
        return (
            f"the applied gradient is {k:.4g} times (N={n}) the one-device gradient. step_fn averages its loss "
            f"over its own batch, and the plain Keras {finding['optimizer']} adds up the replicas' gradients "
            f"(tf.distribute's convention).{also}",
            f"Wrap the optimizer: `opt = repl.wrap_optimizer(keras.optimizers.{finding['optimizer']}(...))` and keep "
            "the mean loss; or keep the plain optimizer and divide by the global batch: `loss = "
            f"tf.nn.compute_average_loss(per_example_loss, global_batch_size={gb})` (and "
            "`tf.nn.scale_regularization_loss(...)` for regularisation).",
        )
    if mistake == "global-batch-loss-with-wrap-optimizer":
        return (
            f"the applied gradient is {k:.4g} times (1/N, N={n}) the one-device gradient. step_fn divides its loss "
            "by the global batch, and repl.wrap_optimizer averages over the replicas as well: N is divided out "
            "twice. Usual causes: tf.nn.compute_average_loss, or a keras.losses.Loss object such as "
            "keras.losses.BinaryCrossentropy() or SparseCategoricalCrossentropy(), which under tf.distribute "
            f"divides its mean by the replica count itself (Keras 3).{also}",
            "With repl.wrap_optimizer, write the loss as on one device: `loss = tf.reduce_mean(per_example_loss)` "
            "with the function form of a Keras loss (e.g. `keras.losses.binary_crossentropy(y, logits, "
            "from_logits=True)`), plus unscaled regularisation. Or use a plain optimizer with "
            "tf.nn.compute_average_loss.",
        )
    return (
        f"the applied gradient is {k:.4g} times the one-device gradient ({kind} optimizer, {n} replicas).{also}",
        "With repl.wrap_optimizer the loss is the mean over the replica's own batch; with a plain Keras optimizer "
        f"it is the sum over the replica's batch divided by the global batch ({gb}). Do not all-reduce gradients "
        "yourself before apply_gradients, and do not multiply the loss by the replica count.",
    )


def _flat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([a.ravel() for a in arrays]) if arrays else np.zeros(0)
