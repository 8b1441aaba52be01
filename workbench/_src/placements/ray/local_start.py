"""Starting the local Ray instance of `RayCluster(address=None)` (`--cluster ray=local`): one that
succeeds on a busy machine, says what it waits for, listens on loopback only, and leaves nothing
behind when it fails.

- Ray 2.60 gives a new node's raylet a fixed 30 s to register with the GCS (ray/_private/node.py,
  no setting); on 2 cores at a load of 13-21 it took longer in about half the starts. Here the
  node's registration is waited for as long as the instance makes progress: `Node` asks
  `ray._private.services.get_node` in its loop, and during our start that call waits itself while
  the raylet runs and the instance's processes get CPU time. A raylet stopped or gone, or an
  instance with no CPU time for RAYLET_STALL_SECONDS, fails the try; its processes are ended and
  the start is tried again once.
- Ray binds its gRPC servers (GCS, raylet, object manager, every core worker) to all interfaces
  unless the node's address is 127.0.0.1, and it turns 127.0.0.1 into the machine's address unless
  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is off (ray/_private/services.py): with both, every listener
  of the instance is on loopback. Only this process's own instance: a cluster named by address
  is the operator's (README, "On a Ray cluster").
- TensorFlow's servers in the actors bind every interface whatever their address: the start runs
  on a thread of its own inside a private loopback-only network namespace, where every process of
  the instance is then born; the thread lives as long as the instance (instance_owner.py).
- Ray writes its token file ~/.ray/auth_token readable by everyone (0644); it is made here first
  when missing, and kept readable by its owner only.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import secrets
import shutil
import signal
import time

from workbench._src.compat import ray_connect_state_accessor, ray_start_internals, ray_write_port_files
from workbench._src.core import exit as process_exit
from workbench._src.core.errors import ConfigurationError
from workbench._src.core.owned_folders import pid_alive
from workbench._src.launch.start_progress import Phases, say
from workbench._src.placements.ports import LOOPBACK, free_ports
from workbench._src.placements.proc import pids_naming, process_cpu_seconds
from workbench._src.placements.ray.instance_logs import raylet_last_error
from workbench._src.placements.ray.instance_owner import InstanceOwner

# How long the processes of a starting instance may all get no CPU time before its start is given
# up: on a loaded machine they get CPU in slices and the node registers in the end; stopped or hung
# they get none. Well above the gaps a load of 20 on 2 cores leaves between a process's slices.
RAYLET_STALL_SECONDS = 30.0
# The longest a start waits for its node in all, progress or not: an instance busy this long
# without its node registering is in a loop of its own (a start at a load of 20 took ~130 s).
NODE_WAIT_LIMIT = 300.0
# How long Ray waits for the GCS to write its port file (Ray's default is 30 s, its own setting
# RAY_gcs_server_port_wait_time_s): the GCS is a process starting on the same loaded machine.
GCS_PORT_WAIT_SECONDS = 300
# How long a raylet of a local instance may leave the GCS's health checks unanswered before Ray
# marks its node dead (which ends the instance): a starved raylet, all on one machine, as long as
# the longest start is given (NODE_WAIT_LIMIT).
HEALTH_CHECK_PATIENCE = NODE_WAIT_LIMIT
# Ray's health check of such a raylet: a check every period, each waited for up to timeout, so
# that a silent raylet fails a check about every period + timeout.
HEALTH_CHECK_PERIOD_MS, HEALTH_CHECK_TIMEOUT_MS = 5000, 10000
# How many times a start is tried (a try that stalled is ended, then tried again).
LOCAL_START_ATTEMPTS = 2
# The ports of the raylet's agents (RayParams fields), chosen before the start (_start_settings).
_AGENT_PORTS = (
    "metrics_agent_port",
    "metrics_export_port",
    "dashboard_agent_listen_port",
    "runtime_env_agent_port",
)
# Those whose port files the raylet waits for however it is started (_agent_port_files).
_PORT_FILES = ("metrics_export_port", "dashboard_agent_listen_port")
# What the instance's processes read at their start (Ray's own settings, RayConfig and env):
_START_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # 127.0.0.1 stays the node's address
    "RAY_gcs_server_port_wait_time_s": str(GCS_PORT_WAIT_SECONDS),
    # The raylet's wait for its agents to register (Python processes that import for long on a
    # loaded machine): the start as a whole is bounded here, by progress and NODE_WAIT_LIMIT.
    # (Not RAY_raylet_start_wait_time_s: it is how long each of Ray's node queries blocks, 10 s;
    # the progress checks below run between them.)
    "RAY_agent_register_timeout_ms": str(int(NODE_WAIT_LIMIT * 1000)),
    # The GCS's health check of the raylet: by Ray's defaults a raylet that has not answered for
    # about a minute is marked dead, and a raylet so marked exits, so the instance is gone for
    # good. All on one machine, that silence means a starved raylet, not a lost node (measured: a
    # raylet stopped for 60 s lived on, one stopped for 100 s ended its instance). Here a raylet
    # is given about HEALTH_CHECK_PATIENCE of silence (failure_threshold checks, each up to
    # timeout_ms, period_ms apart). A raylet that crashes is then said ~100 s late, not ~15 s:
    # its actors' processes live on and train meanwhile; the run fails once the node is dead.
    "RAY_health_check_period_ms": str(HEALTH_CHECK_PERIOD_MS),
    "RAY_health_check_timeout_ms": str(HEALTH_CHECK_TIMEOUT_MS),
    "RAY_health_check_failure_threshold": str(
        int(HEALTH_CHECK_PATIENCE * 1000 // (HEALTH_CHECK_PERIOD_MS + HEALTH_CHECK_TIMEOUT_MS))
    ),
}


def start_local(ray, init: dict, root: str) -> InstanceOwner:
    """ray.init(**init) for a local instance under the private root `root`, on loopback only and
    in a private network, its node waited for while it makes progress, tried again once after a
    try that stalled. Runs on the instance's own thread (instance_owner.py), returned: release it
    once the instance is shut down."""
    owner_only_token()

    def start():
        _start_tried_twice(ray, init, root)

    owner = InstanceOwner(start, end=lambda: end_failed_start(root), root=root)
    owner.wait()
    # At exit, after the instance is ended (cluster.end_local_instance, the same stage, registered
    # earlier): its sentinel then exits with nothing to end, not a moment after this process.
    process_exit.on_exit("ray", owner.release)
    owner_only_token()  # (Ray made it, if it had to)
    say("the Ray node is up")
    return owner


def _start_tried_twice(ray, init: dict, root: str) -> None:
    failed = ""
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        again = f" again (try {attempt}: the last one failed, {failed})" if failed else ""
        try:
            with (
                Phases() as phases,
                _start_settings(ray),
                _agent_port_files(ray),
                _node_waited_for(ray, root, phases),
            ):
                phases.now(f"starting the Ray head (GCS and raylet) on this machine{again}")
                ray.init(**init, _node_ip_address=LOOPBACK)
                # Ray connects its state accessor (ray.nodes(), free resources per node) on first
                # use, from the calling thread: here, so that its I/O thread is inside too.
                ray_connect_state_accessor(ray)
        except Exception as error:
            end_failed_start(root)
            if not _timed_out_at_start(error):
                raise
            failed = str(error)
            if attempt == LOCAL_START_ATTEMPTS:
                raise ConfigurationError(
                    f"The local Ray instance did not start: {LOCAL_START_ATTEMPTS} times its node did not "
                    f"register ({error}). Fix: see what holds the machine (`top`), or start Ray yourself "
                    "(`ray start --head`) and use RayCluster(address='auto')."
                ) from None
            continue
        return


def _timed_out_at_start(error: Exception) -> bool:
    return isinstance(error, RayletStalled) or "timed out during startup" in str(error)


@contextlib.contextmanager
def _start_settings(ray):
    """Ray's own settings for this start (_START_ENV: the processes it starts inherit them), and its
    switch for a single-machine node on loopback (read from its constants when it picks the
    node's address)."""
    _, params, constants = ray_start_internals(ray)
    saved_env = {name: os.environ.get(name) for name in _START_ENV}
    saved_flag, select_ports = constants.ENABLE_RAY_CLUSTER, params.update_pre_selected_port
    os.environ.update(_START_ENV)
    constants.ENABLE_RAY_CLUSTER = False

    def with_agent_ports(self):
        # The raylet waits a short fixed time for its agents (Python processes, slow to import on
        # a loaded machine) to write the ports they picked, then aborts: measured, a raylet
        # gave up after 16 s. Ports chosen here are known to it from the start (and the two
        # it reads from files in any case are written for it: _agent_port_files).
        # Ray's default for the agent's HTTP port is a fixed number (52365): shared by every
        # instance on the machine, and once handed out by the kernel as a free port to one of the
        # others (CI: "dashboard_agent_http is trying to use a port number 52365 that is used by
        # other components"). It is chosen here like the rest, and no choice repeats a port
        # another component of this start was given.
        unchosen = {None, 0, constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT}
        to_choose = [name for name in _AGENT_PORTS if getattr(self, name, None) in unchosen]
        given = {port for name, port in vars(self).items() if name.endswith("_port") and isinstance(port, int)}
        for name, port in zip(to_choose, free_ports(len(to_choose), avoiding=given)):
            setattr(self, name, port)
        return select_ports(self)

    params.update_pre_selected_port = with_agent_ports
    try:
        yield
    finally:
        params.update_pre_selected_port = select_ports
        constants.ENABLE_RAY_CLUSTER = saved_flag
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _agent_port_files(ray):
    """The raylet reads two of its agents' ports from files the dashboard agent writes once it
    serves (its metrics export and HTTP ports), and aborts the node when they are not there
    within a fixed 15 s (no setting; ray-project/ray#65983): on a loaded machine the agent, a
    Python process importing Ray's dashboard, takes longer. The ports were chosen before the
    start (_start_settings) and given to the agent, so the files are written here, with Ray's own
    writer, just before the raylet starts: it reads them at once. The agent later writes its own
    (the same ports, or -1 for a server it does not run: Ray installed without its dashboard's
    extras, as here, serves neither). Its registration keeps its own wait
    (RAY_agent_register_timeout_ms)."""
    services, _, _ = ray_start_internals(ray)
    start_raylet = services.start_raylet
    parameters = inspect.signature(start_raylet)

    def start_raylet_with_port_files(*args, **kwargs):
        given = parameters.bind(*args, **kwargs).arguments
        ports = {name: given.get(name) for name in _PORT_FILES}
        where = given.get("session_dir"), given.get("node_id")
        # (ports chosen by us only: one left to the agent is its to write; where Ray renamed the
        # parameters, nothing is written and the raylet waits as Ray has it)
        if all(ports.values()) and all(where):
            ray_write_port_files(*where, ports)
        return start_raylet(*args, **kwargs)

    services.start_raylet = start_raylet_with_port_files
    try:
        yield
    finally:
        services.start_raylet = start_raylet


@contextlib.contextmanager
def _node_waited_for(ray, root: str, phases: Phases):
    """During the start, Ray's query for its new node waits while the instance makes progress."""
    services, _, _ = ray_start_internals(ray)
    asked = services.get_node

    def get_node_when_registered(gcs_address, node_id):
        started = time.monotonic()
        progress = _StartProgress(root)
        while True:
            try:
                found = asked(gcs_address, node_id)
                phases.now("connecting this process to the Ray node")
                return found
            except RuntimeError:  # not registered yet (Ray's own signal for it)
                phases.now("waiting for the Ray node (its raylet) to register")
                problem = progress.problem()
                if not problem and time.monotonic() - started > NODE_WAIT_LIMIT:
                    problem = f"it did not register within {NODE_WAIT_LIMIT:.0f} s"
                if problem:  # (not a RuntimeError: Ray's loop would ask again until its 30 s)
                    raise RayletStalled(problem) from None
                time.sleep(0.5)

    services.get_node = get_node_when_registered
    try:
        yield
    finally:
        services.get_node = asked


class RayletStalled(Exception):
    """The starting raylet is stopped or gone, or no process of the instance ran for a while."""


class _StartProgress:
    """Whether a start can still succeed: its raylet is there and not stopped (SIGSTOP, a
    debugger), and some process of the instance (all name our root) got CPU time in the last
    RAYLET_STALL_SECONDS. The raylet alone is not the measure: it sits idle while the Python
    agents it started import (it registers once they say their ports)."""

    def __init__(self, root: str):
        self.root = root
        self.cpu, self.since = None, time.monotonic()

    def problem(self) -> str:
        pids = pids_naming(self.root)
        states = {pid: _state(pid) for pid in pids if _is_raylet(pid)}
        if not any(state not in ("Z", "T", "t", None) for state in states.values()):
            stopped = [pid for pid, state in states.items() if state in ("T", "t")]
            if stopped:
                return f"its raylet (pid {stopped[0]}) is stopped"
            said = raylet_last_error(self.root)  # (read now: a failed try's folder is removed)
            return f"its raylet is gone ({said})" if said else "its raylet is gone"
        cpu = sum(process_cpu_seconds(pid) or 0.0 for pid in pids)
        if cpu != self.cpu:
            self.cpu, self.since = cpu, time.monotonic()
        if time.monotonic() - self.since > RAYLET_STALL_SECONDS:
            return f"no process of the instance ran for {RAYLET_STALL_SECONDS:.0f} s"
        return ""


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _is_raylet(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].endswith(b"/raylet")
    except OSError:
        return False


def end_failed_start(root: str) -> None:
    """Kills the processes a failed start left (GCS, raylet, their helpers; ray.init had not
    recorded them, so ray.shutdown() would not end them), reaps those that are this process's
    children (no zombie), and removes the try's Ray folder. Found by our private Ray root in their
    command lines (its name holds our pid and a random part: no one else's process names it)."""
    with contextlib.suppress(Exception):
        import ray

        ray.shutdown()  # (what ray.init did record: its driver connection, if it got that far)
    left = pids_naming(root)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)  # our child: reaped now (Ray's Popen objects are gone)
        if not any(pid_alive(pid) or _zombie_child(pid) for pid in left):
            break
        time.sleep(0.05)
    shutil.rmtree(os.path.join(root, "ray"), ignore_errors=True)


