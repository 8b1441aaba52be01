"""A lost async-ps worker server of a Ray pool, replaced in its bundle at its address while the
run goes on: the Ray side of what a local coordinator does for its own servers
(placements/local/servers.py), with the same cap per worker per run.

  1. The link (link.py) learns of the worker server's death from Ray's error on its pending
     serve call and hands the member here, on the link's reader thread (nothing here blocks it).
  2. The coordinator hears of it at once, by an actor call carrying "placement_news" (member.py
     `deliver`, read by backends/placed_workers.py): its `workers` column drops and it says the
     loss in one line, with whether a new server comes.
  3. On a thread of its own: when a run is going, the worker has been replaced fewer than
     REPLACEMENTS_PER_WORKER times in it, and its node is alive, a new actor is started in the
     lost one's bundle. Ray keeps a bundle reserved when its actor dies and moves it only when its
     node dies, so the new actor lands on the same node; it starts its TensorFlow server at the
     lost one's port (`start_tf`), which the coordinator's cluster spec holds. TensorFlow's
     ClusterCoordinator reconnects to that address by itself.
  4. Once the server listens, the member is the new actor (its pid, alive again: the pool is whole)
     and the coordinator hears "replaced" (it records the heal in run.restarts). When it cannot be
     (the node is gone, Ray put the bundle elsewhere, the port is taken, no start within
     startup_timeout), the coordinator hears "dropped" with why in one line; the member stays
     dead, so the pool is retired after the run, as before.

Each piece of news is sent until the coordinator has it (or its run is over): one call may time
out (link.SEND_TIMEOUT) while the coordinator holds its interpreter, and news lost that way would
leave the run silent about its lost worker for good. A piece sent twice carries one number, so
the coordinator takes it once (backends/placed_workers.py).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time

from workbench._src.placements.local.servers import REPLACEMENTS_PER_WORKER

# How long one piece of news is tried again while the coordinator does not take it: many times
# its longest interpreter hold (seconds); past that it is frozen, and the launcher's heartbeat
# watch says so.
NEWS_PATIENCE_SECONDS = 60.0
# How often Ray's node table is asked whether the lost worker's node is alive before it is taken
# as unknown (a GCS busy under load may fail one query; an unknown node is tried, not refused).
NODE_QUERIES = 3


class CannotReplace(Exception):
    """Why a new server cannot take the lost one's place (said in the coordinator's line)."""


class ServerReplacer:
    """Replaces the Ray pool's lost async-ps worker servers (see the module's doc).

    `new_actor(bundle_index)` starts a member actor in that bundle of the pool's placement group;
    `servers[(role, index)]` is each server's (cluster spec, threads), as `serve_tf` takes them."""

    def __init__(self, ray, link, new_actor, servers: dict, startup_timeout: float):
        self.ray, self.link, self.new_actor = ray, link, new_actor
        self.servers, self.startup_timeout = servers, startup_timeout
        self.made: dict[tuple, int] = {}  # (run number, worker index) -> replacements started
        self.starting: set = set()  # actors being started now (stop() ends them)
        self.stopping = False
        self._lock = threading.Lock()
        self._news_numbers = itertools.count(1)

    def lost(self, member) -> None:
        """The link saw `member`'s actor die (its reader thread: the work goes to a thread)."""
        run, lost_at, described = self.link.current_run, time.monotonic(), member.exit_description()
        if run is None or self.stopping:
            return  # between runs: the next run finds the member dead and starts a fresh pool
        threading.Thread(
            target=self._replace,
            args=(member, run, lost_at, described),
            name="workbench ray replace",
            daemon=True,
        ).start()

    def _replace(self, member, run, lost_at: float, described: str) -> None:
        why = self._why_not(member, run)
        lost = {"where": member.where, "described": described, "cause": member.death or "its actor ended"}
        self._tell(
            "lost", member, run, **lost, replacing=not why, why=why, address=f"{member.node}:{member.port}"
        )
        if why:
            return
        try:
            actor, where = self._start(member)
        except CannotReplace as error:
            self._tell("dropped", member, run, why=str(error))
            return
        if self.stopping or self.link.current_run != run:  # (the run ended meanwhile: the member
            self._end(actor)  # stays dead, and the pool is retired as before)
            return
        member.replaced_by(actor, where)
        cluster, threads = self.servers[(member.role, member.index)]
        self.link.watch(member.task, actor.serve_tf.remote(cluster, threads))  # its life, as at the start
        process = {"role": member.role, "index": member.index, "node": member.node, "pid": member.pid}
        self._tell("replaced", member, run, seconds=time.monotonic() - lost_at, process=process)

    def _why_not(self, member, run) -> str:
        """'' when the member may be replaced now (counted); else why not, in a few words."""
        with self._lock:
            made = self.made.get((run, member.index), 0)
        if made >= REPLACEMENTS_PER_WORKER:
            return f"it is not replaced again: lost {made + 1} times in this run, something ends it"
        if self._node_alive(member.node_id) is False:
            return f"its node {member.node} is gone (a new server elsewhere would not be at its address)"
        with self._lock:
            self.made[(run, member.index)] = made + 1
        return ""

    def _node_alive(self, node_id: str) -> bool | None:
        """Whether Ray's node table has the node alive; None when the table could not be read
        (then the new actor is tried: `_start` refuses a bundle Ray moved to another node)."""
        for attempt in range(NODE_QUERIES):
            with contextlib.suppress(Exception):
                return any(n.get("NodeID") == node_id and n.get("Alive") for n in self.ray.nodes())
            time.sleep(0.5 * (attempt + 1))
        return None

    def _start(self, member):
        """A new actor in the member's bundle, serving TensorFlow at the member's address."""
        ray = self.ray
        cluster, threads = self.servers[(member.role, member.index)]
        actor = self.new_actor(member.bundle)
        with self._lock:
            self.starting.add(actor)
        try:
            where = ray.get(actor.where.remote(), timeout=self.startup_timeout)
            if where["node_id"] != member.node_id:
                raise CannotReplace(
                    f"Ray placed its bundle on another node ({where['address']}), not at its address "
                    f"{member.node}:{member.port}"
                )
            ray.get(actor.start_tf.remote(cluster, threads, member.port), timeout=self.startup_timeout)
            return actor, where
        except CannotReplace:
            self._end(actor)
            raise
        except ray.exceptions.GetTimeoutError:
            self._end(actor)
            raise CannotReplace(
                f"the new server did not start within startup_timeout={self.startup_timeout:.0f} s"
            ) from None
        except Exception as error:  # noqa: BLE001 - Ray's error around ours (start_tf's port, a death)
            self._end(actor)
            cause = getattr(error, "cause", None) or error  # (RayTaskError carries the actor's own error)
            lines = [line for line in str(cause).strip().splitlines() if line.strip()]
            raise CannotReplace(lines[0][:240] if lines else type(cause).__name__) from None
        finally:
            with self._lock:
                self.starting.discard(actor)

    def _tell(self, kind: str, member, run, **news) -> None:
        """News for the coordinator's run (an actor call, waited for: in order), sent again until
        the coordinator takes it, its run is over or NEWS_PATIENCE_SECONDS have gone by."""
        news = {"kind": kind, "index": member.index, "run": run, "number": next(self._news_numbers), **news}
        deadline = time.monotonic() + NEWS_PATIENCE_SECONDS
        while not self.stopping and self.ray.is_initialized() and self.link.current_run == run:
            if self.link.send(self.link.report_to, {"type": "placement_news", "news": news}):
                return
            if time.monotonic() > deadline or self.link.members[self.link.report_to].dead:
                return
            time.sleep(0.5)

    def _end(self, actor) -> None:
        with contextlib.suppress(Exception):
            if self.ray.is_initialized():
                self.ray.kill(actor, no_restart=True)

    def stop(self) -> None:
        """No replacement from now on; those being started are ended (the pool is stopping)."""
        self.stopping = True
        with self._lock:
            starting = list(self.starting)
        for actor in starting:
            self._end(actor)
