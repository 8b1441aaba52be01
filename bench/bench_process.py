"""Process backends on the digits MLP: weak scaling of multi-worker, async-ps 1 vs 2 workers.

Run: python bench/bench_process.py [--steps 3000] [--batch 64] [--threads 1]
     python bench/bench_process.py --cluster ray=local   (Ray-placed vs the local launcher)

Each configuration trains the same MLP 64-128-128-10 (per-worker batch `--batch`, weak scaling:
the global batch grows with the workers) from a fresh local cluster on 127.0.0.1. Every worker
(and parameter server) is limited to `--threads` TensorFlow threads, so on a machine with at
least that many cores per worker the curve shows the backend's overhead, not core sharing. The
anchor is the 1-worker configuration of the same backend, run in the same invocation; the
in-process single-device loop (`repl.train` on wb.NonReplicator) is printed beside it.

Printed per configuration: steps/s, examples/s, weak-scaling efficiency against the 1-worker
point, and start-up time (train() called -> first step recorded: processes, cluster join,
tracing). The machine's core count is printed too: read the efficiencies against it.

Hand-written anchors (issue 17), same model, data, batch and thread limit, in the same run:
  MWMS hand-written  2 local worker processes with TF_CONFIG on 127.0.0.1, each running
                     MultiWorkerMirroredStrategy and `for _ in tf.range(k): strategy.run(...)`
                     in one tf.function (k = --hand-k steps per call);
  PS hand-written    ParameterServerStrategy + ClusterCoordinator in a coordinator process of
                     its own, 2 workers and 1 parameter server as tf.distribute.Server
                     processes, each scheduled closure a fused loop of k steps.
Both are timed after a warm-up call (tracing, cluster join excluded), as the workbench rows
skip their first fifth; printed: workbench / hand-written steps/s (goal >= 1.0).
`--only-hand` skips the workbench rows.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import cloudpickle


def digits_setup(batch: int, threads: int | None):
    """setup(repl) for the process backends: builds the MLP, returns (step_fn, input_fn)."""

    def setup(repl):
        import keras
        import tensorflow as tf
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x, y = (x / 16).astype("float32"), y.astype("int32")
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        optimizer = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))

        def input_fn(ctx):
            # Weak scaling: `batch` per worker, so the global batch grows with the workers.
            global_batch = batch * (ctx.num_replicas if repl.synchronous else 1)
            data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().shuffle(1024, seed=ctx.worker_id)
            return data.batch(global_batch, drop_remainder=True)

        def step_fn(images, labels):
            with tf.GradientTape() as tape:
                # The function form: Keras loss *objects* divide by the replica count under
                # tf.distribute, which wrap_optimizer's convention must not get.
                loss = tf.reduce_mean(
                    keras.losses.sparse_categorical_crossentropy(
                        labels, model(images, training=True), from_logits=True
                    )
                )
            optimizer.minimize(loss, model.trainable_variables, tape=tape)
            return {"loss": loss}

        return step_fn, input_fn

    return setup


def measure(run, started: float) -> dict:
    history = run.history
    first_row_time = run.events_first_metrics_time - started
    steady = history.iloc[len(history) // 5 :]  # skip the start (tracing, warm-up chunks)
    seconds = steady["wall_time"].iloc[-1] - steady["wall_time"].iloc[0]
    steps_per_sec = (len(steady) - 1) / seconds
    examples = float(steady["examples_per_sec"].median())
    return {"steps_per_sec": steps_per_sec, "examples_per_sec": examples, "startup_s": first_row_time}


def timed_train(repl, setup, steps, in_process: bool):
    started = time.monotonic()
    marks = {}

    def first_metrics(event):
        if event.kind == "metrics" and "t" not in marks:
            marks["t"] = time.monotonic()

    if in_process:
        with repl.context():
            step_fn, input_fn = setup(repl)
        run = repl.train(step_fn, input_fn, steps, sinks=[first_metrics])
    else:
        run = repl.train(setup=setup, steps=steps, sinks=[first_metrics])
    run.events_first_metrics_time = marks["t"]
    measured = measure(run, started)
    # What the launcher said of the start (warm pool or fresh processes, and why): a warm start
    # that took long is explained by these lines.
    measured["start_lines"] = [
        e.data.get("text", "")
        for e in run.events
        if e.kind == "message" and ("pool" in e.data.get("text", "") or "ready" in e.data.get("text", ""))
    ]
    return measured


# ----- hand-written anchors ---------------------------------------------------------------
def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x / 16).astype("float32"), y.astype("int32")


def _mlp():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def _limit_threads(threads: int) -> None:
    import tensorflow as tf

    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)


def hand_mwms_worker(args) -> None:
    """One worker of the hand-written MultiWorkerMirroredStrategy loop (TF_CONFIG set by main)."""
    _limit_threads(args.threads)
    import keras
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING
        )
    )
    x, y = _digits()
    workers = strategy.num_replicas_in_sync
    global_batch = args.batch * workers  # weak scaling: `batch` per worker, as the workbench rows
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().shuffle(1024, seed=index)
    iterator = iter(strategy.experimental_distribute_dataset(data.batch(global_batch, drop_remainder=True)))
    with strategy.scope():
        model = _mlp()
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)

    def step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            per_example = keras.losses.sparse_categorical_crossentropy(
                labels, model(images, training=True), from_logits=True
            )
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def fused(iterator, n):
        for _ in tf.range(n):
            strategy.run(step, args=(next(iterator),))

    k = tf.constant(args.hand_k)
    fused(iterator, k)  # trace, join the collective group, warm up
    int(optimizer.iterations.numpy())
    calls = max(1, args.steps // args.hand_k)
    t0 = time.perf_counter()
    for _ in range(calls):
        fused(iterator, k)
    int(optimizer.iterations.numpy())
    seconds = time.perf_counter() - t0
    print(json.dumps({"steps_per_sec": calls * args.hand_k / seconds}), flush=True)


def hand_ps_server(args) -> None:
    """A tf.distribute.Server of the hand-written parameter-server cluster (blocks until killed)."""
    _limit_threads(args.threads)  # as the workbench's server_main does
    import tensorflow as tf

    spec = tf.train.ClusterSpec(json.loads(args.hand_cluster))
    server = tf.distribute.Server(spec, job_name=args.job, task_index=args.index, protocol="grpc", start=True)
    server.join()


def hand_ps_coordinator(args) -> None:
    """ParameterServerStrategy + ClusterCoordinator, closures of k fused steps; prints steps/s."""
    _limit_threads(args.threads)
    import keras
    import tensorflow as tf

    cluster = json.loads(args.hand_cluster)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc"
    )
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    x, y = _digits()
    with strategy.scope():
        model = _mlp()
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)

    def dataset_fn(input_context):
        data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().shuffle(1024, seed=0)
        return data.batch(args.batch, drop_remainder=True)  # `batch` per worker, as the workbench

    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))

    def step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(
                    labels, model(images, training=True), from_logits=True
                )
            )
        optimizer.apply_gradients(
            zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        )

    @tf.function
    def fused(iterator, n):
        for _ in tf.range(n):
            strategy.run(step, args=(next(iterator),))

    k = tf.constant(args.hand_k)
    workers = len(cluster["worker"])
    for _ in range(workers):  # trace, connect, warm up every worker
        coordinator.schedule(fused, args=(iterator, k))
    coordinator.join()
    calls = max(workers, args.steps // args.hand_k)
    t0 = time.perf_counter()
    for _ in range(calls):
        coordinator.schedule(fused, args=(iterator, k))
    coordinator.join()
    seconds = time.perf_counter() - t0
    print(json.dumps({"steps_per_sec": calls * args.hand_k / seconds}), flush=True)


def _free_ports(n: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _spawn(role_args: list[str], env_extra: dict, args):
    import subprocess
    import sys

    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env_extra}
    command = [sys.executable, os.path.abspath(__file__), *role_args, "--threads", str(args.threads)]
    command += ["--batch", str(args.batch), "--steps", str(args.steps), "--hand-k", str(args.hand_k)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)


def _result(process, timeout: float) -> dict:
    out, _ = process.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if process.returncode or not lines:
        raise RuntimeError(f"hand-written anchor failed (exit {process.returncode}): {out[-2000:]}")
    return json.loads(lines[-1])


def _stop(processes) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()


def hand_mwms(args, workers: int = 2) -> dict:
    ports = _free_ports(workers)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    processes = []
    try:
        for i in range(workers):
            tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
            processes.append(_spawn(["--hand-role", "mwms-worker"], {"TF_CONFIG": tf_config}, args))
        results = [_result(p, timeout=600) for p in processes]
        return results[0]  # the chief's; every worker runs the same steps
    finally:
        _stop(processes)


def hand_ps(args, workers: int = 2, num_ps: int = 1) -> dict:
    ports = _free_ports(workers + num_ps + 1)
    cluster = {
        "worker": [f"127.0.0.1:{p}" for p in ports[:workers]],
        "ps": [f"127.0.0.1:{p}" for p in ports[workers : workers + num_ps]],
        "chief": [f"127.0.0.1:{ports[-1]}"],
    }
    spec = json.dumps(cluster)
    servers = []
    try:
        for job, count in (("worker", workers), ("ps", num_ps)):
            for i in range(count):
                role = ["--hand-role", "ps-server", "--job", job, "--index", str(i), "--hand-cluster", spec]
                servers.append(_spawn(role, {}, args))
        coordinator = _spawn(["--hand-role", "ps-coordinator", "--hand-cluster", spec], {}, args)
        servers.append(coordinator)
        return _result(coordinator, timeout=600)
    finally:
        _stop(servers)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3000)  # 600 measured ~2 s: noise-bound
    parser.add_argument("--batch", type=int, default=64, help="per-worker batch")
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow threads per worker/server")
    parser.add_argument("--hand-k", type=int, default=100, help="steps per hand-written fused call")
    parser.add_argument("--only-hand", action="store_true", help="the hand-written anchors only")
    # Internal: the roles of the hand-written anchors' processes.
    parser.add_argument("--hand-role", choices=["mwms-worker", "ps-server", "ps-coordinator"])
    parser.add_argument("--job")
    parser.add_argument("--index", type=int)
    parser.add_argument("--hand-cluster")
    parser.add_argument(
        "--cluster",
        metavar="ray[=ADDRESS]",
        help="compare Ray-placed pools with the local launcher: ray (the cluster this machine "
        "joined), ray=ADDRESS, or ray=local (a Ray instance of this process)",
    )
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    roles = {
        "mwms-worker": hand_mwms_worker,
        "ps-server": hand_ps_server,
        "ps-coordinator": hand_ps_coordinator,
    }
    if args.hand_role:
        roles[args.hand_role](args)
        return
    if args.only_hand:
        print_hand_anchors(args, {})
        return
    import tensorflow as tf

    # This process (the single-device anchor) gets the same
    # thread limit as each worker; set before TensorFlow initialises.
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    import workbench as wb

    wb.configure_devices(cpus=1)
    setup = digits_setup(args.batch, args.threads)
    cloudpickle.register_pickle_by_value(__import__("__main__"))
    print(
        f"machine: {os.cpu_count()} cores; {args.threads} TF thread(s) per process; per-worker batch {args.batch}"
    )
    if args.cluster:
        compare_on_ray(args, setup, wb)
        return

    rows = []
    single = timed_train(wb.NonReplicator(), setup, args.steps, in_process=True)
    rows.append(("single (in process)", 1, single))
    for workers in (1, 2):
        repl = wb.MultiWorkerReplicator(num_workers=workers, threads_per_worker=args.threads)
        rows.append(("multi-worker", workers, timed_train(repl, setup, args.steps, in_process=False)))
    for workers in (1, 2):
        repl = wb.MultiWorkerAsyncReplicator(num_workers=workers, num_ps=1, threads_per_server=args.threads)
        try:
            # The coordinator runs in a launched process (setup travels), as multi-worker's workers.
            rows.append(("async-ps", workers, timed_train(repl, setup, args.steps, in_process=False)))
        finally:
            repl.shutdown()

    base = {name: r for name, w, r in rows if w == 1}
    print(
        f"{'backend':22} {'workers':>7} {'steps/s':>9} {'examples/s':>11} {'efficiency':>10} {'start-up s':>10}"
    )
    for name, workers, r in rows:
        anchor = base[name]["examples_per_sec"]
        efficiency = r["examples_per_sec"] / (anchor * workers)
        print(
            f"{name:22} {workers:>7} {r['steps_per_sec']:>9.1f} {r['examples_per_sec']:>11.0f} "
            f"{efficiency:>10.2f} {r['startup_s']:>10.1f}"
        )
    mw1 = next(r for n, w, r in rows if n == "multi-worker" and w == 1)
    print(
        f"multi-worker x1 / single in process (examples/s): {mw1['examples_per_sec'] / single['examples_per_sec']:.2f}"
    )
    workbench_2 = {name: r["steps_per_sec"] for name, w, r in rows if w == 2}
    print_hand_anchors(args, workbench_2)


def compare_on_ray(args, setup, wb) -> None:
    """--cluster ray[=ADDRESS]: each process backend at 2 workers, its pool started by the local
    launcher and then placed on Ray, in this one invocation. Per row: steady steps/s, the cold
    start (train() called -> first step) and a warm re-run's start (the pool kept)."""
    ray_cluster = wb.RayCluster.from_option(args.cluster)
    backends = {
        "multi-worker": lambda cluster: wb.MultiWorkerReplicator(
            num_workers=2, threads_per_worker=args.threads, cluster=cluster
        ),
        "async-ps": lambda cluster: wb.MultiWorkerAsyncReplicator(
            num_workers=2, num_ps=1, threads_per_server=args.threads, cluster=cluster
        ),
    }
    print(f"{'backend':14} {'placed':7} {'steps/s':>9} {'cold start s':>12} {'warm start s':>12}")
    for name, make in backends.items():
        measured = {}
        for placed, cluster in (("local", None), ("ray", ray_cluster)):
            repl = make(cluster)
            try:
                cold = timed_train(repl, setup, args.steps, in_process=False)
                warm = timed_train(repl, setup, max(args.steps // 5, 100), in_process=False)
            finally:
                repl.shutdown()
            measured[placed] = cold
            print(
                f"{name:14} {placed:7} {cold['steps_per_sec']:>9.1f} {cold['startup_s']:>12.1f} "
                f"{warm['startup_s']:>12.1f}",
                flush=True,
            )
            for line in warm["start_lines"]:
                print(f"{'':23}warm run: {line}", flush=True)
        ratio = measured["ray"]["steps_per_sec"] / measured["local"]["steps_per_sec"]
        print(f"{name:14} Ray-placed / local launcher steps/s: {ratio:.2f} (goal >= 0.95)", flush=True)


def print_hand_anchors(args, workbench: dict) -> None:
    """Runs the two hand-written anchors; prints them beside the workbench's 2-worker rows."""
    print(f"\nhand-written anchors, 2 workers, {args.hand_k} steps per fused call:")
    for name, anchor in (("multi-worker", hand_mwms), ("async-ps", hand_ps)):
        hand = anchor(args)["steps_per_sec"]
        line = f"{name:14} hand-written {hand:8.1f} steps/s"
        if name in workbench:
            line += f"   workbench {workbench[name]:8.1f}   workbench / hand-written {workbench[name] / hand:.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
