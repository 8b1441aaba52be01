"""Every use of a private TensorFlow, Keras, Ray or CPython name, in one place.

Each entry says what it reaches into, the version it was checked on, why no public API does it,
and when it can go. An upgrade that breaks one breaks it here, with the reason next to it. The
suite's import check (tests/test_layers.py) fails on a private use anywhere else.

Checked on TensorFlow 2.21.0, Keras 3.15.1, Ray 2.60.0, CPython 3.11.7.
"""

from __future__ import annotations

import ctypes
import os
import sys
import weakref


def keep_forever(obj) -> None:
    """CPython: adds a reference that is never released, so the object's destructor never runs,
    not even at interpreter finalization. Why: deleting a tf.data iterator resource at exit waits
    for tf.data's threads (20-40 s measured); nothing public leaks an object on purpose. Remove
    when TensorFlow's iterator deletion stops blocking (core/reaper.py)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def run_weakref_finalizers() -> None:
    """CPython: runs the weakref.finalize callbacks registered for exit (temporary folders...)
    now, before an os._exit that would skip them. `weakref.finalize._exitfunc` is what atexit
    calls; there is no public name for it. Remove with the reaper's early exit."""
    weakref.finalize._exitfunc()


def remove_autograph_files() -> None:
    """TensorFlow: removes the `__autograph_generated_file*.py` files AutoGraph wrote to the temp
    folder, as its own exit hooks would (pyct/loader.py registers one atexit hook per file and
    keeps each module in sys.modules under the file's name). Why: the reaper's early exit
    (os._exit) skips those hooks, and AutoGraph has no public clean-up. Checked on 2.21. Remove
    with the reaper's early exit."""
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name.startswith("__autograph_generated_file") and path:
            try:
                os.remove(path)
            except OSError:  # gone already, or not ours to remove
                pass


def thread_frame(thread):
    """CPython: the frame a live thread is running now, or None. `sys._current_frames` is
    documented (for debugging) but underscored; faulthandler only writes to a file. Why: a stuck
    dashboard renderer is reported with its stack (sinks/dashboard.py). Stays while CPython has
    no public name for it."""
    return sys._current_frames().get(thread.ident)


def owned_iterator_class():
    """TensorFlow: the class of tf.data's Python iterators (`OwnedIterator`), or None when
    TensorFlow is not imported or moved it. Why: the reaper must find iterators nobody tracks (a
    user's own); tf.data exports no iterator base class. Remove with the reaper's early exit."""
    iterator_ops = sys.modules.get("tensorflow.python.data.ops.iterator_ops")
    return getattr(iterator_ops, "OwnedIterator", None)


def iterator_resource_handles(iterators) -> list:
    """TensorFlow: the resource-handle tensors that keep the C++ iterators of tf.data iterator
    objects alive (an `OwnedIterator`'s `_iterator_resource`; a distributed iterator's
    multi-device and per-device ones), found by walking the attributes of objects whose class
    names an iterator. Why: the reaper holds them while it collects, so the last reference is
    dropped on its own thread even when a traced graph in a reference cycle also captures one
    (core/reaper.py); tf.data exposes no iterator's handle publicly. Checked on 2.21: a
    two-device DistributedIterator gives 3, a plain OwnedIterator 1. Remove with the reaper."""
    import collections

    found, seen = [], set()
    todo = collections.deque((obj, 0) for obj in iterators)
    while todo:
        obj, depth = todo.popleft()
        if id(obj) in seen or depth > 8:
            continue
        seen.add(id(obj))
        kind = type(obj)
        if kind.__name__ == "EagerTensor":
            if getattr(obj.dtype, "name", None) == "resource":
                found.append(obj)
            continue
        if kind in (list, tuple):
            children = obj
        elif kind is dict:
            children = obj.values()
        elif "Iterator" in kind.__name__ and hasattr(obj, "__dict__"):
            children = vars(obj).values()
        else:
            continue
        todo.extend((child, depth + 1) for child in children)
    return found


def custom_gradient_names() -> set[str]:
    """The gradient functions `tf.custom_gradient` has registered so far. In graph mode (a traced
    step) every call registers one, `CustomGradient-<uid>`, in TensorFlow's global gradient
    registry and never removes it (TF 2.21); each holds its graph's tensors, so the whole traced
    graph stays in memory for good. `ReplicaContext.all_reduce` is such a call: every traced step
    that all-reduces gradients (wrap_optimizer's) kept its graphs (5-9 MiB a run measured)."""
    from tensorflow.python.framework import ops

    return {name for name in ops._gradient_registry._registry if name.startswith("CustomGradient-")}


def forget_custom_gradients(names) -> None:
    """Removes `names` (from custom_gradient_names) from the gradient registry: only for graphs
    whose tracing is over. A gradient function is looked up while its graph is being traced (the
    tape's gradient inside the step), never when the traced function runs."""
    from tensorflow.python.framework import ops

    registry = ops._gradient_registry._registry
    for name in names:
        registry.pop(name, None)


