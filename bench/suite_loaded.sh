#!/usr/bin/env bash
# The test suite on a busy machine, as issue 39 asks: CI's own steps (`pip install -e ".[test]"`,
# `python -m pytest -n 3`) on a fresh clone of COMMIT, RUNS times in a row, with two TensorFlow
# jobs of this script's own keeping the cores busy beside it. Each run's output goes to
# LOGS/run-N.log, its result to LOGS/summary.txt, the load every 30 s to LOGS/load.txt.
#
#   bench/suite_loaded.sh COMMIT [RUNS] [LOGS]      # e.g. bench/suite_loaded.sh HEAD 2
#
# Ends only what it started, by pid. Each run installs its clone (the editable install then
# points there): run nothing else from this environment meanwhile.
set -u
commit=$(git -C "$(dirname "$0")/.." rev-parse "${1:?a commit}")
runs=${2:-2}
logs=${3:-/tmp/suite-loaded-$commit}
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$logs"
busy='import tensorflow as tf
x = tf.random.normal([512, 512])
while True:
    for _ in range(50):
        x = tf.tanh(tf.matmul(x, x) * 1e-3)
    x.numpy()'
TF_CPP_MIN_LOG_LEVEL=3 python -c "$busy" > /dev/null 2>&1 & job1=$!
TF_CPP_MIN_LOG_LEVEL=3 python -c "$busy" > /dev/null 2>&1 & job2=$!
( while true; do echo "$(date +%H:%M:%S) $(cut -d' ' -f1-3 /proc/loadavg)"; sleep 30; done ) > "$logs/load.txt" & logger=$!
trap 'kill $job1 $job2 $logger 2>/dev/null' EXIT
for i in $(seq 1 "$runs"); do
  clone="$logs/clone-$i"
  rm -rf "$clone" && git clone -q "$repo" "$clone" && git -C "$clone" checkout -q "$commit"
  began=$(date +%s)
  ( cd "$clone" && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 pip install -q -e ".[test]" && python -m pytest -n 3 ) > "$logs/run-$i.log" 2>&1
  echo "run $i of $commit: exit $? after $(( $(date +%s) - began )) s; $(tail -1 "$logs/run-$i.log")" >> "$logs/summary.txt"
done
cat "$logs/summary.txt"
