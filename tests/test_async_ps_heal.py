"""A lost async-ps worker is replaced while the others go on: real servers, a real SIGKILL.

On local processes the coordinator (a process the launcher starts) starts a new worker server at
the lost one's address; on Ray the launcher starts a new actor in the lost one's bundle, serving
at the same address (placements/ray/replace.py). Either way TensorFlow's ClusterCoordinator
reconnects to it there. What is asserted is what happened: the `workers` column's drop and rise,
the steps recorded, the heal in run.restarts, and CPU time the new server spent on the run's
steps. Each check looks only at the processes the run started (run.processes); on a local Ray
instance an actor is a process of this machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
import traceback

import pytest
from helpers import RUN_WAIT, placement_under_test, process_pid, regression_setup, wait_for_steps

import workbench as wb
from workbench._src.placements.local import netns
from workbench._src.placements.local.servers import REPLACEMENTS_PER_WORKER
from workbench._src.placements.proc import process_cpu_seconds

pytestmark = pytest.mark.usefixtures("no_orphans")


@pytest.fixture(scope="module", params=["local", "ray"])
def placement(request):
    """Each test that takes it runs once with local processes and once with Ray actors."""
    yield from placement_under_test(request.param)


def _wait_until(condition, run, timeout=120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and run.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert condition(), (
        f"run at step {run.steps}: {run.status} {run.stop_reason}; said: {_messages(run)}; "
        f"restarts: {run.restarts}; the placement's threads: {_placement_threads()}"
    )


def _placement_threads() -> dict:
    """Where this process's Ray replacement threads are (what a run that says nothing waits for)."""
    frames = sys._current_frames()
    return {
        t.name: "".join(traceback.format_stack(frames[t.ident])[-4:])
        for t in threading.enumerate()
        if t.name.startswith("workbench ray") and t.ident in frames
    }


# How each placement names a SIGKILLed server's end: a local server's exit status, or Ray's
# report of its actor's process (not this process's child: no exit status here).
KILLED = {"local": "killed by SIGKILL", "ray": "its process ended unexpectedly (killed or crashed)"}


@pytest.mark.slow
def test_a_killed_async_ps_worker_is_replaced_while_the_other_goes_on(placement):
    repl = wb.MultiWorkerAsyncReplicator(**placement.options(num_workers=2, num_ps=1))
    run = repl.train(setup=regression_setup, steps=10**6, steps_per_execution=5, background=True)
    try:
        wait_for_steps(run, 100)
        killed = process_pid(run, "worker", 1)
        os.kill(killed, signal.SIGKILL)
        rows_at_kill = run.steps
        # The replacement answers, TensorFlow's coordinator schedules on it again.
        _wait_until(lambda: run.restarts, run)
        new = next(
            p["pid"]
            for p in run.processes
            if p["role"] == "worker" and p["index"] == 1 and p["pid"] != killed
        )
        survivor = process_pid(run, "worker", 0)
        # (TensorFlow's coordinator takes a moment to give it chunks again: measured past that)
        wait_for_steps(run, run.steps + 100)
        cpu_at_join = {pid: process_cpu_seconds(pid) for pid in (new, survivor)}
        rows_at_join = run.steps
        _wait_until(lambda: run.steps >= rows_at_join + 300, run)
        cpu_spent = {pid: process_cpu_seconds(pid) - cpu_at_join[pid] for pid in (new, survivor)}
    finally:
        run.stop()
        run.wait(timeout=60)
    assert run.status == "stopped", run.stop_reason
    history = run.history
    assert list(history["step"]) == list(range(1, run.steps + 1))  # every step once
    workers = list(history["workers"])
    assert workers[:rows_at_kill] == [2] * rows_at_kill
    # Dropped once the loss was seen, up again once the new server answered, and 2 to the end. A
    # local replacement can answer before the next row is recorded (a fork in ~0.1 s on a quiet
    # machine): then no row ran on one worker, and none says 1.
    (heal,) = run.restarts
    dropped = workers.index(1) if 1 in workers else None
    if dropped is None:
        assert placement.name == "local" and set(workers) == {2}, workers
        dropped = heal["lost_at"]
    else:
        if placement.name == "local":
            # The column is read as each chunk's rows are recorded, after the chunk's check of the
            # servers: it drops no later than the coordinator hears of the loss. (Not compared
            # with rows_at_kill: the coordinator is another process, whose rows the notebook's
            # trail on a loaded machine; CI saw the drop 350 rows past the 245 it had at the kill.)
            assert rows_at_kill <= dropped <= heal["lost_at"], (rows_at_kill, dropped, heal)
        rose = workers.index(2, dropped)
        assert set(workers[dropped:rose]) == {1} and set(workers[rose:]) == {2}
    cause = KILLED[placement.name]
    assert heal["member"] == "worker 1" and heal["cause"] == cause and heal["replaced"], heal
    # (lost_at: the step at which the coordinator heard of the loss, the row where `workers` dropped)
    assert rows_at_kill <= heal["lost_at"] <= dropped + 1 and heal["step"] >= heal["lost_at"], (heal, dropped)
    assert heal["seconds"] > 0
    texts = [e.data.get("text", "") for e in run.events if e.kind == "message"]
    assert any(f"worker 1 lost ({cause})" in t and "replaced at step" in t for t in texts), texts
    restart_events = [e for e in run.events if e.kind == "restart"]
    assert len(restart_events) == 1 and restart_events[0].data["run_step"] >= heal["lost_at"]
    # The new server trains: over the same 300 steps it spent a fair part of the CPU time that the
    # surviving worker spent (0.7-1.2 of it, measured; a ratio, which a loaded machine does not
    # move as it moves seconds: the absolute 0.05 s this replaced once saw 0.04 under -n 2).
    assert cpu_spent[new] > 0.25 * cpu_spent[survivor] > 0, (new, survivor, cpu_spent)
    assert run.executed_steps >= run.steps  # at-least-once: the lost chunks ran again
    # The pool is whole again, so the next run finds it warm: the same coordinator, the new worker.
    again = repl.train(setup=regression_setup, steps=20)
    assert again.status == "finished", again.stop_reason
    assert process_pid(again, "coordinator", 0) == process_pid(run, "coordinator", 0)
    assert new in {p["pid"] for p in again.processes} and killed not in {p["pid"] for p in again.processes}


