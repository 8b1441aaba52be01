"""The README runs as written: every code block, top to bottom, as a new user would try it.

- Python blocks whose first line is not a magic run as scripts, each in its own `python` process.
- Blocks whose first line is a magic (`%load_ext`, `%replicate`, `%%replicate`) are notebook
  cells: they run one after another in one real kernel (nbclient, kernel python3), as pasted.
- Bash blocks run in a shell when every line is a cheap `workbench run/scale examples/...`
  command; the others are in NOT_RUN with the reason (and what checks them instead).

A block that fits none of these fails `test_every_block_is_run_or_says_why_not`, so a new block
cannot slip in untested. Everything runs in a temporary folder (holding a link to the
repository's examples/, so the commands run as written) with a private, empty TMPDIR that must
be empty again afterwards: the README's runs leave nothing behind.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from helpers import TF_NOISE
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from traitlets import Float

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


# Bash blocks not run here, by a line they hold: why, and what checks them instead.
NOT_RUN = {
    "pip install -e . && workbench demo": "installs the package; `workbench demo` is tests/test_cli.py's (run "
    "as here, from an empty folder that it leaves empty)",
    'pip install -e ".[test]" && python -m pytest -n 3': "the test command itself (.ci/run runs it; "
    "test_ci_runs_the_readmes_test_command checks they agree)",
    'python -m pytest -m "not slow"': "the fast lane: the tests themselves",
    "--cluster TF_CONFIG": "needs two hosts named gpu-a and gpu-b",
    "ray start --head": "needs two hosts; tests/test_ray.py makes a two-node Ray cluster in network namespaces",
    "scontrol requeue": "needs a Slurm cluster; tests/test_heal.py preempts `workbench run` and runs the "
    "same command again",
}
CHEAP_COMMAND = re.compile(r"^workbench (run|scale) examples/\S+\.py( |$)")


def readme_blocks(text: str | None = None) -> list[dict]:
    """The fenced code blocks of the README: language, source and the line the source starts on."""
    text = README.read_text() if text is None else text
    blocks = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S):
        line = text.count("\n", 0, match.start(2)) + 1
        blocks.append({"lang": match.group(1), "source": match.group(2), "line": line})
    return blocks


def kind(block: dict) -> str:
    """'script', 'cell' (notebook), 'bash' (run), 'not run: why', or 'unknown: why'."""
    lines = [ln for ln in block["source"].splitlines() if ln.strip()]
    if block["lang"] == "python":
        return "cell" if lines and lines[0].startswith("%") else "script"
    if block["lang"] == "bash":
        for marker, why in NOT_RUN.items():
            if marker in block["source"]:
                return f"not run: {why}"
        commands = [ln for ln in lines if not ln.lstrip().startswith("#")]
        if commands and all(CHEAP_COMMAND.match(ln) for ln in commands):
            return "bash"
        return (
            "unknown: a bash block that is neither a cheap `workbench run/scale examples/...` nor in NOT_RUN"
        )
    return f"unknown: a block in language {block['lang']!r} (give it python or bash)"


def blocks_of(wanted: str) -> list[dict]:
    return [b for b in readme_blocks() if kind(b) == wanted]


def block_id(block: dict) -> str:
    return f"README.md:{block['line']}"


class PatientKernelManager(AsyncKernelManager):
    """Lets the kernel end on its own when the notebook is done, as a user's does. jupyter_client
    kills it after 5 s; a kernel that used TensorFlow exits in a second or two, but a loaded
    machine stretches that, and a killed kernel leaves its AutoGraph files in TMPDIR."""

    shutdown_wait_time = Float(120.0)


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """A working folder as on a fresh clone (examples/ beside it), with a private TMPDIR that must
    be empty when the test ends, and runs recorded in the folder (not the repository's runs/)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    monkeypatch.setenv("WORKBENCH_RUNS_DIR", str(work / "runs"))
    for name in ("TF_CPP_MIN_LOG_LEVEL", "WORKBENCH_TF_LOGS"):  # as a user's shell has them
        monkeypatch.delenv(name, raising=False)
    yield work
    left = sorted(str(p.relative_to(private_tmp)) for p in private_tmp.rglob("*"))
    assert not left, f"the README's block left {len(left)} file(s) in its TMPDIR: {left[:10]}"


def test_every_block_is_run_or_says_why_not():
    blocks = readme_blocks()
    unknown = [f"{block_id(b)} {kind(b)}" for b in blocks if kind(b).startswith("unknown")]
    assert not unknown, "\n".join(unknown)
    kinds = [kind(b) for b in blocks]
    assert kinds.count("script") >= 2 and kinds.count("cell") >= 4 and kinds.count("bash") >= 1, kinds


def test_ci_runs_the_readmes_test_command():
    (test_block,) = [
        b for b in readme_blocks() if 'pip install -e ".[test]" && python -m pytest' in b["source"]
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    for line in test_block["source"].splitlines():
        command = line.split("#", 1)[0].strip()
        if command.startswith("apt-get"):
            assert "apt-get update" in ci and "apt-get install -y -qq chromium" in ci  # same, quietly
        elif command:
            assert command in ci.splitlines(), f".ci/run does not run the README's {command!r}"


def test_the_examples_the_help_and_the_readme_name_exist():
    help_text = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "run", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    assert "workbench run examples/train.py --backend multi-worker --workers 2" in help_text
    named = set(re.findall(r"workbench (?:run|scale) (\S+\.py)", README.read_text() + help_text))
    assert named == {"examples/train.py"}, named
    assert (ROOT / "examples" / "train.py").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("block", blocks_of("script"), ids=block_id)
def test_python_block_runs_as_a_script(block, user_folder):
    script = user_folder / f"readme_line_{block['line']}.py"
    script.write_text(block["source"])
    done = subprocess.run(
        [sys.executable, script.name], cwd=user_folder, capture_output=True, text=True, timeout=900
    )
    where = f"{block_id(block)} (a Python block, run as a script) "
    assert done.returncode == 0, where + f"failed:\n{done.stderr[-4000:]}"
    assert done.stdout.strip(), where + "printed nothing"
    assert not TF_NOISE.search(done.stderr), (
        where + f"printed TensorFlow's start-up lines:\n{done.stderr[-3000:]}"
    )


@pytest.mark.slow
def test_notebook_blocks_run_in_one_kernel(user_folder):
    cells = blocks_of("cell")
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(b["source"]) for b in cells]
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(user_folder)}},
        kernel_manager_class=PatientKernelManager,
    )  # fmt: skip
    with client.setup_kernel():
        for index, (cell, block) in enumerate(zip(nb.cells, cells)):
            failure = None
            try:
                client.execute_cell(cell, index)
            except CellExecutionError as error:
                failure = f"{block_id(block)} (a notebook cell) failed:\n{error}"
            if failure:  # (outside the except: the message alone, without nbclient's traceback)
                pytest.fail(failure, pytrace=False)
            stderr = "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stderr")
            assert not TF_NOISE.search(stderr), (
                f"{block_id(block)} printed TensorFlow's start-up lines:\n{stderr}"
            )
    results = [
        "".join(
            o.get("data", {}).get("text/plain", "") for o in c.outputs if o.output_type == "execute_result"
        )
        for c in nb.cells
    ]
    assert sum("<wb.Run" in r and "finished" in r for r in results) >= 2, results  # the training cells


