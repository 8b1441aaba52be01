"""Does a warm pool's memory stay flat? RSS of every pool process over many warm runs.

Run: python bench/bench_memory.py [--runs 100] [--backends multi-worker,async-ps]
     python bench/bench_memory.py --cluster ray=local   (the same pools as Ray actors)
     python bench/bench_memory.py --memory-growth-limit 0.04   (the pools renewed at 4% growth)

Each backend gets one warm replicator (multi-worker x2; async-ps with 2 workers and 1 parameter
server) that trains a small digits MLP for 20 steps `--runs` times. After runs 10, 25, 50 and the
last, the RSS of every process of the pool is read (psutil, by the pids the run reports; a Ray
actor on this machine is a process here too). Printed, per process: RSS after run 10 and after
the last, and the growth between them (issue 39's goal: within 5%). The anchor is the pool's own
10th run, so start-up and the first traces are not counted as growth. Also printed: the runs
before which the pool was renewed (its `memory_growth_limit`, the replicators' default unless
`--memory-growth-limit` is given) and what a renewal costs in this loop (the run that starts the
new pool, beside the median warm run: back to back, each renewal's next run starts it).

The multi-worker pool gets a second anchor: two processes of TensorFlow alone (a bare
MultiWorkerMirroredStrategy cluster on loopback) train the same model the same number of runs, a
new model and a new tf.function a run. Printed: their growth from run 10 to the last, beside the
pool's, so what TensorFlow itself keeps is told apart from what the workbench adds.

The async-ps parameter server also gets a second anchor: a bare ParameterServerStrategy cluster
(TensorFlow alone, no workbench code: a ps and two worker servers, this bench's child as the
coordinator) trains the same model the same number of runs, a new traced function a run of the
kind the pool's coordinator schedules (a loop of 10 steps that also counts them on the parameter
server, twice a run). Printed: MiB each parameter server gains per run (between renewals for the
pool's) and their ratio, so what TensorFlow itself keeps is told apart from what the workbench
adds.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

CHECKPOINTS = (10, 25, 50)


def digits_setup(repl):
    import keras
    import tensorflow as tf
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16).astype("float32"), y.astype("int32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, "relu"), keras.layers.Dense(10)])
    optimizer = repl.wrap_optimizer(keras.optimizers.Adam(1e-3))

    def input_fn(ctx):
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64, drop_remainder=True)

    def step_fn(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            )
        optimizer.apply_gradients(
            zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        )
        return {"loss": loss}

    return step_fn, input_fn


def rss_by_process(run) -> dict[str, float]:
    """MiB of resident memory of each process of the run's pool, by "role index"."""
    found = {}
    for process in run.processes:
        try:
            found[f"{process['role']} {process['index']}"] = (
                psutil.Process(process["pid"]).memory_info().rss / 2**20
            )
        except psutil.Error:  # (on another node: not readable from here)
            pass
    return found