def is_composite_tensor(value) -> bool:
    """TensorFlow: a composite tensor (SparseTensor, RaggedTensor, a distributed value) carries a
    `_type_spec`; `tf.__internal__.CompositeTensor` is no more public. Checked on 2.21."""
    return hasattr(value, "_type_spec")


def keras_clip_gradients(optimizer, grads):
    """Keras 3: the optimizer's own clipping (clipnorm, clipvalue, global_clipnorm), applied to
    the cross-replica mean so that clipping acts as on one device (core/optimizer.py). Keras
    applies it only inside apply(); there is no public clip function. Checked on 3.15.1."""
    return optimizer._clip_gradients(grads)


def keras_optimizer_variables(optimizer):
    """Keras 3: the variables an optimizer was built for (apply() without trainable_variables
    uses them). No public attribute; checked on 3.15.1."""
    return optimizer._trainable_variables


def checkpoint_children(checkpoint) -> dict:
    """TensorFlow: what a tf.train.Checkpoint was built with, by name. No public accessor; checked
    on 2.21. Remove if tf.train.Checkpoint gains one."""
    return dict(checkpoint._trackable_children())


def keras_apply_owner():
    """Keras 3: the class on Optimizer's MRO that defines `apply` (the TensorFlow backend's base,
    where gradients are summed over replicas), and that method. The loss-scaling check
    (numerics/gradient_recorder.py) patches it there for the duration of one `with` block: a
    plain optimizer is the user's own object, reached only through step_fn's closure, so the
    class is the one place every plain Keras optimizer passes through. Checked on 3.15.1."""
    import keras

    owner = next(c for c in keras.optimizers.Optimizer.__mro__ if "apply" in c.__dict__)
    return owner, owner.__dict__["apply"]


def set_coordination_heartbeat_timeout(cluster_spec, seconds: float) -> None:
    """TensorFlow: configures the coordination service as MultiWorkerMirroredStrategy would
    (tensorflow/python/distribute/collective_all_reduce_strategy.py: standalone, led by
    `multi_worker_util.coordination_leader`, the chief and worker jobs), with `seconds` of
    silence before a task is declared failed. Call it before the strategy is built: the strategy
    configures the service only where none is configured yet.

    Why: the strategy leaves the service's default, 10 s, and no public API changes it. On a
    2-core machine at load 25-65 a worker whose heartbeat thread got no CPU for 10 s was declared
    failed and every collective of the run aborted, with every process alive. Checked on 2.21.0.
    Remove when the strategy takes the timeout (its constructor has no such argument)."""
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    jobs = cluster_spec.as_dict()
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(cluster_spec),
        heartbeat_timeout_in_ms=int(seconds * 1000),
        coordinated_jobs=[
            coordination_config_pb2.CoordinatedJob(name=job, num_tasks=len(jobs[job]))
            for job in ("chief", "worker")
            if job in jobs
        ],
    )


_executor_scope_replaced = False


def replace_executor_scope_with_one_that_does_not_wait() -> None:
    """TensorFlow: replaces `context.executor_scope` (tensorflow/python/eager/context.py) with one
    that sets and restores the thread's executor as TensorFlow's does, and frees the wrapper of
    the thread's previous executor without waiting. Idempotent; called when an async-ps
    coordinator connects (backends/async_ps.py).

    Why: TensorFlow's scope keeps the previous executor as a fresh Python wrapper of the context's
    *default* executor, and deleting it (`Executor.__del__`) waits for every node pending there.
    The ClusterCoordinator leaves that scope after each closure, so worker 0's thread waited on
    an RPC to a cut-off worker 1 (a remote-handle release that finished only after the cut
    healed; py-spy showed the wait): the whole run stalled with worker 0 healthy. A wrapper the
    context lends owns nothing (`TFE_DeleteExecutor` frees only the wrapper). No public API
    changes the scope. Checked on 2.21.0. Remove when TensorFlow's scope stops waiting."""
    global _executor_scope_replaced
    if _executor_scope_replaced:
        return
    import contextlib

    from tensorflow.python import pywrap_tfe
    from tensorflow.python.eager import context

    get = pywrap_tfe.TFE_ContextGetExecutorForThread
    set_ = pywrap_tfe.TFE_ContextSetExecutorForThread
    delete = pywrap_tfe.TFE_DeleteExecutor

    @contextlib.contextmanager
    def executor_scope(e):
        ctx = context.context()
        ctx.ensure_initialized()
        handle = ctx._context_handle  # what TensorFlow's own scope passes
        previous = get(handle)
        try:
            set_(handle, e.handle())
            yield
        finally:
            set_(handle, previous)
            delete(previous)  # the borrowed wrapper only: no wait for the default executor

    executor_scope.__doc__ = context.executor_scope.__doc__
    context.executor_scope = executor_scope
    _executor_scope_replaced = True


