"""The sentence inside TensorFlow's runtime error texts.

An op that fails while a compiled step runs raises an OpError whose message starts with
"Graph execution error:", then lists, once per replica, where the op was defined ("Detected at
node ... defined at (most recent call last):" and a frame per line, the workbench's and
TensorFlow's included), then "N root error(s) found. (0) INVALID_ARGUMENT: <the sentence>"
or the sentence alone, followed by "[[{{node ...}}]]" and "[Op:__inference_...]". An op that
fails eagerly starts with "{{function_node __wrapped__...}}". Plain strings in, plain strings
out: no TensorFlow import (the error's class is TensorFlow's, its text is all we read).
"""

from __future__ import annotations

import re

GRAPH_WRAPPER = "Graph execution error:"
NO_STACK = "<stack traces unavailable>"  # the listing of an op defined where Python had no frames
_DEFINED_AT = re.compile(r"^Detected at node (?P<node>\S+) defined at \(most recent call last\):")
_ROOT_ERROR = re.compile(r"^\s*\(0\) [A-Z_]+:\s+(?P<sentence>.+)$")
_FUNCTION_NODE = re.compile(r"^\{\{function_node [^}]*\}\}\s*")
_OP_SUFFIX = re.compile(r"\s*\[Op:[^\]]*\](\s*name:\s*\S*)?\s*$")


def op_error_sentence(text: str) -> tuple[str, str | None] | None:
    """(the sentence, the node it was detected at or None) of a TensorFlow runtime error text;
    None when `text` is not one (or already is its sentence)."""
    lines = text.strip().splitlines()
    if not lines:
        return None
    if not lines[0].startswith(GRAPH_WRAPPER):
        first = _OP_SUFFIX.sub("", _FUNCTION_NODE.sub("", lines[0])).strip()
        return (first, None) if first and first != lines[0].strip() else None
    node, rest = None, []
    listing = False
    for line in lines[1:]:
        defined = _DEFINED_AT.match(line)
        if defined:  # a replica's listing of where the op was defined: until its last frame
            node, listing = node or defined["node"], True  # (the first replica's node)
        elif listing and (not line.strip() or line.startswith("  File ") or line.strip() == NO_STACK):
            continue  # (an op made inside tf.data has no Python frames: TensorFlow says so)
        else:
            listing = False
            rest.append(line)
    for line in rest:
        root = _ROOT_ERROR.match(line)
        if root:
            return _OP_SUFFIX.sub("", root["sentence"]).strip(), node
    sentences = [
        line
        for line in rest
        if line.strip() and not line.lstrip().startswith("[[") and line.strip() != NO_STACK
    ]
    if not sentences or re.match(r"^\d+ root error", sentences[0]):
        return None
    return _OP_SUFFIX.sub("", sentences[0]).strip(), node


def unhealthy_task(text: str) -> str | None:
    """The task TensorFlow's coordination service reports as no longer sending heartbeats
    ("... unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1"), as "worker:1"."""
    found = re.search(r"stopped sending heartbeats\):\s*/job:(\w+)/replica:\d+/task:(\d+)", text)
    return f"{found.group(1)}:{found.group(2)}" if found else None
