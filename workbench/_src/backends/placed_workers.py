"""The async-ps worker servers a placement watches for the coordinator (a Ray pool's actors): what
it says of them during a run, and what the run makes of it.

On one host the coordinator starts its servers itself and watches their exits
(placements/local/servers.py). On Ray the servers are actors the launcher placed: it learns of a
death from Ray, starts a new actor at the lost one's address when it can
(placements/ray/replace.py), and says each step of it to the coordinator by its link, as
"placement_news" (launch/runtime.py): a worker "lost" (with whether a new one comes), "replaced"
(its server listens again) or "dropped" (it will not come back in this run, and why). The
coordinator's executor (async_coordinator.py) reads it here once per poll, so its `workers`
column drops at once and rises when the new server answers, and it records the heal as it does
for a local replacement.
"""

from __future__ import annotations

import time

from workbench._src.launch.runtime import placement_news


class PlacedWorkers:
    """The worker servers lost in this run and not back yet, from the placement's news."""

    def __init__(self):
        self.lost: dict[int, dict] = {}  # worker index -> its "lost" news, the step and time it was heard
        self.heard: set[int] = set()  # the news' numbers taken (one sent again is taken once)
        placement_news()  # (what is left is an ended run's: not this one's)

    def gone(self) -> set[str]:
        return {f"worker {index}" for index in self.lost}

    def latest_loss(self) -> float | None:
        """When the newest loss of a worker still gone was heard (None: none is)."""
        return max((loss["heard"] for loss in self.lost.values()), default=None)

    def coming(self) -> bool:
        """Whether a lost worker's replacement is still on its way."""
        return any(loss.get("replacing") for loss in self.lost.values())

    def read(self, run, live) -> list[dict]:
        """Takes the news since the last call: says each loss and drop in one line (`live()`: the
        workers left, once the news is counted) and returns the replacements that answered, each
        as {index, cause, lost_at, seconds, process} for the heal's record."""
        answered = []
        for news in placement_news():
            index, kind = news["index"], news["kind"]
            if news["number"] in self.heard:
                continue
            self.heard.add(news["number"])
            if kind == "lost":
                self.lost[index] = {**news, "step": run.steps, "heard": time.monotonic()}
                then = (
                    f"a new worker {index} starts in its Ray bundle, at {news['address']}"
                    if news["replacing"]
                    else news["why"]
                )
                run.publish(
                    "message",
                    text=f"worker {index} ({news['where']}) {news['described']} at step {run.steps}; {live()} "
                    f"worker(s) left: the coordinator runs its unfinished steps on the other workers; {then}",
                    worker_lost=index,
                )
            elif kind == "replaced" and index in self.lost:
                loss = self.lost.pop(index)
                answered.append(
                    {
                        "index": index,
                        "cause": loss["cause"],
                        "lost_at": loss["step"],
                        "seconds": news["seconds"],
                        "process": news["process"],
                    }
                )
            elif kind == "dropped" and index in self.lost:
                self.lost[index]["replacing"] = False
                run.publish(
                    "message",
                    text=f"the new worker {index} could not take the lost one's place: {news['why']}; the "
                    f"run goes on with {live()} worker(s)",
                )
        return answered