@pytest.mark.slow
def test_every_worker_killed_is_replaced_until_they_keep_dying_then_the_run_fails_with_its_history():
    run = wb.MultiWorkerAsyncReplicator(num_workers=2, num_ps=1).train(
        setup=regression_setup, steps=10**7, steps_per_execution=5, background=True
    )
    killed: set[int] = set()

    def kill_every_worker_of_the_run() -> None:
        for p in list(run.processes):  # (a replacement joins the list once it answers)
            if p["role"] == "worker" and p["pid"] not in killed:
                killed.add(p["pid"])
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p["pid"], signal.SIGKILL)

    try:
        wait_for_steps(run, 50)
        kill_every_worker_of_the_run()  # both at once: both replaced, the run goes on
        _wait_until(lambda: len(run.restarts) == 2, run)
        rows = run.steps
        _wait_until(lambda: run.steps >= rows + 50, run)
        # Then every new worker is killed as soon as it answers: past REPLACEMENTS_PER_WORKER
        # losses each, none is replaced and the run fails (a crash loop is said, not looped).
        deadline = time.monotonic() + 120
        while run.running and time.monotonic() < deadline:
            kill_every_worker_of_the_run()
            time.sleep(0.05)
        with pytest.raises(
            wb.WorkerError, match=r"every async-ps worker has died .* none could be replaced"
        ) as info:
            run.wait(timeout=60)
    finally:
        run.stop()
    assert info.value.run is run and run.status == "failed"
    assert len(run.restarts) == 2 * REPLACEMENTS_PER_WORKER
    assert {r["member"] for r in run.restarts} == {"worker 0", "worker 1"}
    assert list(run.history["step"]) == list(range(1, run.steps + 1))  # the history up to the failure
    texts = [e.data.get("text", "") for e in run.events if e.kind == "message"]
    assert any("it is not replaced again" in t for t in texts)


def _messages(run) -> list[str]:
    return [e.data.get("text", "") for e in run.events if e.kind == "message"]


def _socket_in_network_of(pid: int) -> socket.socket:
    """A TCP socket made in the network namespace of process `pid`: a `ray=local` instance runs in
    a private network of its own (placements/ray/instance_owner.py), so a port is taken from the
    test only inside it. Made on a short thread that joins that network; the socket stays there."""
    if os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net"):
        return socket.socket()
    net_fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    made: dict = {}

    def make() -> None:
        try:
            netns.enter_network_of_this_thread(net_fd)
            made["socket"] = socket.socket()
        except OSError as error:
            made["error"] = error

    try:
        maker = threading.Thread(target=make)
        maker.start()
        maker.join()
    finally:
        os.close(net_fd)
    if "error" in made:
        raise made["error"]
    return made["socket"]


def _take_port(port: int, holder: socket.socket) -> None:
    """Binds and listens on `port` as soon as the killed server's socket is gone (milliseconds)."""
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    deadline = time.monotonic() + 5
    while True:
        try:
            holder.bind(("", port))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)
    holder.listen()


