"""wb.RayCluster: where a process backend's pool runs when it is placed on a Ray cluster.

    ray_cluster = wb.RayCluster(address="auto", resources_per_worker={"CPU": 2}, placement="spread")
    repl = wb.MultiWorkerReplicator(num_workers=4, cluster=ray_cluster)

A RayCluster only describes: it connects (ray.init) when a pool is first placed on it, and the
pool (placements/ray/pool.py) makes the placement group and the actors. Ray is an optional extra
(`pip install -e ".[ray]"`), imported here only when a cluster is used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

from workbench._src.core.errors import ConfigurationError
from workbench._src.core.owned_folders import owned_folder
from workbench._src.launch.start_progress import say
from workbench._src.placements.proc import end_processes, pids_naming, process_tree

PLACEMENTS = {"spread": "STRICT_SPREAD", "pack": "PACK"}
# The logical CPUs of a local Ray instance (address=None), at least: it stands for this machine,
# so it must hold as many members as a local pool would start (Ray's CPUs are scheduling units,
# not cores). Raise it with the largest pool a notebook makes.
LOCAL_CPUS = 8
_NOT_BY_US = object()
_connected_to = _NOT_BY_US  # the address this process's ray.init was given by a RayCluster
RAY_EXTRA_FIX = 'Fix: pip install -e ".[ray]" (Ray 2.60) on this machine and on every node.'


class RayCluster:
    """A Ray cluster to place a process backend's workers, parameter servers and coordinator on.

    Args:
      address: "auto" (the cluster this machine belongs to: `ray start` ran here), "ray://HOST:10001"
        (Ray Client), "HOST:6379" (a head node's GCS), or None: start a local Ray instance owned by
        this process (ended with it), with at least 8 logical CPUs, as many processes as the local
        launcher would start.
      resources_per_worker: the Ray resources of each process of the pool (a bundle of the
        placement group), e.g. {"CPU": 2, "GPU": 1}.
      placement: "spread", one process per node (Ray's STRICT_SPREAD: the cluster needs as many
        nodes as processes); or "pack", fill nodes (PACK).
      runtime_env: a Ray runtime_env for the actors (e.g. {"pip": [...]}), when the nodes lack a
        package the cells use. The workbench itself must be installed on every node.

    Example:
      >>> import workbench as wb
      >>> wb.RayCluster(address="auto", resources_per_worker={"CPU": 2}, placement="pack")
      RayCluster(address='auto', resources_per_worker={'CPU': 2}, placement='pack')
    """

    def __init__(
        self,
        address: str | None = "auto",
        resources_per_worker: dict | None = None,
        placement: str = "spread",
        runtime_env: dict | None = None,
    ):
        if address is not None and (not isinstance(address, str) or not address.strip()):
            raise ConfigurationError(
                f"RayCluster(address=...) takes 'auto', 'ray://HOST:10001', 'HOST:6379' or None (start a "
                f"local Ray instance); received {address!r}."
            )
        if placement not in PLACEMENTS:
            raise ConfigurationError(
                f"RayCluster(placement=...) is 'spread' (one process per node) or 'pack' (fill nodes); "
                f"received {placement!r}."
            )
        resources = dict(resources_per_worker or {"CPU": 1})
        for name, amount in resources.items():
            if (
                not isinstance(name, str)
                or isinstance(amount, bool)
                or not isinstance(amount, (int, float))
                or amount < 0
            ):
                raise ConfigurationError(
                    "RayCluster(resources_per_worker=...) maps Ray resource names to amounts, e.g. "
                    f"{{'CPU': 2, 'GPU': 1}}; received {resources_per_worker!r}."
                )
        self.address = address.strip() if isinstance(address, str) else None
        self.resources_per_worker = resources
        self.placement = placement
        self.runtime_env = runtime_env
        self.local_root: str | None = None  # a local instance's own temp root, once it is started
        self.local_owner = None  # the thread a local instance is started on and tied to (instance_owner.py)

    @classmethod
    def from_option(cls, text: str) -> RayCluster:
        """`--cluster ray` (the cluster this machine belongs to), `--cluster ray=ADDRESS`, or
        `--cluster ray=local` (a local Ray instance, processes packed on it): the magic's and the
        CLI's form. Other settings (resources, placement) need a wb.RayCluster."""
        name, _, address = text.partition("=")
        if name.strip() != "ray":
            raise ConfigurationError(
                f"--cluster takes ray, ray=ADDRESS (e.g. ray=ray://head:10001) or ray=local; received {text!r}."
            )
        address = address.strip() or "auto"
        if address == "local":  # one node: "spread" could place one process only
            return cls(address=None, placement="pack")
        return cls(address=address)

    # ----- identity: a warm pool is kept for plans on the same cluster ------------------------------
    def key(self) -> tuple:
        return (
            self.address,
            tuple(sorted(self.resources_per_worker.items())),
            self.placement,
            repr(self.runtime_env),
        )

    def __eq__(self, other) -> bool:
        return isinstance(other, RayCluster) and other.key() == self.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        return (
            f"RayCluster(address={self.address!r}, resources_per_worker={self.resources_per_worker!r}, "
            f"placement={self.placement!r})"
        )

    # ----- the connection ------------------------------------------------------------------------
    def connect(self):
        """ray, initialized for this cluster (once per process); a clear error when it cannot be."""
        global _connected_to
        from workbench._src.core import exit as process_exit

        if "ray" not in sys.modules:  # (seconds on a loaded machine: said first)
            say("importing Ray, to start a local Ray instance" if self.address is None else "importing Ray")
        ray = import_ray()
        if ray.is_initialized():
            process_exit.run_first()  # (the pools stop before Ray's exit hooks end the actors)
            if _connected_to is not _NOT_BY_US and _connected_to != self.address:
                raise ConfigurationError(
                    f"This process is connected to the Ray cluster at address={_connected_to!r}; a process "
                    f"talks to one Ray cluster, and this RayCluster names address={self.address!r}. Fix: "
                    "use the same address, or restart the kernel to switch clusters."
                )
            return ray
        # Ray's driver answers SIGTERM with a stack trace on stderr (its C++ failure handler) and
        # a slow teardown; a kernel being shut down gets SIGTERM when its exit takes more than a
        # few seconds. Keep this process's own SIGTERM behaviour: Ray ends what it started anyway
        # (its reaper for a local instance; the cluster, for the actors of a driver that died).
        main_thread = threading.current_thread() is threading.main_thread()
        sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
        ray_tmpdir = os.environ.get("RAY_TMPDIR")
        if self.address is None:
            os.environ["RAY_TMPDIR"] = self.local_root = _private_ray_root(ray)
        try:
            local = {"num_cpus": max(os.cpu_count() or 1, LOCAL_CPUS)} if self.address is None else {}
            init = dict(
                address=self.address,
                **local,
                runtime_env=self.runtime_env,
                logging_level=logging.ERROR,  # (not Ray's start-up lines, red in a notebook)
                log_to_driver=False,  # the actors' output stays in Ray's logs; errors come as messages
                include_dashboard=False if self.address is None else None,
                configure_logging=True,
            )
            if self.address is None:
                from workbench._src.placements.ray.local_start import start_local

                self.local_owner = start_local(ray, init, self.local_root)
            else:
                say(f"connecting to the Ray cluster at {self.address}")
                ray.init(**init)
        except ConnectionError as error:
            raise ConfigurationError(
                f"No Ray cluster answers at address={self.address!r}: {error}. Fix: start one "
                "(`ray start --head` on the head node, `ray start --address=HEAD:6379` on the others), "
                "pass its address, or RayCluster(address=None) for a local Ray instance."
            ) from None
        finally:
            if main_thread and sigterm is not None:
                signal.signal(signal.SIGTERM, sigterm)
            if ray_tmpdir is None:  # (the instance's processes have it; nothing started later needs it)
                os.environ.pop("RAY_TMPDIR", None)
            else:
                os.environ["RAY_TMPDIR"] = ray_tmpdir
        _connected_to = self.address
        process_exit.run_first()  # ray.init registered Ray's exit hooks: the pools stop before them
        return ray

    def shutdown(self) -> None:
        """Disconnects from the cluster; a local instance this process started ends with nothing
        of it left (its agents too, by pid), as at exit. Pools on it should be shut down first."""
        if "ray" not in sys.modules:
            return
        import ray

        if self.local_root is not None and os.path.isdir(self.local_root):
            end_local_instance(ray, self.local_root)
        else:
            ray.shutdown()
        if self.local_owner is not None:  # (after the instance: its processes die with the thread)
            self.local_owner.release()
            self.local_owner = None

    def nodes(self) -> list[dict]:
        """The cluster's live nodes: address, CPUs and GPUs, and which is the head (the panel)."""
        ray = self.connect()
        return [
            {
                "address": node["NodeManagerAddress"],
                "cpus": node.get("Resources", {}).get("CPU", 0),
                "gpus": node.get("Resources", {}).get("GPU", 0),
                "head": "node:__internal_head__" in node.get("Resources", {}),
            }
            for node in ray.nodes()
            if node.get("Alive")
        ]

    def describe(self) -> str:
        """One line: the cluster's nodes and what it has free."""
        ray = self.connect()
        nodes = self.nodes()
        free = ray.available_resources()
        total = ray.cluster_resources()
        return (
            f"Ray cluster at {self.address or 'a local instance'}: {len(nodes)} node(s) "
            f"({', '.join(n['address'] for n in nodes)}), CPU {free.get('CPU', 0):g} free of "
            f"{total.get('CPU', 0):g}, GPU {free.get('GPU', 0):g} free of {total.get('GPU', 0):g}"
        )


# The longest socket path Ray makes under our root (the largest pid Linux gives, pid_max 2**22), and
# the longest path a Unix socket takes (sun_path's 108 bytes, less the final NUL): measured, a TMPDIR
# of 21 characters gave a 108-byte plasma_store path and ray.init failed.
LONGEST_RAY_SOCKET_SUFFIX = (
    "/wbray-4194304-abcdefgh/ray/session_2026-11-24_14-22-35_201344_4194304/sockets/plasma_store"
)
MAX_SOCKET_PATH = 107


def _private_ray_root(ray) -> str:
    """A folder of its own for the local Ray instance this process starts (its sessions, logs and
    sockets; RAY_TMPDIR), removed at exit once Ray is shut down. In TMPDIR when Ray's Unix socket
    paths inside fit in their 107 bytes, else in /tmp. Also keeps the instance from taking over the
    machine's /tmp/ray (another cluster's address file is there). The roots of killed kernels
    (nbval and JupyterLab kill kernels that do not stop at once: no exit hook ran) go first."""
    base = tempfile.gettempdir()
    base = base if len(base) + len(LONGEST_RAY_SOCKET_SUFFIX) <= MAX_SOCKET_PATH else "/tmp"
    root = owned_folder("wbray-", base)

    from workbench._src.core import exit as process_exit

    process_exit.on_exit("ray", lambda: end_local_instance(ray, root))  # (after the pools': they talk to Ray)
    return root


def end_local_instance(ray, root: str) -> None:
    """Shuts down the local Ray instance living in `root` and leaves nothing of it: ray.shutdown()
    ends the processes Ray started (GCS, raylet), but the raylet's agents (ray::DashboardAgent,
    ray::RuntimeEnvAgent) only notice their raylet is gone tens of seconds later, and they have
    retitled themselves, so their command lines no longer name the root: they are found as the
    instance's descendants before it is shut down, and ended by pid after a short grace."""
    instance = process_tree(pids_naming(root))
    with contextlib.suppress(Exception):
        ray.shutdown()  # (Ray's own exit hook may come later: shutting down twice is harmless)
    end_processes(instance, grace=2.0)
    # ray.shutdown() returns before every process of the instance has ended, and one still
    # writing its last log line recreates folders: remove until it stays removed (<= 2 s).
    for _ in range(10):
        shutil.rmtree(root, ignore_errors=True)
        time.sleep(0.2)
        if not os.path.exists(root):
            return


def import_ray():
    """Ray, or a ConfigurationError saying how to install it (an optional extra)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network call home from a notebook
    # Ray starts a new local instance when one of its calls finds no connection (auto-connect).
    # A pool's poll thread or send after the user's ray.shutdown() would start one in the
    # machine's /tmp/ray, tied by Ray's fate-sharing to that short-lived thread: its GCS dies with
    # the thread, and a minute later Ray ends this whole process for the lost GCS (the likely way
    # a -n 3 suite run lost a test process). The workbench always connects explicitly (connect()).
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")  # (read when Ray is imported)
    try:
        import ray
    except ImportError:
        raise ConfigurationError(
            f"Placing workers on a Ray cluster needs Ray, which is not installed. {RAY_EXTRA_FIX}"
        ) from None
    return ray
