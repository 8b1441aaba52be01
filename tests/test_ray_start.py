"""The start of a local Ray instance (`RayCluster(address=None)`, `--cluster ray=local`): on
loopback only, its token file its owner's, what it waits for said as it goes, and a failed start
leaving nothing (issue 39). The start on a busy machine is measured by bench/bench_ray_start.py.

Each Ray instance here belongs to a subprocess this test starts (a fresh interpreter, as a kernel):
this test process never connects to Ray, and another user's Ray on the machine is never touched.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys

import pytest

pytest.importorskip("ray", reason='Ray is an optional extra: pip install -e ".[ray,test]"')

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

# Starts a local instance and one actor, opens a control socket on all interfaces, prints every
# listening socket of the instance's processes, then waits (stdin) while they are probed.
LISTENERS_OF_A_LOCAL_INSTANCE = """
import json, os, socket, sys
import psutil
import workbench as wb
from workbench._src.placements.proc import pids_naming
from workbench._src.placements.local import netns
from workbench._src.launch import start_progress

with start_progress.listening(lambda text: print("[workbench]", text, file=sys.stderr, flush=True)):
    cluster = wb.RayCluster(address=None, placement="pack")
    ray = cluster.connect()

@ray.remote
class Probe:
    def pid(self):
        return os.getpid()

actor = Probe.remote()
actor_pid = ray.get(actor.pid.remote())
control = socket.socket()
control.bind(("0.0.0.0", 0))  # reachable from the other host: the probe itself works
control.listen()
me = psutil.Process()
pids = {me.pid, *(p.pid for p in me.children(recursive=True)), *pids_naming(cluster.local_root)}
listeners = []
for pid in sorted(pids):  # (each process's own sockets, in every network its threads are in)
    try:
        name = psutil.Process(pid).name()
    except psutil.Error:
        continue
    for network, address, port, closed in netns.own_listeners(pid):
        if port != control.getsockname()[1]:
            listeners.append([pid, name, address, port, closed])
token = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
print(json.dumps({
    "listeners": listeners, "actor_pid": actor_pid, "control_port": control.getsockname()[1],
    "token_mode": stat.S_IMODE(os.stat(token).st_mode) if os.path.exists(token) else None,
    "auth_mode": os.environ.get("RAY_AUTH_MODE"),
}), flush=True)
while not os.path.exists(os.environ["PROBED"]):  # (the test probes the ports meanwhile)
    time.sleep(0.2)
""".replace("import json, os, socket, sys", "import json, os, socket, stat, sys, time")

# From the other host: which of the ports answer at the first host's address.
PROBE = """
import json, socket, sys
address, ports = sys.argv[1], json.loads(sys.argv[2])
answered = []
for port in ports:
    with socket.socket() as s:
        s.settimeout(5)
        if s.connect_ex((address, port)) == 0:
            answered.append(port)
