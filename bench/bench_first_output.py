"""Seconds from a command's (or a cell's) start to the first text it shows, and its longest silence.

Run: python bench/bench_first_output.py [--only demo,multi-worker,async-ps,scale,cell]

Issue 41 asks for something on screen within 2 s of every command or cell that takes longer. This
measures, on this machine, the README's commands and a `%%replicate` cell in a real kernel:
  demo          `workbench demo` (its plot into this bench's temporary folder: --out)
  multi-worker  `workbench run examples/train.py --backend multi-worker --workers 2 --steps 100`
  async-ps      `workbench run examples/train.py --backend async-ps --workers 2 --ps 1 --steps 100`
  scale         `workbench scale examples/train.py --replicas 1,2,4,8 --mode weak --batch-size 32`
  cell          a fresh kernel (jupyter_client): `%load_ext workbench`, then a `%%replicate` cell
                (mirrored x2, 300 steps: the kernel's first TensorFlow import is in it)
Each command runs to its end in a pseudo-terminal (as in a user's shell: line-buffered, the
progress bar as a terminal shows it); every chunk of output is timed as it arrives. A cell's
first text is its first output (stream, display data, a result); its silences are between any two
updates the frontend shows (display updates, widget state updates: the dashboard's header). Printed per item: the seconds to the first text,
the longest silence before the command ended (and the text it followed), the total, and the load
average before and after. Timing is never a pass/fail test: a loaded machine stretches every
figure (at a load of 10 on 2 cores, a Python start alone takes ~1 s).
"""

from __future__ import annotations

import argparse
import os
import pty
import select
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")
sys.path.insert(0, os.path.join(ROOT, "tests"))
from notebook_toy import TOY_CELL as TOY_BODY  # noqa: E402 - the notebook tests' toy cell

TOY_CELL = "%%replicate --backend mirrored --replicas 2 --steps 300" + TOY_BODY


def commands(folder: str) -> dict[str, list[str]]:
    workbench = [sys.executable, "-m", "workbench.cli"]
    return {
        "demo": [*workbench, "demo", "--out", os.path.join(folder, "demo.png")],
        "multi-worker": [
            *workbench, "run", TRAIN, "--backend", "multi-worker", "--workers", "2", "--steps", "100",
            "--history", os.path.join(folder, "history.csv"),
        ],
        "async-ps": [*workbench, "run", TRAIN, "--backend", "async-ps", "--workers", "2", "--ps", "1", "--steps", "100"],
        "scale": [
            *workbench, "scale", TRAIN, "--replicas", "1,2,4,8", "--mode", "weak", "--batch-size", "32",
            "--csv", os.path.join(folder, "study.csv"),
        ],
    }  # fmt: skip


def time_command(argv: list[str], cwd: str) -> dict:
    """Runs `argv` in a pseudo-terminal to its end: (seconds, text) of each output chunk."""
    leader, follower = pty.openpty()
    start = time.monotonic()
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, cwd=cwd)
    os.close(follower)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    data = os.read(leader, 65536)
                except OSError:  # the terminal closed: the command has ended
                    break
                if not data:
                    break
                chunks.append((time.monotonic() - start, data.decode(errors="replace")))
            elif process.poll() is not None:
                break
        process.wait(timeout=600)
    finally:
        if process.poll() is None:  # (interrupted: Ctrl-C, so the command ends what it started)
            process.send_signal(2)
            process.wait(timeout=120)
        os.close(leader)
    return _figures(chunks, time.monotonic() - start, process.returncode)


def time_cell() -> list[tuple[str, dict]]:
    """A fresh kernel: `%load_ext workbench`, then the %%replicate cell; each timed from its
    execute request to each output message the frontend would show."""
    from jupyter_client.manager import start_new_kernel

    shown = {"stream", "display_data", "update_display_data", "execute_result", "error", "comm_msg"}
    manager, client = start_new_kernel(kernel_name="python3")
    out = []
    try:
        for name, code in (
            ("cell: %load_ext workbench", "%load_ext workbench"),
            ("cell: %%replicate", TOY_CELL),
        ):
            chunks, start = [], time.monotonic()
            msg_id = client.execute(code)
            while True:
                msg = client.get_iopub_msg(timeout=600)
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "status" and content["execution_state"] == "idle":
                    break
                if kind in shown:
                    data = content.get("data") or {}
                    text = content.get("text") or data.get("text/plain") or str(data.get("state", "")) or kind
                    chunks.append((time.monotonic() - start, text, kind != "comm_msg"))
            # The first text: the first output the cell shows (a widget's state updates before
            # its view is displayed show nothing); silences: between any two updates.
            first = next((c for c in chunks if c[2]), None)
            result = _figures([c[:2] for c in chunks], time.monotonic() - start, 0)
            result.update(first_s=first and first[0], first_text=_line(first[1]) if first else "")
            out.append((name, result))
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return out


def _figures(chunks: list[tuple[float, str]], total: float, returncode) -> dict:
    first = chunks[0] if chunks else (None, "")
    shown, text = [], ""
    for at, chunk in chunks:  # (each silence follows the last line shown: a chunk may be a bare newline)
        text = _line(chunk) or text
        shown.append((at, text))
    chunks = shown
    gaps = [(b[0] - a[0], a[1]) for a, b in zip(chunks, chunks[1:])]
    if chunks:
        gaps.append((total - chunks[-1][0], chunks[-1][1]))
    silence = max(gaps, default=(None, ""))
    return {
        "first_s": first[0],
        "first_text": _line(first[1]),
        "silence_s": silence[0],
        "silence_after": _line(silence[1]),
        "total_s": total,
        "returncode": returncode,
    }


def _line(text: str) -> str:
    lines = [ln.strip() for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:90]


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", default="demo,multi-worker,async-ps,scale,cell", help="items, comma-separated"
    )
    wanted = parser.parse_args().only.split(",")
    folder = tempfile.mkdtemp(prefix="bench-first-output-")
    # The commands' runs and files in the temporary folder, removed at the end.
    os.environ["WORKBENCH_RUNS_DIR"] = os.path.join(folder, "runs")
    print(f"{'item':28} {'first text':>10} {'silence':>8} {'total':>7}  load (1/5/15 min) before -> after")
    try:
        items = [(name, argv) for name, argv in commands(folder).items() if name in wanted]
        for name, argv in items:
            before = _load()
            result = time_command(argv, cwd=folder)
            _report(name, result, before)
        if "cell" in wanted:
            before = _load()
            for name, result in time_cell():
                _report(name, result, before)
                before = _load()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _report(name: str, r: dict, before: str) -> None:
    def s(x):
        return "-" if x is None else f"{x:.1f} s"

    status = "" if r["returncode"] == 0 else f" (exit {r['returncode']})"
    print(
        f"{name:28} {s(r['first_s']):>10} {s(r['silence_s']):>8} {s(r['total_s']):>7}  {before} -> {_load()}{status}"
    )
    print(f"{'':28} first: {r['first_text']!r}")
    print(f"{'':28} longest silence after: {r['silence_after']!r}", flush=True)


if __name__ == "__main__":
    main()