def measure(wb, backend: str, runs: int, cluster, limit) -> None:
    options = {"num_workers": 2, "cluster": cluster}
    if limit != "default":
        options["memory_growth_limit"] = limit
    repl = (
        wb.MultiWorkerReplicator(**options)
        if backend == "multi-worker"
        else wb.MultiWorkerAsyncReplicator(num_ps=1, **options)
    )
    seen: dict[int, dict[str, float]] = {}
    pids, renewed = None, []
    ps_gains = []  # MiB the parameter server gained over each run after the 10th (same process)
    ps_before = None
    seconds = {}  # run -> its wall time
    try:
        for n in range(1, runs + 1):
            started = time.perf_counter()
            run = repl.train(setup=digits_setup, steps=20)
            seconds[n] = time.perf_counter() - started
            assert run.status == "finished", run.stop_reason
            now = sorted(p["pid"] for p in run.processes)
            if pids not in (None, now):
                renewed.append(n)  # launch/pool.py, memory_growth_limit: new processes
                ps_before = None
            pids = now
            rss = rss_by_process(run)
            if n in CHECKPOINTS or n == runs:
                seen[n] = rss
            if "ps 0" in rss:
                if ps_before is not None and n > CHECKPOINTS[0]:
                    ps_gains.append(rss["ps 0"] - ps_before)
                ps_before = rss["ps 0"]
    finally:
        repl.shutdown()
    where = f" on {cluster}" if cluster else ""
    marks = [n for n in sorted(seen) if n >= CHECKPOINTS[0]]
    print(
        f"{backend}{where}: RSS (MiB) after runs {', '.join(map(str, marks))}; growth from run 10 to {runs}"
    )
    limit_text = f"memory_growth_limit={repl.plan.memory_growth_limit}"
    print(f"  the pool was renewed ({limit_text}) before runs: {renewed or 'none'}")
    if renewed:
        warm = statistics.median(t for n, t in seconds.items() if n > 1 and n not in renewed)
        cold = statistics.median(seconds[n] for n in renewed)
        print(
            f"  a renewal's cost: the run that starts the new pool took {cold:.1f} s (median), "
            f"a warm run {warm:.1f} s; {len(renewed)} renewals added {len(renewed) * (cold - warm):.0f} s "
            f"to {sum(seconds.values()):.0f} s"
        )
    for name in seen[marks[0]]:
        values = [seen[n].get(name, float("nan")) for n in marks]
        growth = 100 * (values[-1] / values[0] - 1)
        print(f"  {name:<14} {' '.join(f'{v:7.1f}' for v in values)}   {growth:+5.1f}%  (goal within 5%)")
    if backend == "multi-worker":
        bare = bare_tensorflow_worker_rss(runs)
        for index, values in enumerate(bare):
            growth = 100 * (values[-1] / values[CHECKPOINTS[0] - 1] - 1)
            print(
                f"  bare MultiWorkerMirroredStrategy worker {index} (TensorFlow alone, the anchor): "
                f"{values[CHECKPOINTS[0] - 1]:.1f} -> {values[-1]:.1f} MiB, {growth:+.1f}% from run 10 to {runs}"
            )
    if ps_gains:
        ours = sum(ps_gains) / len(ps_gains)
        bare = bare_tensorflow_ps_gain(runs)
        print(
            f"  parameter server, MiB gained per run after run 10: the pool's {ours:.2f}; "
            f"a bare ParameterServerStrategy cluster's {bare:.2f} (a traced loop a run, as the pool's); "
            f"ratio {ours / bare:.1f}x"
        )


def bare_tensorflow_ps_gain(runs: int) -> float:
    """MiB per run a bare TensorFlow parameter server gains between its 10th and last run (in a
    child process: connecting to a cluster rewires TensorFlow's context for good)."""
    done = subprocess.run(
        [sys.executable, __file__, "--bare-ps-child", str(runs)],
        capture_output=True, text=True, check=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )  # fmt: skip
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    return (rss[-1] - rss[CHECKPOINTS[0] - 1]) / (runs - CHECKPOINTS[0])


def bare_tensorflow_worker_rss(runs: int) -> list[list[float]]:
    """The multi-worker anchor: two processes of TensorFlow alone, a MultiWorkerMirroredStrategy
    cluster on loopback, each training the digits model `runs` times (a new model and a new
    tf.function a run, 20 steps, then Keras's session cleared, as a warm pool's runs are). Returns
    each worker's RSS (MiB) after every run."""
    from workbench._src.placements.ports import free_ports

    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(2)]}
    logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "--bare-mw-worker", str(runs)],
            stdout=subprocess.PIPE,
            stderr=logs[index],  # (TensorFlow's start-up lines; said only if the worker fails)
            text=True,
            env={
                **os.environ,
                "TF_CPP_MIN_LOG_LEVEL": "3",
                "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
            },
        )
        for index in range(2)
    ]
    found = []
    for worker, log in zip(workers, logs):
        out, _ = worker.communicate()
        if worker.returncode:
            log.seek(0)
            raise RuntimeError(
                f"the bare multi-worker anchor's worker failed (exit {worker.returncode}):\n{log.read()[-3000:]}"
            )
        found.append(json.loads(out.strip().splitlines()[-1]))
    return found


def bare_mw_worker(runs: int) -> None:
    """One worker of the multi-worker anchor (TF_CONFIG names it); prints its RSS after each run."""
    import gc

    import keras
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    me, rss = psutil.Process(), []
    for _ in range(runs):
        with strategy.scope():
            step_fn, input_fn = digits_setup(bare_replicator())
        dataset = strategy.distribute_datasets_from_function(input_fn)
        iterator = iter(dataset)
        step = make_step(tf, strategy, step_fn)
        for _ in range(20):
            step(iterator)
        del step, step_fn, input_fn, dataset, iterator
        keras.backend.clear_session(free_memory=False)
        gc.collect()
        rss.append(me.memory_info().rss / 2**20)
    print(json.dumps(rss), flush=True)


