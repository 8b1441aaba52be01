#!/usr/bin/env bash
# The test suite on a busy machine, as issue 39 asks: CI's own steps (`pip install -e ".[test]"`,
# `python -m pytest -n 3`, verbose) on a fresh clone of COMMIT, RUNS times in a row, with two
# TensorFlow jobs of this script's own keeping the cores busy beside it. Each run's output goes to
# LOGS/run-N.log, its result to LOGS/summary.txt, the load and the jobs' share of the CPU every
# 30 s to LOGS/load.txt.
#
#   bench/suite_loaded.sh COMMIT [RUNS] [LOGS]      # e.g. bench/suite_loaded.sh HEAD 2
#
# The jobs run each in a session of its own, as another user's jobs do. (Linux shares the CPU
# between sessions first (autogroups): jobs started in the suite's own session would instead
# compete with the suite's test processes thread by thread, and starve the Ray actors there, which
# Ray starts at nice 15: load.txt then gave the jobs 80-97% of the CPU time.)
#
# Ends only what it started: the jobs by pid, a suite's run by its process group. Ended early (its
# pid killed, Ctrl-C), it ends the jobs and the run in progress. Each run installs its clone (the
# editable install then points there): run nothing else from this environment meanwhile.
set -u
commit=$(git -C "$(dirname "$0")/.." rev-parse "${1:?a commit}")
runs=${2:-2}
logs=${3:-/tmp/suite-loaded-$commit}
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$logs"
busy='import os; os.setsid()
import tensorflow as tf
x = tf.random.normal([512, 512])
while True:
    for _ in range(50):
        x = tf.tanh(tf.matmul(x, x) * 1e-3)
    x.numpy()'
TF_CPP_MIN_LOG_LEVEL=3 python -c "$busy" > /dev/null 2>&1 & job1=$!
TF_CPP_MIN_LOG_LEVEL=3 python -c "$busy" > /dev/null 2>&1 & job2=$!
set -m  # (from here each background job is a process group of its own: a suite's run is ended whole)
# Every 30 s: the load, and the share of the machine's CPU time the two jobs took meanwhile (the
# suite has the rest): the load alone does not say how starved the suite was.
jobs_ticks() { cat /proc/$job1/stat /proc/$job2/stat 2>/dev/null | awk '{s += $14 + $15} END {print s + 0}'; }
all_ticks() { awk '/^cpu /{s = 0; for (i = 2; i <= NF; i++) s += $i; print s}' /proc/stat; }
( j=$(jobs_ticks); a=$(all_ticks)
  while sleep 30; do
    j2=$(jobs_ticks); a2=$(all_ticks)
    echo "$(date +%H:%M:%S) $(cut -d' ' -f1-3 /proc/loadavg) jobs $(( 100 * (j2 - j) / (a2 - a + 1) ))% of the CPU"
    j=$j2; a=$a2
  done ) > "$logs/load.txt" & logger=$!
suite=""
trap 'kill $job1 $job2 $logger 2>/dev/null; [ -n "$suite" ] && kill -TERM -- -"$suite" 2>/dev/null' EXIT
trap 'exit 130' INT TERM
for i in $(seq 1 "$runs"); do
  clone="$logs/clone-$i"
  rm -rf "$clone" && git clone -q "$repo" "$clone" && git -C "$clone" checkout -q "$commit"
  began=$(date +%s)
  # (-v: each test's outcome as it ends, so that a run stopped early still names its failures)
  ( cd "$clone" && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 pip install -q -e ".[test]" && PYTEST_ADDOPTS=-v python -m pytest -n 3 ) > "$logs/run-$i.log" 2>&1 &
  suite=$!
  wait "$suite"; status=$?
  suite=""
  echo "run $i of $commit: exit $status after $(( $(date +%s) - began )) s; $(tail -1 "$logs/run-$i.log")" >> "$logs/summary.txt"
done
cat "$logs/summary.txt"
