"""The notebook face: `%replicate`, the panel, the session's replicator."""
