"""Private implementation; the public face is `workbench/__init__.py`."""
