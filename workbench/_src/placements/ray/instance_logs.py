"""What a local Ray instance's own logs say about its end, read before its folder is removed.

Ray reports a node that ended only as "marked dead because the detector has missed too many
heartbeats" (the GCS's words, whatever the cause). On one machine the cause is in the instance's
logs: the raylet's last error, e.g. that one of its agents (Python processes it fate-shares
with) failed, and then that agent's own last words.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re

# An error line the raylet logs in every start here, harmless: Ray installed without its
# dashboard's extras runs a minimal dashboard agent, which serves no metrics.
_HARMLESS = ("Failed to establish connection to the metrics exporter agent",)
# Ray's words for the agent a raylet ended with (agent_manager.cc).
_FAILED_AGENT = re.compile(r"one Ray agent failed, agent_name = (\w+)")


def raylet_last_error(root: str) -> str:
    """The last error or fatal line the instance's raylet logged under `root`, without Ray's
    prefix (time, level, pids) and cut short; "" when there is none."""
    found = ""
    for path in _logs(root, "raylet.out"):
        with contextlib.suppress(OSError), open(path, errors="replace") as f:
            for line in f:
                # Ray's own format: "[2026-11-27 07:33:49,978 C 4378 4378] (raylet) file.cc:12: text"
                if len(line) > 26 and line.startswith("[") and line[24:26] in (" E", " C", " F"):
                    text = line.split("] ", 1)[-1].removeprefix("(raylet) ").strip()
                    if not any(harmless in text for harmless in _HARMLESS):
                        found = text
    if "Check failed:" in found:  # (a crash: Ray's plea to report a bug comes first, the cause after)
        found = f"{found.split(' ', 1)[0]} {found[found.index('Check failed:') :]}"
    return found[:300]


def instance_end(root: str) -> str:
    """Why the instance under `root` ended, in its own logs' words: its raylet's last error and,
    when that names a failed agent, the agent's last words; "" when the logs say nothing."""
    said = raylet_last_error(root)
    if not said:
        return ""
    agent = _FAILED_AGENT.search(said)
    last = _last_words(root, agent.group(1)) if agent else ""
    return f"its raylet: {said}" + (f"; its {agent.group(1)}: {last}" if last else "")


def _last_words(root: str, agent: str) -> str:
    """The last line an agent wrote to its stderr (a traceback ends with the exception), else the
    last error line of its log."""
    for name, keep in ((f"{agent}.err", lambda line: True), (f"{agent}.log", lambda line: " ERROR " in line)):
        for path in _logs(root, name):
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                lines = [line.strip() for line in f if line.strip() and keep(line)]
            if lines:
                return lines[-1][:300]
    return ""


def _logs(root: str, name: str) -> list[str]:
    return glob.glob(os.path.join(root, "ray", "session_*", "logs", name))
