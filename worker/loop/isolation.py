"""Requests that must run alone: bisection halves and last-chance suspects.

- An exception in an engine step (a bug, an out-of-memory) bisects the batch:
  the engine drops its requests, and the in-flight set runs again in two
  halves, one after the other, each halved again if it fails, so its
  batch-mates finish uncharged. When a step with one request fails, that
  request is the culprit.
- A crash cannot be bisected (the process is gone; the next delivery counts it
  against every request that was running). A request on its last allowed
  attempt runs alone, so a poison request is dead-lettered by itself. A worker
  holds one such suspect at a time: the others are handed straight back,
  uncharged, so a crash while the one runs alone is charged to that one only.

While a set runs or waits here nothing else is admitted or reclaimed beside it.
"""

from __future__ import annotations

from collections.abc import Callable

from batchgen.worker.consumer.queue import Delivery, HandBack


class Isolation:
    def __init__(self) -> None:
        self.waiting: list[list[Delivery]] = []  # sets to run alone, in turn
        self.running: set[str] = set()  # entry ids of the set running alone now
        self.bisected: set[str] = set()  # entry ids that ran here before a failed step

    @property
    def busy(self) -> bool:
        """A set runs or waits: admit nothing beside it."""
        return bool(self.waiting or self.running)

    def suspects(self, deliveries: list[Delivery]) -> list[Delivery]:
        """Keep one last-chance suspect to run alone; the others, to hand back as they came.

        They did not run here, so neither their attempts nor their failures
        grow; the next worker to read one finds it still on its last chance.
        """
        if not self.busy:
            self.waiting.append([deliveries[0]])
            return deliveries[1:]
        return deliveries

    def wait_alone(self, deliveries: list[Delivery]) -> None:
        """Suspects that could not be handed back: run each alone here, in turn."""
        self.waiting += [[d] for d in deliveries]

    def bisect(self, deliveries: list[Delivery]) -> None:
        """A step over ``deliveries`` failed: run them again in two halves, first of all."""
        self.bisected.update(d.entry_id for d in deliveries)
        self.running.clear()
        half = len(deliveries) // 2
        self.waiting[:0] = [deliveries[:half], deliveries[half:]]

    def next_set(self) -> list[Delivery]:
        return self.waiting.pop(0) if self.waiting else []

    def started(self, entry_id: str) -> None:
        self.running.add(entry_id)

    def forget(self, entry_id: str) -> None:
        """The request finished or left: it no longer runs alone."""
        self.running.discard(entry_id)
        self.bisected.discard(entry_id)

    def remove(self, keep: Callable[[Delivery], bool]) -> list[str]:
        """Drop waiting deliveries ``keep`` refuses; their entry ids."""
        gone = [d.entry_id for group in self.waiting for d in group if not keep(d)]
        self.waiting = [g for g in ([d for d in group if keep(d)] for group in self.waiting) if g]
        return gone

    def held(self) -> list[str]:
        return [d.entry_id for group in self.waiting for d in group]

    def hand_backs(self) -> list[HandBack]:
        """Shutdown: a bisection half ran here (handed back gracefully); a suspect never started."""
        items = [
            HandBack(d, list(d.resume), ran=d.entry_id in self.bisected)
            for group in self.waiting
            for d in group
        ]
        self.waiting.clear()
        return items
