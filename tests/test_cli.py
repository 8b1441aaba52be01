"""The README's main job: `workbench demo` trains, prints a summary and writes a plot."""

import subprocess


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
