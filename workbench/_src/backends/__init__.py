"""Backends by name (`wb.replicator("mirrored", num_replicas=4)`): see registry.py."""

from workbench._src.core.registry import BACKENDS, BackendSpec, backend_class, replicator, spec

__all__ = ["BACKENDS", "BackendSpec", "backend_class", "replicator", "spec"]
