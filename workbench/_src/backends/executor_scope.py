"""TensorFlow's `context.executor_scope` without the wait it does by accident, for the async-ps
coordinator.

Measured (py-spy on a coordinator whose run had stopped with worker 0 healthy, worker 1's host
cut off): the ClusterCoordinator's thread for worker 0 sat in `Executor.__del__` as it left
`executor_scope` after each closure. The scope keeps the thread's previous executor as a fresh
Python wrapper of the context's *default* executor; deleting that wrapper waits for every node
pending in the default executor, and those include the coordinator's RPCs to the cut-off worker
(a remote-handle release or copy that will not finish until the cut heals: its log line arrived
after the heal). So one silent worker held every worker's closures: the run stalled for as long
as the cut, in about one cut in eight on a loaded machine.

The replacement sets and restores the thread's executor exactly as TensorFlow does and frees the
borrowed wrapper without waiting (a wrapper the context lends owns nothing: TensorFlow's own
deletion of it waits, then frees only the wrapper). Installed once, when an async-ps coordinator
connects; everything else TensorFlow does is unchanged.
"""

from __future__ import annotations

import contextlib

_installed = False


def install() -> None:
    """Replaces `context.executor_scope` (idempotent); a TensorFlow without the pieces it needs is
    left as it is (the stall is then possible again, not an error)."""
    global _installed
    if _installed:
        return
    from tensorflow.python import pywrap_tfe
    from tensorflow.python.eager import context

    get = getattr(pywrap_tfe, "TFE_ContextGetExecutorForThread", None)
    set_ = getattr(pywrap_tfe, "TFE_ContextSetExecutorForThread", None)
    delete = getattr(pywrap_tfe, "TFE_DeleteExecutor", None)
    if get is None or set_ is None or delete is None or not hasattr(context, "executor_scope"):
        return

    @contextlib.contextmanager
    def executor_scope(e):
        ctx = context.context()
        ctx.ensure_initialized()
        handle = ctx._context_handle  # noqa: SLF001 - what TensorFlow's own scope uses
        previous = get(handle)
        try:
            set_(handle, e.handle())
            yield
        finally:
            set_(handle, previous)
            delete(previous)  # the borrowed wrapper only: no wait for the default executor

    executor_scope.__doc__ = context.executor_scope.__doc__
    context.executor_scope = executor_scope
    _installed = True
