"""Is there room on the Ray cluster for more workers? The cheap probe of an elastic run.

An elastic run (`min_workers`) that goes on with fewer workers asks this at each checkpoint it
saves: it reads what each live node has free now (one call to Ray's GCS, a few milliseconds;
nothing is reserved) and says whether the missing workers' bundles would fit beside the ones
running. Only then does the run stop at a step boundary and start a whole pool again; a probe
that reserved (a trial placement group) would hold resources other jobs may want and wait for
Ray's scheduler each time.

The answer can be stale (a node cut off a moment ago still looks alive and free until Ray's
health checks declare it dead): the grow attempt then fails to place within startup_timeout
and the run goes on with the workers it had (launch/elastic.py backs off its probes after that).
"""

from __future__ import annotations


def room_for(cluster, count: int, busy_nodes: set[str]) -> bool:
    """Whether `count` more bundles of `cluster.resources_per_worker` fit on the live nodes now.
    Under "spread" (one worker per node) only nodes holding none of the running workers
    (`busy_nodes`: node ids) count, one bundle each; under "pack" the free resources together."""
    cluster.connect()  # (ray.init, once per process)
    from ray._private import state  # (a developer API: the per-node free resources `ray status` shows)

    free = state.available_resources_per_node()
    bundle = dict(cluster.resources_per_worker)

    def fits(resources: dict, times: int = 1) -> bool:
        return all(resources.get(k, 0) >= v * times for k, v in bundle.items())

    if cluster.placement == "spread":
        return sum(fits(res) for node, res in free.items() if node not in busy_nodes) >= count
    totals = {k: sum(res.get(k, 0) for res in free.values()) for k in bundle}
    return fits(totals, count)