BARE_SERVER = """
import json, sys
import tensorflow as tf
cluster, job, index = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=index, start=True)
print("up", flush=True)
server.join()
"""


def bare_ps_child(runs: int) -> None:
    """The anchor: a ps and two worker servers of TensorFlow's own, this process their
    coordinator; the digits model trained `runs` times, 20 steps each, a new model and a new
    tf.function a run, as a warm pool's runs are: a loop of 10 steps that also counts them in a
    variable on the parameter server, scheduled twice (the pool's coordinator schedules such
    chunks: backends/async_coordinator.py). Prints the server's RSS after each run."""

    from workbench._src.placements.ports import free_ports

    ps, chief, *workers = (f"127.0.0.1:{port}" for port in free_ports(4))
    cluster = {"ps": [ps], "chief": [chief], "worker": workers}
    tasks = [("ps", 0), ("worker", 0), ("worker", 1)]
    servers = [
        subprocess.Popen(
            [sys.executable, "-c", BARE_SERVER, json.dumps(cluster), job, str(index)],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for job, index in tasks
    ]
    try:
        for server in servers:
            server.stdout.readline()
        import gc

        import keras
        import tensorflow as tf

        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc"
        )
        strategy = tf.distribute.ParameterServerStrategy(resolver)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        ps = psutil.Process(servers[0].pid)
        rss = []
        for _ in range(runs):
            with strategy.scope():
                step_fn, input_fn = digits_setup(bare_replicator())
            dataset = coordinator.create_per_worker_dataset(functools.partial(input_fn, None))
            iterator = iter(dataset)

            with strategy.scope():
                counter = tf.Variable(0, dtype=tf.int64, trainable=False)
            chunk = make_chunk(tf, strategy, step_fn, counter)
            for _ in range(2):
                coordinator.schedule(chunk, args=(iterator, tf.constant(10)))
            coordinator.join()
            del chunk, counter, step_fn, input_fn, dataset, iterator
            keras.backend.clear_session(free_memory=False)
            gc.collect()
            rss.append(ps.memory_info().rss / 2**20)
        print(json.dumps(rss), flush=True)
    finally:
        for server in servers:
            server.kill()
            server.wait()


def make_step(tf, strategy, step_fn):
    """A new tf.function for this run's step, as the hand-written coordinator loop has."""

    @tf.function
    def step(iterator):
        return strategy.run(step_fn, args=next(iterator))

    return step


def make_chunk(tf, strategy, step_fn, counter):
    """A new tf.function for this run: `k` steps in a loop, each counted on the parameter server."""

    @tf.function
    def chunk(iterator, k):
        for _ in tf.range(k):
            strategy.run(step_fn, args=next(iterator))
            counter.assign_add(1)

    return chunk


def bare_replicator():
    """digits_setup's `repl` for the bare anchor: TensorFlow's optimizer as it is."""
    return type("Bare", (), {"wrap_optimizer": staticmethod(lambda optimizer: optimizer)})()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--backends", default="multi-worker,async-ps")
    parser.add_argument("--cluster", help="place the pools on Ray: ray, ray=ADDRESS or ray=local")
    parser.add_argument(
        "--memory-growth-limit", type=float,
        help="the replicators' memory_growth_limit (default: theirs; 0 or less: never renewed)",
    )  # fmt: skip
    parser.add_argument("--bare-ps-child", type=int, help=argparse.SUPPRESS)  # (the anchor's process)
    parser.add_argument("--bare-mw-worker", type=int, help=argparse.SUPPRESS)  # (an anchor's worker)
    args = parser.parse_args()
    if args.bare_ps_child:
        bare_ps_child(args.bare_ps_child)
        return
    if args.bare_mw_worker:
        bare_mw_worker(args.bare_mw_worker)
        return
    if args.runs <= CHECKPOINTS[0]:
        parser.error(
            f"--runs must be more than {CHECKPOINTS[0]} (the anchor is run 10); received {args.runs}"
        )
    import workbench as wb

    cluster = wb.RayCluster.from_option(args.cluster) if args.cluster else None
    print(f"load {os.getloadavg()[0]:.1f} at the start")
    limit = "default" if args.memory_growth_limit is None else args.memory_growth_limit
    if limit != "default" and limit <= 0:
        limit = None
    for backend in args.backends.split(","):
        measure(wb, backend.strip(), args.runs, cluster, limit)


if __name__ == "__main__":
    main()
