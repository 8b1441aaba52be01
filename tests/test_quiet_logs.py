"""Quiet logs: on a machine without a GPU, a notebook's first cell and a script show no
TensorFlow start-up noise (absl banner, oneDNN and CUDA-probe lines, `failed call to cuInit`),
unless the user asks for it with WORKBENCH_TF_LOGS=1 (README). `workbench demo`'s quiet run is
checked by tests/test_cli.py, the README's scripts and cells by tests/test_readme.py."""

import os
import subprocess
import sys

import nbformat
import pytest
from helpers import TF_NOISE
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # every test starts a kernel or a process that imports TensorFlow afresh


def first_cell_outputs(tmp_path, env_logs: str | None):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext workbench\nimport workbench as wb\nwb.device_summary()['gpus']")
    ]
    # ipykernel does not capture file descriptor 2 (where TensorFlow's C++ logs go) when it sees
    # PYTEST_CURRENT_TEST; a notebook's kernel does: start this one as a notebook's is started.
    saved = {k: os.environ.pop(k, None) for k in ("WORKBENCH_TF_LOGS", "PYTEST_CURRENT_TEST")}
    if env_logs is not None:
        os.environ["WORKBENCH_TF_LOGS"] = env_logs
    try:
        client = NotebookClient(
            nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        )
        client.execute()
    finally:
        os.environ.pop("WORKBENCH_TF_LOGS", None)
        os.environ.update({k: v for k, v in saved.items() if v is not None})
    return nb.cells[0].outputs


def stderr_text(outputs) -> str:
    return "".join(o.get("text", "") for o in outputs if o.output_type == "stream" and o.name == "stderr")


def test_first_cell_shows_no_error_level_line(tmp_path):
    outputs = first_cell_outputs(tmp_path, None)
    assert not stderr_text(outputs), (
        "the first cell printed to stderr (red in a notebook); received:\n" + stderr_text(outputs)
    )
    assert [o.data["text/plain"] for o in outputs if o.output_type == "execute_result"] == ["[]"]


def test_workbench_tf_logs_brings_tensorflows_logs_back(tmp_path):
    stderr = stderr_text(first_cell_outputs(tmp_path, "1"))
    if not TF_NOISE.search(stderr) and not TF_NOISE.search(_tf_import_stderr()):
        pytest.skip("this TensorFlow prints nothing at start-up here: nothing to bring back")
    assert TF_NOISE.search(stderr), (
        f"WORKBENCH_TF_LOGS=1 showed none of TensorFlow's start-up lines:\n{stderr}"
    )


def _tf_import_stderr() -> str:
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    code = "import tensorflow as tf; tf.config.list_physical_devices('GPU')"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    ).stderr


def test_tensorflow_imported_by_the_user_after_the_workbench_is_quiet_too():
    # The README's order: `import workbench` first, then the user's own `import tensorflow, keras`
    # (not through the workbench's tf()); the first TensorFlow use is the workbench's.
    code = (
        "import workbench as wb\n"
        "import tensorflow as tf, keras\n"
        "repl = wb.replicator('mirrored', num_replicas=2)\n"
        "print(repl.num_replicas, tf.reduce_sum(tf.ones(3)).numpy())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "WORKBENCH_TF_LOGS")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["2", "3.0"]
    assert not done.stderr.strip(), "TensorFlow's start-up lines showed:\n" + done.stderr[-3000:]


def test_many_checkpointing_runs_in_one_process_say_nothing_of_retracing(tmp_path):
    # Each run compiles its checkpoint's save for its own variables; from the 5th such run in a
    # process TensorFlow warned that this code "triggered tf.function retracing", in red. The
    # user's own retraced functions still warn: the last lines make one on purpose.
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import workbench as wb\n"
        "from toy_models import mlp_setup\n"
        "for i in range(7):\n"
        "    wb.replicator('single').train(setup=mlp_setup, steps=30, checkpoint_dir=f'{sys.argv[2]}/c{i}',"
        " checkpoint_every=10)\n"
        "import tensorflow as tf\n"
        "for i in range(7):\n"
        "    tf.function(lambda x: x + 1)(tf.constant(i))\n"
    )
    tests = os.path.dirname(__file__)
    done = subprocess.run(
        [sys.executable, "-c", code, tests, str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    warned = [line for line in done.stderr.splitlines() if "triggered tf.function retracing" in line]
    assert warned and all("<lambda>" in line for line in warned), done.stderr[-3000:]
