"""The core: the Replicator, its programs, the run loop, the Run and what they share."""
