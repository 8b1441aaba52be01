"""The local placement: processes on this machine, in a private loopback-only network."""
