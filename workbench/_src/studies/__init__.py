"""Scaling studies."""