def _zombie_child(pid: int) -> bool:
    """pid is a zombie whose parent is this process (so it is ours to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] == "Z" and int(fields[1]) == os.getpid()


def token_path() -> str:
    return os.path.join(os.path.expanduser("~"), ".ray", "auth_token")


def owner_only_token() -> None:
    """Ray's token file (~/.ray/auth_token), readable by its owner only: made here when missing
    (Ray would write it 0644) and tightened when found wider. A token set in the environment
    (RAY_AUTH_TOKEN) needs no file."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return
    path = token_path()
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))  # (Ray's own tokens are 64 hex characters too)
    with contextlib.suppress(OSError):  # (a file of another owner is not ours to change)
        if os.stat(path).st_uid == os.getuid() and os.stat(path).st_mode & 0o077:
            os.chmod(path, 0o600)


def actors_ready(ray, refs: list, timeout: float) -> list:
    """ray.get(refs, timeout=timeout), saying "placing the Ray actors k/N" as each answers.
    Raises ray.exceptions.GetTimeoutError as ray.get would."""
    total, deadline = len(refs), time.monotonic() + timeout
    waiting, done = list(refs), 0
    say(f"placing the Ray actors 0/{total}")
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ray.exceptions.GetTimeoutError(f"{total - done} of {total} actors did not answer")
        ready, waiting = ray.wait(waiting, num_returns=1, timeout=min(left, 5.0))
        if ready:
            done += len(ready)
            say(f"placing the Ray actors {done}/{total}")
    return ray.get(refs)
