"""Errors the workbench raises. Each message says what was wrong, what was received, and the fix."""


class WorkbenchError(Exception):
    """Base class of every error the workbench raises on purpose."""


class ConfigurationError(WorkbenchError, ValueError):
    """A replicator or run was asked for something that cannot work as given."""


class CapacityError(ConfigurationError):
    """The cluster has no room for a pool as asked (a Ray placement group that could not be met
    within startup_timeout). An elastic run (`min_workers`) goes on with fewer workers instead."""


class DeviceError(WorkbenchError, RuntimeError):
    """The devices a replicator needs are not there (or were fixed too early)."""


class InputError(WorkbenchError, ValueError):
    """input_fn returned something the replicator cannot feed to step_fn."""


class StepFunctionError(WorkbenchError, TypeError):
    """step_fn cannot be called with the input, or returned something that is not tensors."""


class ReplicaContextError(WorkbenchError, RuntimeError):
    """A primitive that needs a replica (inside step_fn) was called somewhere else."""


class TpuUnavailableError(DeviceError):
    """No TPU can be reached from this process."""


class NonFiniteError(WorkbenchError, FloatingPointError):
    """A metric became NaN or Inf during training. `run` holds the partial run."""

    def __init__(self, message: str, run=None):
        super().__init__(message)
        self.run = run


class WorkerError(WorkbenchError, RuntimeError):
    """A process of a multi-process run died, froze, failed or never started.

    `task` names it ("worker 1", "ps 0"); `run` holds the run's history up to the failure.
    `cause` says in a few words how a member was lost ("killed by SIGKILL", "frozen"), and is
    None when no member was lost (an error in the run's own code): only a lost member is healed
    by `max_restarts`, since a mistake would only happen again.
    """

    def __init__(self, message: str, task: str | None = None, run=None, cause: str | None = None):
        super().__init__(message)
        self.task = task
        self.run = run
        self.cause = cause


def check_positive_int(name: str, value, fix: str | None = None) -> int:
    """`value` if it is an int >= 1 (not a bool), else a ConfigurationError naming `name`.

    The one positive-integer check of the workbench (replica, worker, step counts...).
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    hint = f" Fix: {fix}." if fix else f" Fix: {name}=2, say."
    raise ConfigurationError(
        f"{name} must be a positive integer; received {name}={value!r} ({type(value).__name__}).{hint}"
    )
