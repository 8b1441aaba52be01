"""Real clusters: TF_CONFIG, Slurm, a TF_CONFIG-style dict or a resolver -> a cluster resolver."""

from __future__ import annotations

import os

from workbench._src.errors import ConfigurationError
from workbench._src.tf_setup import tf


def cluster_resolver(cluster):
    t = tf()
    resolvers = t.distribute.cluster_resolver
    if isinstance(cluster, resolvers.ClusterResolver):
        return cluster
    if isinstance(cluster, str) and cluster.upper() == "TF_CONFIG":
        if not os.environ.get("TF_CONFIG"):
            raise ConfigurationError(
                "cluster='TF_CONFIG' but the TF_CONFIG environment variable is not set. Fix: export "
                'TF_CONFIG=\'{"cluster": {"worker": ["host1:port", "host2:port"]}, "task": '
                '{"type": "worker", "index": 0}}\' on each host.'
            )
        return resolvers.TFConfigClusterResolver()
    if isinstance(cluster, str) and cluster.lower() == "slurm":
        return resolvers.SlurmClusterResolver()
    if isinstance(cluster, dict) and "cluster" in cluster and "task" in cluster:
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