print(json.dumps(answered))
"""


@pytest.mark.slow
def test_a_local_ray_instance_listens_on_loopback_only_and_its_token_file_is_the_owners(tmp_path):
    """Every listener of the instance (GCS, raylet, object manager, agents, the driver's and an
    actor's core worker) is bound to 127.0.0.1 inside a loopback-only network, and none answers
    from another host (a second network namespace over a veth pair); a socket on all interfaces
    does. The token file Ray reads
    (~/.ray/auth_token, here in a HOME of the test's own) is 0600, and token auth is on."""
    from two_hosts import TwoHosts

    hosts = TwoHosts()  # (skips where namespaces cannot be made: not root, no iproute2)
    home = tmp_path / "home"
    home.mkdir()
    log = open(tmp_path / "instance.log", "w+")
    instance = None
    try:
        probed = tmp_path / "probed"
        env = {"PYTHONPATH": ROOT, "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0", "PROBED": str(probed)}
        instance = hosts.popen(0, [sys.executable, "-c", LISTENERS_OF_A_LOCAL_INSTANCE], env, log)
        said = _first_json_line(log, instance, timeout=400)
        listeners = said["listeners"]
        names = {name for _, name, *_ in listeners}
        assert {"gcs_server", "raylet"} <= names and said["actor_pid"] in {p for p, *_ in listeners}, (
            listeners
        )
        # Ray's servers bind loopback, and all of them (the driver's too) are in a loopback-only
        # network (placements/ray/instance_owner.py); the actor's TensorFlow server would be too.
        wide = [entry for entry in listeners if entry[2] not in ("127.0.0.1", "::ffff:127.0.0.1", "::ffff:7f00:1")]
        assert wide == [], f"listeners beyond loopback: {wide}"
        assert all(closed for *_, closed in listeners), f"outside the private network: {listeners}"
        ports = sorted({port for _, _, _, port, _ in listeners}) + [said["control_port"]]
        probe = hosts.popen(
            1, [sys.executable, "-c", PROBE, hosts.addresses[0], json.dumps(ports)], {}, subprocess.PIPE
        )
        answered = json.loads(probe.communicate(timeout=120)[0].decode().strip().splitlines()[-1])
        assert answered == [said["control_port"]], f"answered from the other host: {answered}"
        assert said["token_mode"] == 0o600 and said["auth_mode"] == "token", said
        probed.touch()
        assert instance.wait(timeout=120) == 0, _tail(log)
        assert not [p for p in os.listdir(hosts.tmp) if p.startswith("wbray-")]  # its Ray root went at exit
    finally:
        if instance is not None and instance.poll() is None:
            instance.kill()  # (its Ray processes: by hosts.close(), which ends every pid of its namespaces)
            instance.wait()
        hosts.close()
        log.close()


def _tail(log) -> str:
    log.seek(0)
    return log.read()[-4000:]


def _first_json_line(log, process, timeout: float) -> dict:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log.seek(0)
        for line in log.read().splitlines():
            if line.startswith("{"):
                return json.loads(line)
        if process.poll() is not None:
            break
        time.sleep(0.5)
    log.seek(0)
    raise AssertionError(f"the instance said nothing (exit {process.poll()}):\n{log.read()[-4000:]}")


def test_the_token_file_is_made_owner_only_and_a_wider_one_is_tightened(tmp_path, monkeypatch):
    from workbench._src.placements.ray import local_start

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    local_start.owner_only_token()
    path = tmp_path / ".ray" / "auth_token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_text()) == 64
    token = path.read_text()
    path.chmod(0o644)  # as Ray writes it
    local_start.owner_only_token()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == token  # (kept)


def test_the_agents_ports_are_chosen_for_each_start_and_repeat_no_other_components():
    """CI once failed a start with "dashboard_agent_http is trying to use a port number 52365
    that is used by other components": Ray's fixed default for the agent's HTTP port had been
    handed out as a free port to another agent. Each start now chooses all of them, keeps a port
    the caller set, and repeats none given to another component."""
    import ray

    from workbench._src.compat import ray_start_internals
    from workbench._src.placements.ray import local_start

    _, params_class, constants = ray_start_internals(ray)
    rays_own = params_class.update_pre_selected_port
    with local_start._start_settings(ray):
        params = params_class(gcs_server_port=40100, metrics_export_port=40101)
        params.update_pre_selected_port()
    agents = [getattr(params, name) for name in local_start._AGENT_PORTS]
    assert params.metrics_export_port == 40101  # (the caller's)
    assert len(set(agents)) == len(agents) and 40100 not in agents, agents
    assert constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT not in agents, agents
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(n) for n in f.read().split())
    chosen = [port for port in agents if port != 40101]
    assert not any(low <= port <= high for port in chosen), (chosen, low, high)  # (next test)
    assert params_class.update_pre_selected_port is rays_own  # (Ray's own, once the start is over)


def test_an_agent_port_is_never_one_the_kernel_hands_out_or_one_taken_or_given():
    """CI lost an instance to its runtime-env agent's "Address already in use": its port, chosen
    from the kernel's ephemeral range, had been handed meanwhile to another socket of the
    instance. In a network of its own whose kernel hands out ports 1024-65531 by itself, the
    ports left are 65532-65535: one is given to another component, one is listened on, so the
    two chosen are the other two; asked for three, the third (none being left) is the kernel's."""
    code = (
        "import socket\n"
        "from workbench._src.placements.ports import free_ports\n"
        "taken = socket.socket(); taken.bind(('127.0.0.1', 65534)); taken.listen()\n"
        "print(sorted(free_ports(2, avoiding={65532})))\n"
        "three = free_ports(3, avoiding={65532})\n"
        "print(len(set(three)), sum(1024 <= port <= 65531 for port in three))"
    )
    script = (
        "ip link set lo up && echo '1024 65531' > /proc/sys/net/ipv4/ip_local_port_range"
        ' && exec "$0" -c "$1"'
    )
    done = subprocess.run(
        ["unshare", "--net", "sh", "-c", script, sys.executable, code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[65533, 65535]", "3 1"], done.stdout


# Starts a local instance and one actor, says where they are, then waits to be killed.
KILLED_OWNER = """
import json, os, time
import workbench as wb
cluster = wb.RayCluster(address=None, placement="pack")
ray = cluster.connect()

@ray.remote(num_cpus=0.5)
class Probe:
    def pid(self):
        return os.getpid()

actor = Probe.remote()
said = {"root": cluster.local_root, "network": cluster.local_owner.network}
print(json.dumps({**said, "actor": ray.get(actor.pid.remote(), timeout=300)}), flush=True)
time.sleep(3600)
"""


def _instance_processes(network: str) -> list[tuple[int, int]]:
    """(pid, start time) of every process in the instance's private network (its alone; a
    process's environment is no guide: an agent that retitles itself may write over it)."""
    from workbench._src.placements.proc import process_start_ticks

    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.readlink(f"/proc/{name}/ns/net") == network:
                found.append((int(name), process_start_ticks(int(name))))
        except OSError:
            continue
    return found


# The raylet's agents: by the titles they give themselves, or their scripts before they do.
_AGENT_TITLES = ("DashboardAgent", "RuntimeEnvAgent", "/dashboard/agent.py", "/runtime_env/agent/main.py")


def _is_agent(title: str) -> bool:
    program = " ".join(title.split()[:3])  # (not its arguments: the raylet's name the agents' scripts)
    return any(name in program for name in _AGENT_TITLES)


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow
def test_an_instance_whose_owner_is_killed_leaves_no_process_and_no_folder(tmp_path):
    """A kernel SIGKILLed runs no exit code: the GCS and the raylet die with it (Ray ties them to
    the thread that started them), but the raylet's agents lived on until their own check of the
    raylet gave up (40-70 s here, minutes on a loaded machine). The instance's sentinel
    (instance_sentinel.py) SIGKILLs all of it at once and removes its folder. Judged by what
    happened, not by the clock: this process adopts the instance's orphans (a subreaper), so it
    reaps each agent and reads how it ended: killed, not exited by itself."""
    from helpers import adopt_orphans, wait_for

    from workbench._src.placements.proc import same_process_running

    if os.geteuid() != 0:
        pytest.skip("not root: the instance runs in the host network (test_security_ray.py)")

    log = open(tmp_path / "owner.log", "w+")
    adopt_orphans(True)
    try:
        owner = subprocess.Popen(
            [sys.executable, "-c", KILLED_OWNER], env={**os.environ, "PYTHONPATH": ROOT}, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            said = _first_json_line(log, owner, timeout=400)

            def with_its_agents():  # (the raylet starts them as it goes: the node may be up first)
                found = _instance_processes(said["network"])
                titles = {pid: _title(pid) for pid, _ in found}
                agents = [pid for pid, title in titles.items() if _is_agent(title)]
                return (found, titles, agents) if len(agents) == 2 else None

            instance, titles, agents = wait_for(with_its_agents, 300, "the raylet's two agents")
            assert said["network"] != os.readlink("/proc/self/ns/net")  # (its own: instance_owner.py)
            everything = " ".join(titles.values())
            assert "gcs_server" in everything and "raylet" in everything and said["actor"] in titles, titles
        finally:
            owner.kill()
            owner.wait()
            log.close()
        ended: dict[int, int] = {}

        def all_ended() -> bool:
            for pid, started in instance:
                if pid not in ended:
                    try:
                        done, status = os.waitpid(pid, os.WNOHANG)  # (adopted: ours to reap)
                    except ChildProcessError:  # (not ours: another's to reap)
                        done, status = (pid, -1) if not same_process_running(pid, started) else (0, 0)
                    if done:
                        ended[pid] = status
            return len(ended) == len(instance)

        wait_for(all_ended, 300, "the instance's processes to end")  # (only ends a test that fails)
    finally:
        adopt_orphans(False)
    # No agent exited by itself: each one this process reaped was killed, and one killed before
    # its raylet died was reaped by the raylet (-1 here; under CI's load both were). Without the
    # sentinel every agent outlives its raylet, is adopted here and exits by itself (status 0).
    how = {f"{pid} {titles[pid].split()[0]}": ended[pid] for pid in agents}
    read = [status for status in how.values() if status >= 0]
    assert all(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL for status in read), how
    wait_for(lambda: not os.path.exists(said["root"]), 30, "the instance's folder to be removed")


def test_what_a_start_says_with_nobody_listening_is_heard_by_the_next_listener():
    """A pool started in the background (the magic, the panel) says its start before its run
    exists: the run that listens next hears those lines first, then the live ones."""
    from workbench._src.launch import start_progress

    start_progress.say("starting the Ray head (GCS and raylet) on this machine")
    heard = []
    with start_progress.listening(heard.append):
        start_progress.say("placing the Ray actors 1/2")
    start_progress.say("after")  # (kept for the next)
    assert heard == ["starting the Ray head (GCS and raylet) on this machine", "placing the Ray actors 1/2"]
    with start_progress.listening(heard.append):
        pass
    assert heard[-1] == "after"


@pytest.mark.slow
def test_the_cli_says_what_a_ray_start_waits_for_in_order(tmp_path):
    """`workbench run ... --cluster ray=local`: the run's "message" events say the start's phases,
    and the CLI prints them as "[workbench]" lines, in the order they happen, before step 1."""
    done = subprocess.run(
        ["workbench", "run", os.path.join(ROOT, "examples", "train.py"),
         "--backend", "multi-worker", "--workers", "2", "--cluster", "ray=local", "--steps", "3",
         "--startup-timeout", "600"],  # (what is asserted is the order of what it says)
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "HOME": str(tmp_path), "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("[workbench]", "step "))]
    phases = [
        "[workbench] importing Ray, to start a local Ray instance",
        "[workbench] starting the Ray head (GCS and raylet) on this machine",
        "[workbench] the Ray node is up",
        "[workbench] placing the Ray actors 0/2",
        "[workbench] placing the Ray actors 2/2",
    ]
    at = [next((i for i, line in enumerate(lines) if line.startswith(p)), None) for p in phases]
    assert None not in at and at == sorted(at), "\n".join(lines)
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step "))
    assert at[-1] < first_step, "\n".join(lines)


# Starts a local instance while its dashboard agent is held stopped (SIGSTOP) for HELD seconds from
# the moment it appears: an agent starved on a loaded machine, past the fixed 15 s that the raylet
# waits for the ports the agent writes. Prints how the start went and what the raylet logged.
A_START_WITH_A_HELD_AGENT = """
import contextlib, json, os, signal, sys, threading, time
import psutil
import workbench as wb
from workbench._src.placements.ray.instance_logs import raylet_last_error

HELD = float(sys.argv[1])
held = []

def hold(pid):
    with contextlib.suppress(ProcessLookupError):  # (a failed try's agent is killed meanwhile)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(HELD)
        os.kill(pid, signal.SIGCONT)

def hold_the_agent():  # (each try's agent: a start tried again would meet a fresh one)
    while True:
        for child in psutil.Process().children(recursive=True):
            try:
                command, parent = child.cmdline(), psutil.Process(child.ppid()).cmdline()
            except psutil.Error:
                continue
            # (the raylet's agent, as soon as it is there: "python [-u] .../dashboard/agent.py ...")
            if child.pid not in held and parent[:1] and parent[0].endswith("/raylet") and any(
                arg.endswith("dashboard/agent.py") for arg in command[1:3]
            ):
                held.append(child.pid)
                threading.Thread(target=hold, args=(child.pid,), daemon=True).start()
        time.sleep(0.02)

threading.Thread(target=hold_the_agent, daemon=True).start()
cluster = wb.RayCluster(address=None)
result = {"started": False}
try:
    ray = cluster.connect()
    result["started"] = bool(ray.nodes())
except Exception as error:
    result["error"] = str(error)
result["held"] = len(held)
result["raylet_error"] = raylet_last_error(cluster.local_root)
cluster.shutdown()
print(json.dumps(result), flush=True)
"""


@pytest.mark.slow
def test_a_start_whose_dashboard_agent_is_starved_past_rays_fixed_wait_succeeds(tmp_path):
    """Ray's raylet reads two of its dashboard agent's ports from files the agent writes once it
    serves, and aborts the node when they are missing after a fixed 15 s; a starved agent (here
    held stopped for 25 s) made local starts fail on a loaded machine. The start writes those
    files itself (the ports were chosen before it), so the raylet waits for nothing it would
    abort over, and the node comes up once the agent runs again."""
    done = subprocess.run(
        [sys.executable, "-c", A_START_WITH_A_HELD_AGENT, "25"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "HOME": str(tmp_path), "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["held"] == 1, said  # (the agent was found and held, and the first try started)
    assert said["started"], said
    assert "Timed out waiting for file" not in said["raylet_error"], said


def test_a_raylet_gone_at_start_is_said_with_its_last_error(tmp_path):
    # A failed try's Ray folder is removed with its processes, so the raylet's own account of its
    # end is read first and said with "its raylet is gone". The lines are in Ray 2.60's format.
    from workbench._src.placements.ray.instance_logs import raylet_last_error

    logs = tmp_path / "ray" / "session_2026-11-27_07-33-28_018671_24741" / "logs"
    logs.mkdir(parents=True)
    assert raylet_last_error(str(tmp_path)) == ""
    (logs / "raylet.out").write_text(
        "[2026-11-27 07:33:34,398 I 4378 4378] (raylet) grpc_server.cc:144: NodeManager server started.\n"
        "[2026-11-27 07:33:40,001 E 4378 4390] (raylet) gcs_client.cc:88: GCS did not answer in 60 s.\n"
        "[2026-11-27 07:33:49,978 C 4378 4378] (raylet) node_manager.cc:3576:  An unexpected system state "
        "has occurred. You have likely discovered a bug in Ray. Check failed: ports.has_value() Timed out "
        "waiting for file /tmp/ray/session_x/metrics_agent_port_5818\n"
        "*** StackTrace Information ***\n"
    )
    said = raylet_last_error(str(tmp_path))
    assert said == (
        "node_manager.cc:3576: Check failed: ports.has_value() Timed out waiting for file "
        "/tmp/ray/session_x/metrics_agent_port_5818"
    ), said


def test_an_instance_ended_by_a_failed_agent_is_said_with_the_agents_last_words(tmp_path):
    # Ray 2.60's lines (abridged): the harmless metrics-exporter error of every start here is
    # skipped; the raylet's last error names the agent it fate-shared with, whose stderr ends
    # with the exception.
    from workbench._src.placements.ray.instance_logs import instance_end

    logs = tmp_path / "ray" / "session_2026-11-29_07-14-00_018671_24741" / "logs"
    logs.mkdir(parents=True)
    (logs / "raylet.out").write_text(
        "[2026-11-29 07:13:23,161 E 18930 18930] (raylet) main.cc:1108: Failed to establish connection to "
        "the metrics exporter agent. Metrics will not be exported.\n"
    )
    assert instance_end(str(tmp_path)) == ""
    with open(logs / "raylet.out", "a") as f:
        f.write(
            "[2026-11-29 07:14:22,704 E 25125 25156] (raylet) agent_manager.cc:87: The raylet exited "
            "immediately because one Ray agent failed, agent_name = runtime_env_agent.\n"
            "The raylet fate shares with the agent. This can happen because\n"
        )
    (logs / "runtime_env_agent.err").write_text(
        "Traceback (most recent call last):\n  File \"main.py\", line 241, in <module>\n"
        "OSError: [Errno 98] Address already in use\n\n"
    )
    assert instance_end(str(tmp_path)) == (
        "its raylet: agent_manager.cc:87: The raylet exited immediately because one Ray agent failed, "
        "agent_name = runtime_env_agent.; its runtime_env_agent: OSError: [Errno 98] Address already in use"
    )


# A local pool whose Ray instance ends while its actors are placed (argv[1] "placing") or while
# it trains ("training"): its runtime env agent, a process the raylet fate-shares with, is killed.
A_POOL_WHOSE_AGENT_DIES = """
import json, os, signal, sys, time, psutil
sys.path.insert(0, "tests")
from helpers import regression_setup, wait_for_steps
import workbench as wb
from workbench._src.launch import start_progress

def kill_the_runtime_env_agent():  # (then waits for the raylet to end)
    children = psutil.Process().children(recursive=True)
    raylet = next(child for child in children if child.name() == "raylet")
    for child in children:
        command = " ".join(child.cmdline())  # (it retitles itself once started; the raylet's
        if child != raylet and (  # own command line names the agent's script too)
            "runtime_env/agent/main.py" in command or command.startswith("ray::RuntimeEnvAgent")
        ):
            os.kill(child.pid, signal.SIGKILL)
    raylet.wait(timeout=60)

def at_placing(text):  # (before any actor answers: the start waits for this listener)
    if text.startswith("placing the Ray actors 0/"):
        kill_the_runtime_env_agent()

repl = wb.MultiWorkerReplicator(num_workers=2, cluster=wb.RayCluster(address=None, placement="pack"))
try:
    if sys.argv[1] == "placing":
        with start_progress.listening(at_placing):
            repl.train(setup=regression_setup, steps=1)
    else:
        run = repl.train(setup=regression_setup, steps=1_000_000, background=True)
        wait_for_steps(run, 5)
        kill_the_runtime_env_agent()
        run.wait(timeout=300)
except wb.WorkerError as error:
    print(json.dumps({"error": str(error), "cause": error.cause}), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["placing", "training"])
def test_a_local_instance_that_ends_is_said_with_its_raylets_account(tmp_path, moment):
    """Ray says only that the actors died and that the node "has been marked dead because the
    detector has missed too many heartbeats"; the error says which agent the raylet ended with,
    whether the instance ended while the pool's actors were placed or while it trained."""
    done = subprocess.run(
        [sys.executable, "-c", A_POOL_WHOSE_AGENT_DIES, moment], capture_output=True, text=True,
        timeout=600, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "HOME": str(tmp_path), "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    if moment == "placing":
        assert said["error"].startswith("the multi-worker pool's 2 Ray actors died before they started"), said
        assert "The local Ray instance ended (its raylet: " in said["error"], said
    else:
        assert "the local Ray instance ended (its raylet: " in said["error"], said
    assert "agent_name = runtime_env_agent" in said["error"], said
    assert "Traceback" not in said["error"], said
