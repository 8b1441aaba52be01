"""Matplotlib figures: the run figure and the scaling figure."""