def checkpoint_object_graph(reader):
    """TensorFlow: the object graph a tf.train.Checkpoint saved (its `TrackableObjectGraph`
    proto, read from the checkpoint's reserved `_CHECKPOINTABLE_OBJECT_GRAPH` entry). Why: the
    names of what a checkpoint holds (its "model", "optimizer", "step" and their children) are
    only in this proto; `tf.train.list_variables` gives the variables' paths, not the objects.
    Checked on TensorFlow 2.21.0. Remove when TensorFlow offers the graph publicly."""
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    return graph


def dataset_graph_def(dataset):
    """TensorFlow: the GraphDef of a tf.data pipeline (`Dataset._as_serialized_graph`), its maps'
    functions included, or None where it cannot be serialized. Why: a resumed run fast-forwards
    its input (core/resume.py) and must say when the pipeline is not deterministic (an unseeded
    shuffle, Python code); tf.data exposes its graph only through this private method. Checked
    on 2.21. Stays while tf.data has no public pipeline description."""
    import tensorflow as tf

    try:
        serialized = dataset._as_serialized_graph(
            external_state_policy=tf.data.experimental.ExternalStatePolicy.IGNORE
        )
        return tf.compat.v1.GraphDef.FromString(serialized.numpy())
    except Exception:  # noqa: BLE001 - an unusual pipeline: nothing is said about it
        return None


def checkpoint_tensors_by_key(checkpoint) -> dict | None:
    """TensorFlow: what `checkpoint.write` would save, as {checkpoint key: tensor}, the object
    graph proto under its reserved key included (`TrackableSaver._gather_serialized_tensors`), or
    None where the save needs more than one plain tensor per key (partitioned variables, a
    registered saver, a Python state callback). Why: `Checkpoint.write` writes every save into a
    `<prefix>_temp/` folder and merges it (a mkdir, a merge, a delete: 4-6 ms of a 5-6 ms save of
    a small model here); one SaveV2 op over the same keys writes the same files in 0.3-1.5 ms,
    and a run that checkpoints every 100 steps pays that on its training thread. Call it inside
    a tf.function (the reads are then ops of that function). Checked on TensorFlow 2.21.0. Remove
    if tf.train.Checkpoint gains a single-shard (unmerged) write."""
    import tensorflow as tf
    from tensorflow.python.training.saving.saveable_object import SaveSpec

    serialized, feed_additions, registered_savers, _ = checkpoint._saver._gather_serialized_tensors(None)
    if feed_additions or registered_savers:
        return None
    by_key = {}
    for tensors in serialized.values():
        for key, tensor in tensors.items():
            if isinstance(tensor, dict):  # {slice spec: tensor}: a partitioned variable
                if list(tensor) != [""]:
                    return None
                tensor = tensor[""]
            if isinstance(tensor, SaveSpec):  # a variable's deferred read (tensor_callable.Callable)
                with tf.device(tensor.device):
                    tensor = tensor.tensor
            if tensor is None:  # in the object graph, with no value to save
                continue
            if not isinstance(tensor, tf.Tensor):
                return None
            by_key[key] = tensor
    return by_key


def ray_start_internals(ray) -> tuple:
    """Ray: the three private parts a local instance's start replaces for the length of its own
    ray.init (placements/ray/local_start.py, decision 37): `services` (its `get_node` is the node
    query that Node's fixed 30-s loop asks, its `start_raylet` where the raylet is started),
    `RayParams` (its `update_pre_selected_port` is where the agents' ports are filled in) and
    `ray_constants` (its `ENABLE_RAY_CLUSTER` off keeps 127.0.0.1 the node's address, so every
    server binds loopback). No public API sets how long a start waits for its node or where a
    single-machine instance listens. Remove when Ray does."""
    private = ray._private
    return private.services, private.parameter.RayParams, private.ray_constants


def ray_write_port_files(session_dir: str, node_id: str, ports: dict) -> None:
    """Ray: writes the port files a starting raylet waits for (`ray._raylet.persist_port`, the
    writer Ray's agents use; `ports` maps each file's name, e.g. "metrics_export_port", to its
    port), for a local instance whose agents' ports were chosen before its start
    (placements/ray/local_start.py, decision 37). No public API says a port to the raylet; where
    Ray has no such writer, nothing is written (the raylet then waits for its agent as Ray has it)."""
    try:
        from ray._raylet import persist_port
    except ImportError:
        return
    for name, port in ports.items():
        persist_port(session_dir, node_id, name, int(port))


def ray_connect_state_accessor(ray) -> None:
    """Ray: connects now the GCS state accessor that Ray otherwise connects on first use
    (`ray.nodes()`, `available_resources_per_node()`), so that its I/O thread starts in the
    calling thread's network namespace: a local instance's start connects it inside the
    instance's private network (placements/ray/instance_owner.py, decision 38). Ray has no public
    call for it; where Ray renamed it, nothing is done and Ray connects it on first use."""
    state = getattr(getattr(ray, "_private", None), "state", None)
    connect = getattr(getattr(state, "state", None), "_connect_and_get_accessor", None)
    if connect is not None:
        connect()
