"""Where a process backend's pool runs: local processes (local/) or Ray actors (ray/), both behind
launch/placement.py's `Placement`."""
