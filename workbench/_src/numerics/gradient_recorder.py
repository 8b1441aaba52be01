"""Recording the gradients that step_fn hands to its optimizers, for the loss-scaling check.

While a GradientRecorder is active (a `with` block), two methods are patched: the wrapper's
`ReplicatedOptimizer.apply_gradients` (which averages over replicas) and Keras's
`Optimizer.apply` (which sums over replicas under tf.distribute). A probed step_fn returns, next
to its own outputs, the gradients it passed to each, so they come out of the compiled step as
ordinary per-replica outputs. Nothing is patched outside the block.
"""

from __future__ import annotations

import functools
import threading

from workbench._src import compat
from workbench._src.core.optimizer import ReplicatedOptimizer
from workbench._src.core.tf_setup import tf


class GradientRecorder:
    """While active, notes what step_fn passes to every Keras or wrapped optimizer.

    Patches two methods for the duration of the check only: the wrapper's apply_gradients
    (mean over replicas) and Keras's Optimizer.apply (plain: sum over replicas). A wrapped
    optimizer's own inner Keras call is not noted twice. Notes are kept per thread, because
    MirroredStrategy traces each replica's step in its own thread.
    """

    def __init__(self):
        self._notes: dict[int, list] = {}
        self._inner = threading.local()
        self._patched: list = []

    def probe(self, step_fn):
        """step_fn whose outputs also carry the gradients it applied (to be read after the step)."""
        recorder = self

        @functools.wraps(step_fn)
        def probed(*args, **kwargs):
            tid = threading.get_ident()
            recorder._notes[tid] = []
            outputs = step_fn(*args, **kwargs)
            notes = recorder._notes.pop(tid, [])
            probed.calls = [(kind, opt, [v for _, v in pairs]) for kind, opt, pairs in notes]
            grads = [[g for g, _ in pairs] for _, _, pairs in notes]
            first = (tf().nest.flatten((args, kwargs)) or [None])[0]
            rows = (
                tf().shape(first)[0] if getattr(first, "shape", None) is not None and first.shape.rank else 1
            )
            return {"outputs": {} if outputs is None else outputs, "grads": grads, "batch_size": rows}

        probed.calls = []
        return probed

    def _note(self, kind: str, optimizer, grads_and_vars) -> None:
        notes = self._notes.get(threading.get_ident())
        if notes is None:
            return  # another thread's training, not the probe
        t = tf()
        pairs = [(t.convert_to_tensor(g), v) for g, v in grads_and_vars if g is not None]
        notes.append((kind, type(getattr(optimizer, "optimizer", optimizer)).__name__, pairs))

    def __enter__(self):

        recorder = self
        wrapped_original = ReplicatedOptimizer.apply_gradients
        owner, keras_original = compat.keras_apply_owner()

        def wrapped_apply_gradients(opt, grads_and_vars):
            grads_and_vars = list(grads_and_vars)
            recorder._note("wrapped", opt, grads_and_vars)
            recorder._inner.depth = getattr(recorder._inner, "depth", 0) + 1
            try:
                return wrapped_original(opt, grads_and_vars)
            finally:
                recorder._inner.depth -= 1

        def keras_apply(opt, grads, trainable_variables=None):
            grads = list(grads)  # may be a one-shot iterator: read it once, pass the list on
            if trainable_variables is not None:
                trainable_variables = list(trainable_variables)
            if not getattr(recorder._inner, "depth", 0):
                variables = (
                    trainable_variables
                    if trainable_variables is not None
                    else compat.keras_optimizer_variables(opt)
                )
                recorder._note("plain", opt, list(zip(grads, variables)))
            return keras_original(opt, grads, trainable_variables)

        ReplicatedOptimizer.apply_gradients = wrapped_apply_gradients
        owner.apply = keras_apply
        self._patched = [
            (ReplicatedOptimizer, "apply_gradients", wrapped_original),
            (owner, "apply", keras_original),
        ]
        return self

    def __exit__(self, *exc):
        for cls, name, original in self._patched:
            setattr(cls, name, original)
        self._patched = []
