"""Clock readings taken inside the fused loop: where each step's time goes (run.breakdown()).

The fused loop (program.py) reads TensorFlow's clock (`tf.timestamp`, wall seconds) at four
points of every timed step, each ordered by control dependencies:

  begin    before the step asks the iterator for its batch
  ready    once the batch is there
  end      once every local replica's outputs (and, where the loop sums them per step, the
           metric reduction) are computed
  comm     per replica, the seconds spent inside the collectives step_fn issued (the wrapped or
           plain Keras optimizer's gradient all-reduce, repl.all_sum and friends, synchronized
           batch norm): each collective is bracketed by two readings, so the time includes
           waiting for slower peers. The worker's figure is the mean over its local replicas.

A step's readings do not wait for the previous step's end: TensorFlow runs the next iteration's
iterator call while a step finishes, and chaining them cost 13% of a small model's timed
steps. So a step's time runs from the previous step's end to its own: the wait for input is the
part of it before the batch was ready (ready - previous end, at least 0).
compute is then end - ready - comm; the host side (breakdown.py) adds what the graph does not
see (dispatching the call, fetching results, the run loop between chunks) as "other".

The collectives are found by wrapping the current replica context's `all_reduce` and
`all_gather` while step_fn is traced (an attribute on that one context object, set and removed
around the trace): every collective a step issues in tf.distribute's replica context passes
through them, Keras's gradient all-reduce included (keras/src/backend/tensorflow/optimizer.py
calls tf.distribute.get_replica_context().all_reduce). No private TensorFlow name is used.
"""

from __future__ import annotations

from workbench._src.core.tf_setup import tf

MARKS = 4  # per step: begin, ready, end, comm (the loop's float64 row)


def stamp_after(tensors):
    """A clock reading (float64 seconds) taken once every tensor in `tensors` is computed."""
    t = tf()
    deps = [v for v in t.nest.flatten(tensors, expand_composites=True) if isinstance(v, t.Tensor)]
    with t.control_dependencies(deps):
        return t.timestamp()


def after(reading, value):
    """`value` passed through identities that wait for `reading`, so whatever consumes it starts
    after the clock was read (otherwise the collective could start before its first reading)."""
    t = tf()

    def wait(v):
        if isinstance(v, t.Tensor):
            with t.control_dependencies([reading]):
                return t.identity(v)
        return v

    # expand_composites: a distributed batch (PerReplica) or IndexedSlices waits part by part
    return t.nest.map_structure(wait, value, expand_composites=True)


class CollectiveTimer:
    """While step_fn is traced inside a replica: brackets each collective with clock readings.

    `seconds()` is the float64 total of (after - before) over the collectives traced, 0.0 when
    step_fn issued none (one device, or a step without cross-replica work). `bytes`: what the
    traced collectives carry per replica and step, from the tensors' static shapes (the
    gradients, for an optimizer's all-reduce): the scaling forecast's message size.
    """

    WRAPPED = ("all_reduce", "all_gather")

    def __init__(self):
        self.spans: list = []
        self.bytes = 0
        self.context = None

    def __enter__(self):
        context = tf().distribute.get_replica_context()
        if context is None or any(name in vars(context) for name in self.WRAPPED):
            return self  # outside a replica, or already wrapped (a nested timer): leave it
        self.context = context
        for name in self.WRAPPED:
            setattr(context, name, self._timed(getattr(context, name)))
        return self

    def __exit__(self, *exc):
        if self.context is not None:
            for name in self.WRAPPED:
                vars(self.context).pop(name, None)  # the class's own method again
            self.context = None
        return False

    def _timed(self, collective):
        spans = self.spans

        def timed(*args, **kwargs):
            # (reduce_op, value, ...) for all_reduce, (value, axis, ...) for all_gather
            index = 1 if collective.__name__ == "all_reduce" else 0
            args = list(args)
            if len(args) > index:
                before = stamp_after(args[index])
                args[index] = after(before, args[index])
            elif "value" in kwargs:
                before = stamp_after(kwargs["value"])
                kwargs["value"] = after(before, kwargs["value"])
            else:
                return collective(*args, **kwargs)
            self.bytes += _static_bytes(args[index] if len(args) > index else kwargs["value"])
            out = collective(*args, **kwargs)
            spans.append(stamp_after(out) - before)
            return out

        return timed

    def seconds(self):
        t = tf()
        if not self.spans:
            return t.constant(0.0, t.float64)
        return t.add_n(self.spans)


def _static_bytes(value) -> int:
    """Bytes of the tensors in `value` whose shapes are known while tracing (others: 0)."""
    t = tf()
    total = 0
    for v in t.nest.flatten(value, expand_composites=True):
        shape = getattr(v, "shape", None)
        if shape is not None and shape.is_fully_defined() and hasattr(v, "dtype"):
            total += shape.num_elements() * v.dtype.size
    return total
