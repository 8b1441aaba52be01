"""The command line: `workbench demo` (the README's main job) and `workbench scale FILE.py`."""

import os
import subprocess

import pandas as pd


def test_workbench_demo_prints_a_summary_and_writes_the_plot(tmp_path):
    png = tmp_path / "demo.png"
    out = subprocess.run(
        ["workbench", "demo", "--replicas", "2", "--steps", "120", "--out", str(png)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "backend        : mirrored, 2 replicas, global batch 128" in out.stdout
    assert "steps          : 120 in" in out.stdout
    accuracy = float(out.stdout.split("test accuracy  : ")[1].split()[0])
    assert accuracy > 0.8  # 120 Adam steps on digits learn something real
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_cli_usage_error_is_clear():
    out = subprocess.run(["workbench", "fly"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "invalid choice: 'fly'" in out.stderr


TOY_SCRIPT = os.path.join(os.path.dirname(__file__), "data", "toy_train.py")


def test_workbench_scale_studies_a_script_and_writes_figure_and_table(tmp_path):
    png, csv = tmp_path / "study.png", tmp_path / "study.csv"
    args = ["--replicas", "1,2", "--steps", "10", "--warmup", "3", "--out", str(png), "--csv", str(csv)]
    out = subprocess.run(
        ["workbench", "scale", TOY_SCRIPT, *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    table = pd.read_csv(csv)
    assert list(table["replicas"]) == [1, 2] and list(table["global_batch"]) == [32, 64]
    assert list(table["steps"]) == [10, 10] and table["efficiency"].notna().all()
    assert f"figure: {png}" in out.stdout and "note: 2 virtual CPU device(s) share" in out.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_workbench_scale_bad_input_says_what_and_how():
    out = subprocess.run(
        ["workbench", "scale", TOY_SCRIPT, "--replicas", "1,two"], capture_output=True, text=True, timeout=60
    )
    # the same declaration and message as %replicate --scaling 1,two (workbench/_src/options.py)
    assert out.returncode == 2 and "--replicas" in out.stderr
    assert "expected replica counts separated by commas, such as 1,2,4,8; received '1,two'" in out.stderr
    out = subprocess.run(["workbench", "scale", "missing.py"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no such file: 'missing.py'" in out.stderr
