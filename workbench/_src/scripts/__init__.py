"""The command line's jobs: `workbench run`, `workbench scale`, `workbench demo`."""