@pytest.mark.slow
def test_on_ray_a_worker_whose_address_is_taken_stays_dropped_says_why_and_its_pool_is_retired(
    placement,
):
    if placement.name != "ray":
        pytest.skip("a local server's replacement is the coordinator's child (test above)")
    repl = wb.MultiWorkerAsyncReplicator(**placement.options(num_workers=2, num_ps=1))
    run = repl.train(setup=regression_setup, steps=10**6, steps_per_execution=5, background=True)
    holder = None
    try:
        wait_for_steps(run, 50)
        member = next(m for m in repl.launcher.pool.group.children if (m.role, m.index) == ("worker", 1))
        holder = _socket_in_network_of(member.pid)  # (its network: read before the process is gone)
        os.kill(member.pid, signal.SIGKILL)
        _take_port(member.port, holder)  # (before the new actor asks for it: it starts in ~1 s)
        # (The new actor's start comes first: a Ray worker process importing TensorFlow, more
        # than 120 s at load 30. Bounded by the run's own rules, as wait_for_steps is.)
        _wait_until(lambda: any("could not take" in t for t in _messages(run)), run, timeout=RUN_WAIT)
        rows = run.steps
        _wait_until(lambda: run.steps >= rows + 50, run, timeout=RUN_WAIT)  # the other worker goes on
    finally:
        run.stop()
        run.wait(timeout=60)
        if holder is not None:
            holder.close()
    assert run.status == "stopped" and run.restarts == [], (run.stop_reason, run.restarts)
    (line,) = [t for t in _messages(run) if "could not take" in t]
    assert f"port {member.port}" in line and "taken" in line and "1 worker(s)" in line, line
    workers = list(run.history["workers"])
    assert workers[0] == 2 and workers[-1] == 1 and workers.count(1) >= 50, workers
    # The pool is not whole: retired after the run; the next run starts a fresh one and says why.
    second = repl.train(setup=regression_setup, steps=10)
    assert second.status == "finished", second.stop_reason
    assert process_pid(second, "coordinator", 0) != process_pid(run, "coordinator", 0)
    notes = [t for t in _messages(second) if "fresh" in t]
    assert len(notes) == 1 and "worker 1" in notes[0], _messages(second)


def test_rays_words_for_a_killed_process_are_not_read_as_its_nodes_death():
    from workbench._src.placements.ray.link import death_reason, node_ended

    killed = RuntimeError(  # (Ray 2.60's ActorDiedError, abridged: its advice speaks of "node deaths")
        "The actor died unexpectedly before finishing this task.\n\tclass_name: Member\nThe actor is "
        "dead because its worker process has died. Worker exit type: SYSTEM_ERROR ... to prevent node "
        "deaths by resource contention"
    )
    node = RuntimeError("The actor died because its node has died. Node Id: 6c1e...")
    assert death_reason(killed) == "its process ended unexpectedly (killed or crashed)"
    assert death_reason(node) == "its node died (Ray's node health check)"
    owner = RuntimeError(  # (Ray 2.60, abridged: an actor whose creator's node ended first)
        "The actor died unexpectedly before finishing this task.\n\tclass_name: Member\nThe actor is "
        "dead because its owner has died. Owner Id: 0100... Owner Ip address: 127.0.0.1 Owner worker "
        "exit type: SYSTEM_ERROR Worker exit detail: Owner's node has crashed."
    )
    assert death_reason(owner) == "the Ray node of the process that created it ended"
    # (a node that ended, on a local instance the instance: its logs are read for why)
    assert node_ended(node) and node_ended(owner) and not node_ended(killed)


def test_the_placements_news_sent_again_is_said_once():
    # (replace.py sends a piece of news again when the coordinator took longer than a call's
    # timeout to take it: the first may still arrive, and the run must say the loss once)
    from workbench._src.backends.placed_workers import PlacedWorkers
    from workbench._src.core.run import Run
    from workbench._src.launch.runtime import tell_placement_news

    run = Run({"backend": "async-ps", "steps": 10})
    placed = PlacedWorkers()
    lost = {"kind": "lost", "index": 1, "run": 1, "number": 7, "where": "pid 5 on node n", "cause": "killed"}
    lost.update(described="was killed", replacing=True, why="", address="n:4000")
    dropped = {"kind": "dropped", "index": 1, "run": 1, "number": 8, "why": "port 4000 is taken"}
    for news in (lost, lost, dropped, dropped):
        tell_placement_news(news)
    assert placed.read(run, lambda: 1) == []
    said = _messages(run)
    assert len(said) == 2, said
    assert said[0].startswith("worker 1 (pid 5 on node n) was killed") and "n:4000" in said[0], said
    assert "could not take the lost one's place: port 4000 is taken" in said[1], said
    assert placed.gone() == {"worker 1"} and not placed.coming()
