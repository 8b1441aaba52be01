"""Real clusters: TF_CONFIG, Slurm, a TF_CONFIG-style dict or a resolver -> a cluster resolver.

TF_CONFIG (the environment variable, or the same structure as a dict) is checked here, so a typo
is one clear error that names TF_CONFIG, shows what was received and an example of a correct one,
instead of a JSONDecodeError or KeyError from inside TensorFlow at the first step.
"""

from __future__ import annotations

import json
import os

from workbench._src.core.errors import ConfigurationError
from workbench._src.core.tf_setup import tf

EXAMPLE = '{"cluster": {"worker": ["host1:12345", "host2:12345"]}, "task": {"type": "worker", "index": 0}}'


def cluster_resolver(cluster):
    """A tf.distribute cluster resolver for `cluster` (see MultiWorkerReplicator's `cluster=`)."""
    t = tf()
    resolvers = t.distribute.cluster_resolver
    if isinstance(cluster, resolvers.ClusterResolver):
        return cluster
    if isinstance(cluster, str) and cluster.upper() == "TF_CONFIG":
        checked_tf_config_env()
        return resolvers.TFConfigClusterResolver()
    if isinstance(cluster, str) and cluster.lower() == "slurm":
        return resolvers.SlurmClusterResolver()
    if isinstance(cluster, dict) and "cluster" in cluster and "task" in cluster:
        check_tf_config(cluster, "the cluster dict")
        task = cluster["task"]
        return resolvers.SimpleClusterResolver(
            t.train.ClusterSpec(cluster["cluster"]),
            task_type=task["type"],
            task_id=int(task["index"]),
            rpc_layer="grpc",
        )
    raise ConfigurationError(
        "cluster must be 'TF_CONFIG', 'slurm', a TF_CONFIG-style dict {'cluster': {...}, 'task': "
        f"{{'type': 'worker', 'index': i}}}}, or a tf.distribute cluster resolver; received {cluster!r:.120}."
    )


def checked_tf_config_env() -> dict:
    """The TF_CONFIG environment variable, parsed and checked (without TensorFlow: `workbench
    run` refuses a wrong one before the seconds of TensorFlow's import)."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        raise ConfigurationError(
            "cluster='TF_CONFIG' but the TF_CONFIG environment variable is not set. Fix: export "
            f"TF_CONFIG='{EXAMPLE}' on each host (its own task index on each)."
        )
    config = parse_tf_config(raw)
    check_tf_config(config, "the TF_CONFIG environment variable")
    return config


def parse_tf_config(raw: str) -> dict:
    """The TF_CONFIG environment variable's JSON, or a ConfigurationError that shows it."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigurationError(
            f"TF_CONFIG is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); received "
            f"TF_CONFIG={raw!r:.300}. Fix: set it to one JSON object with double-quoted keys, e.g. "
            f"TF_CONFIG='{EXAMPLE}' (in a shell, wrap it in single quotes)."
        ) from None


def check_tf_config(config, where: str) -> None:
    """Refuses a TF_CONFIG structure TensorFlow would misread: no cluster, a task not in it..."""

    def refuse(what: str) -> None:
        raise ConfigurationError(
            f"TF_CONFIG ({where}) {what}; received {json.dumps(config, default=repr)[:300]}. Fix: "
            f"describe every task's host:port under 'cluster' and this process under 'task', e.g. {EXAMPLE}."
        )

    if not isinstance(config, dict):
        refuse(f"must be a JSON object, not a {type(config).__name__}")
    cluster = config.get("cluster")
    if not isinstance(cluster, dict) or not cluster:
        refuse("has no 'cluster' object mapping job names to lists of 'host:port' addresses")
    for job, addresses in cluster.items():
        if not isinstance(addresses, (list, tuple, dict)):
            refuse(f"lists job {job!r} as {addresses!r}, not a list of 'host:port' addresses")
        listed = addresses.values() if isinstance(addresses, dict) else addresses
        for address in listed:
            host, _, port = str(address).rpartition(":")
            if not isinstance(address, str) or not host or not port.isdigit():
                refuse(f"has address {address!r} in job {job!r}, which is not 'host:port'")
    task = config.get("task")
    if task is None:
        # TensorFlow allows it (the resolver then names no task), but a process given cluster=
        # is a member of that cluster: without its task it would wait for itself forever.
        refuse("has no 'task' saying which task this process is ({'type': 'worker', 'index': i})")
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        refuse("has a 'task' without both 'type' and 'index'")
    if task["type"] not in cluster:
        refuse(f"has task type {task['type']!r}, which is not a job of its cluster {sorted(cluster)}")
    index = task["index"]
    valid = (
        isinstance(index, int) and not isinstance(index, bool) or isinstance(index, str) and index.isdigit()
    )
    if not valid or not 0 <= int(index) < len(cluster[task["type"]]):
        refuse(
            f"has task index {index!r}, but job {task['type']!r} has {len(cluster[task['type']])} "
            "task(s), numbered from 0"
        )