def test_the_bash_blocks_run_multi_worker_and_async_ps():
    """The bash test below is also the check that a finished multi-worker and a finished async-ps
    `workbench run` leave their TMPDIR empty (tests/test_nothing_left_behind.py has the failed run):
    the README must keep both commands in a block that it runs."""
    commands = [line for block in blocks_of("bash") for line in block["source"].splitlines()]
    for backend in ("--backend multi-worker --workers 2", "--backend async-ps --workers 2 --ps 1"):
        assert any(f"workbench run examples/train.py {backend}" in line for line in commands), backend


def option(words: list[str], flag: str) -> str | None:
    """The value given to `flag` in a command's words, or None when the flag is not there."""
    return words[words.index(flag) + 1] if flag in words else None


@pytest.mark.slow
@pytest.mark.parametrize("block", blocks_of("bash"), ids=block_id)
def test_cheap_bash_block_runs_as_written(block, user_folder):
    # As written, but what it writes under /tmp goes to a folder of this test's own: the machine's
    # /tmp is not the test's (a suite run left /tmp/workbench-results/history.csv behind).
    machine_tmp = user_folder.parent / "machine-tmp"
    source = block["source"].replace("/tmp/", f"{machine_tmp}/")
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", source],
        cwd=user_folder,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"{block_id(block)} (bash) failed:\n{done.stderr[-4000:]}"
    # Quiet: neither TensorFlow's start-up lines nor (`--cluster ray=local`) Ray's reach the user.
    assert done.stderr.strip() == "", f"{block_id(block)} printed to stderr:\n{done.stderr[-4000:]}"
    commands = [shlex.split(line, comments=True) for line in source.splitlines()]
    commands = [words for words in commands if words]
    for words in commands:  # files the commands were asked to write
        for flag in ("--history", "--csv", "--out"):
            if option(words, flag):
                assert (user_folder / option(words, flag)).is_file(), words
    # Every `workbench run` ends with its one-line JSON summary (the last of its stdout), and
    # trains what it was asked: one history row per step, from step 1, and a loss that falls.
    runs = [words for words in commands if words[:2] == ["workbench", "run"]]
    summaries = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"run"')]
    assert len(summaries) == len(runs), done.stdout[-3000:]
    for words, summary in zip(runs, summaries):
        assert summary["status"] == "finished", (words, summary)
        if not option(words, "--steps"):
            continue
        steps = int(option(words, "--steps"))
        assert summary["steps"] == steps, (words, summary)
        if option(words, "--history"):
            history = pd.read_csv(user_folder / option(words, "--history"))
            assert list(history["step"]) == list(range(1, steps + 1)), words
            assert history["loss"].iloc[-10:].mean() < history["loss"].iloc[:10].mean(), words
