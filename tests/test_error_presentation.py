"""Errors lead with their cause (issue 41, "errors-readable"): the first line a researcher sees
names the innermost error's own sentence, and the traceback shown holds their frames only."""

import re

import pytest
from error_cells import CASES, HEADER, MISSPELT_NAME
from notebook_toy import ipython_shell, isolated_notebook_state

from workbench._src.core import tracebacks
from workbench._src.core.errors import ConfigurationError
from workbench._src.notebook import labcomm

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def shell():
    return ipython_shell()


@pytest.fixture
def ip(shell, tmp_path, monkeypatch):
    monkeypatch.delenv(tracebacks.FULL_ENV, raising=False)
    with isolated_notebook_state(tmp_path / "runs"):
        for name in ("step_fn", "input_fn", "repl", "model"):
            shell.user_ns.pop(name, None)
        yield shell


def shown(ip, capsys, source: str):
    """Runs a cell as a frontend does; returns (the error, the traceback text IPython showed)."""
    capsys.readouterr()
    result = ip.run_cell(source)
    error = result.error_in_exec
    assert error is not None, "the cell did not fail"
    return error, ANSI.sub("", capsys.readouterr().out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_mistake_leads_with_its_cause_and_shows_only_the_cells_frames(ip, capsys, case):
    body, cause, line = CASES[case]
    error, text = shown(ip, capsys, HEADER + body)
    first = str(error).splitlines()[0]
    assert re.search(cause, first), first
    assert not first.startswith("in user code"), first
    assert "workbench/_src" not in text and "workbench/_src" not in str(error), text
    assert f"{type(error).__name__}: {first}" in text.splitlines(), text  # the cause, last shown
    if line is not None:  # the cell's own line in step_fn, where AutoGraph ran a copy of it
        assert re.search(rf"in step_fn\b.*\n(.*\n)*?-+> *\d+ +{re.escape(line)}", text), text
    run = getattr(error, "run", None)
    if run is not None:  # the run's reason (summary line, run store, sidebar card) says it too
        assert re.search(cause, run.stop_reason.splitlines()[0]), run.stop_reason
        details = run.events[-1].data["details"]  # (the "details" toggle of the cell and card)
        assert "workbench/_src" not in details and "\x1b" not in details, details
        if line is not None:
            assert re.search(rf"Cell In\[\d+\], line \d+, in step_fn\n +{re.escape(line)}", details), details


def test_full_tracebacks_show_every_frame_and_wrapper(ip, capsys, monkeypatch):
    monkeypatch.setenv(tracebacks.FULL_ENV, "full")
    error, text = shown(ip, capsys, HEADER + MISSPELT_NAME)
    assert str(error).startswith("in user code:")  # AutoGraph's own wrapper, as raised
    assert "workbench/_src/core/run_loop.py" in text


def test_a_background_run_fails_with_its_cause_in_the_card_and_on_wait(ip, capsys):
    ip.run_cell(MISSPELT_NAME)  # the notebook's functions, trained by the line form
    run = ip.run_line_magic(
        "replicate", "step_fn input_fn --backend mirrored --replicas 2 --steps 5 --background --no-live"
    )
    ip.user_ns["run"] = run
    error, text = shown(ip, capsys, "run.wait(120)")
    assert str(error) == "name 'learning_rat' is not defined"
    assert "workbench/_src" not in text and "learning_rat * loss" in text, text
    watcher = labcomm._RunWatcher(run)
    run.subscribe(watcher)  # (past events replayed: the card as the sidebar gets it)
    card = watcher.info()
    assert card["status"] == "failed"
    assert card["reason"].startswith("NameError: name 'learning_rat' is not defined"), card
    assert "\x1b" not in card["reason"] and "in user code" not in card["reason"]


class _Wrapper(ValueError):
    pass


def _raise_chain():
    try:
        try:
            raise KeyError("unrelated, met while handling")
        except KeyError:
            raise ValueError("Input 0 of layer 'dense' is incompatible with the layer") from None
    except ValueError as inner:
        raise _Wrapper(
            "Exception encountered when calling Sequential.call().\n\n"
            f"\x1b[1m{inner}\x1b[0m\n\nArguments received by Sequential.call():\n  • inputs=..."
        ) from None


def test_the_innermost_quoted_error_is_the_cause_and_unrelated_context_is_not():
    with pytest.raises(_Wrapper) as caught:
        _raise_chain()
    cause = tracebacks.innermost(caught.value)
    assert type(cause) is ValueError and str(cause).startswith("Input 0 of layer")
    assert tracebacks.cause_line(caught.value) == (
        "ValueError: Input 0 of layer 'dense' is incompatible with the layer"
    )
    shown = tracebacks.readable(caught.value)
    assert shown is cause and shown.__suppress_context__
    assert [f.name for f in __import__("traceback").extract_tb(shown.__traceback__)] == [
        "test_the_innermost_quoted_error_is_the_cause_and_unrelated_context_is_not",
        "_raise_chain",
    ]


def test_the_workbenchs_own_errors_are_never_unwrapped():
    try:
        try:
            raise ValueError("bad value 3")
        except ValueError as e:
            raise ConfigurationError(f"steps must be positive; received: {e}") from None
    except ConfigurationError as error:
        assert tracebacks.readable(error) is error


GRAPH_ERROR = """Graph execution error:

Detected at node while/GatherV2 defined at (most recent call last):
  File "/usr/lib/python3.11/threading.py", line 1002, in _bootstrap

  File "/x/workbench/_src/core/program.py", line 89, in call_step_fn

  File "/tmp/ipykernel_1/2.py", line 6, in step_fn

Detected at node while/replica_1/GatherV2 defined at (most recent call last):
  File "/tmp/ipykernel_1/2.py", line 6, in step_fn

2 root error(s) found.
  (0) INVALID_ARGUMENT:  indices[0] = 12 is not in [0, 10)
\t [[{{node while/GatherV2}}]]
  (1) INVALID_ARGUMENT:  indices[0] = 12 is not in [0, 10)
0 successful operations.
0 derived errors ignored. [Op:__inference__fused_graph_554]"""


def test_tensorflows_runtime_error_texts_give_their_sentence():
    from workbench._src.core.tf_messages import op_error_sentence

    assert op_error_sentence(GRAPH_ERROR) == ("indices[0] = 12 is not in [0, 10)", "while/GatherV2")
    one = "Graph execution error:\n\nDetected at node add defined at (most recent call last):\n"
    one += '  File "a.py", line 1, in f\n\nIncompatible shapes: [3] vs. [4]\n\t [[{{node add}}]] [Op:__inference_f_9]'
    assert op_error_sentence(one) == ("Incompatible shapes: [3] vs. [4]", "add")
    eager = "{{function_node __wrapped__AddV2_device_/job:localhost/replica:0/task:0/device:CPU:0}} Incompatible shapes: [3] vs. [4] [Op:AddV2] name: "
    assert op_error_sentence(eager) == ("Incompatible shapes: [3] vs. [4]", None)
    assert op_error_sentence("name 'x' is not defined") is None
    # An op made inside tf.data (an assertion in a dataset's map) has no Python frames to list.
    data = "Graph execution error:\n\nDetected at node assert/Assert defined at (most recent call last):\n"
    data += "<stack traces unavailable>\nassertion failed: [batch must be 64] [x = ] [32]\n\t [[{{node assert/Assert}}]]"
    assert op_error_sentence(data) == ("assertion failed: [batch must be 64] [x = ] [32]", "assert/Assert")


def test_a_function_sent_by_value_is_named_by_its_file_in_a_workers_traceback(tmp_path):
    # cloudpickle sends a function's code as "<dynamic-code>": what a worker raises from it is
    # named back by the file it came from, with its line, on the sending side.
    import traceback

    import cloudpickle

    from workbench._src.launch.shipping import dumps_for_workers

    path = tmp_path / "experiment.py"
    path.write_text(
        "def build():\n    def step_fn(x):\n        return x * learning_rat\n    return step_fn\n"
    )
    namespace = {"__name__": "experiment_not_importable"}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    shipped = cloudpickle.loads(dumps_for_workers(namespace["build"]()))  # what a worker runs
    with pytest.raises(NameError) as caught:
        shipped(2)
    in_worker = "".join(traceback.format_exception(caught.value))
    assert 'File "<dynamic-code>", line 3, in step_fn' in in_worker, in_worker
    named = tracebacks.frames_named(in_worker)
    assert f'  File "{path}", line 3, in step_fn\n    return x * learning_rat\n' in named, named


def test_a_silent_members_heartbeat_is_shown_only_when_it_was_held(tmp_path):
    # A real faulthandler dump of this process, as a member writes one when the watch finds it
    # silent: a heartbeat thread held outside its sleep (here, on a lock) is shown with where it
    # was; one asleep between beats is not, nor is any other thread, held or not.
    import faulthandler
    import threading
    import time

    held = threading.Lock()

    def asleep():
        def beat():  # (the member's heartbeat thread has this name)
            time.sleep(30)

        return beat

    def blocked():
        def beat():
            with held:
                pass

        return beat

    def stream():  # (another thread of the member, held too: never shown)
        with held:
            pass

    held.acquire()
    try:
        for target in (asleep(), blocked(), stream):
            threading.Thread(target=target, daemon=True).start()
        deadline = time.monotonic() + 60  # (until the held thread is at its lock: a busy machine)
        while True:
            with open(tmp_path / "stacks.txt", "w+") as f:
                faulthandler.dump_traceback(f, all_threads=True)
                f.seek(0)
                shown = tracebacks.heartbeat_stack(f.read())
            if "with held:" in shown or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        held.release()
    assert shown.count("in beat") == 1 and "with held:" in shown, shown
    assert "sleep(30)" not in shown and "in stream" not in shown, shown
