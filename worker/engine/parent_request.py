"""n > 1 above the engine core (vLLM's ParentRequest): a request for n samples reaches
the scheduler as n independent requests, and this layer joins them again.

The core (scheduler, runner, sampler) never learns that requests belong together. The
layer hands it the first sample at once and parks the others until the first's prompt
is computed, so they find its prompt blocks in the prefix cache instead of computing
them n times; a request is done when all its samples are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from batchgen.worker.engine.request import EngineRequest, RequestStatus


def sample_id(request_id: str, index: int, n: int) -> str:
    """The core's id of one sample (unique in the core; never parsed back)."""
    return request_id if n == 1 else f"{request_id}#{index}"


@dataclass(slots=True, eq=False)
class ParentRequest:
    """One request as the loop added it, and its samples as the core runs them."""

    request_id: str
    samples: list[EngineRequest]  # n of them; the first's fields are the output's
    parked: list[EngineRequest] = field(default_factory=list)  # not yet in the core

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.samples)

    def take_ready(self) -> list[EngineRequest]:
        """The parked samples, once the first's prompt is computed (or it finished)."""
        first = self.samples[0]
        if not self.parked or not (
            first.is_finished or first.num_computed_tokens >= first.num_prompt_tokens
        ):
            return []
        ready, self.parked = self.parked, []
        return ready


class ParentRequests:
    """The requests in the engine, by their id, and which one each sample is of."""

    def __init__(self) -> None:
        self._by_id: dict[str, ParentRequest] = {}
        self._of_sample: dict[str, ParentRequest] = {}  # sample id -> its request

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[ParentRequest]:
        return iter(list(self._by_id.values()))

    @property
    def num_parked(self) -> int:
        return sum(len(p.parked) for p in self._by_id.values())

    def add(self, parent: ParentRequest, schedule: Callable[[EngineRequest], None]) -> None:
        """Take ``parent`` in: its first sample goes to the core now, the rest wait."""
        self._by_id[parent.request_id] = parent
        for s in parent.samples:
            self._of_sample[s.request_id] = parent
        schedule(parent.samples[0])
        parent.parked = parent.samples[1:]

    def release_parked(self, schedule: Callable[[EngineRequest], None]) -> None:
        """Hand the core every parked sample whose first sample's prompt is computed."""
        for parent in self._by_id.values():
            for s in parent.take_ready():
                schedule(s)

    def finished(self, samples: list[EngineRequest]) -> list[ParentRequest]:
        """The requests that ``samples`` (just finished in the core) completed, taken out."""
        done = []
        for s in samples:
            parent = self._of_sample.get(s.request_id)
            if parent is not None and parent.is_finished:
                done.append(self._remove(parent))
        return done

    def pop(self, request_id: str) -> ParentRequest | None:
        """Take a request out (abort): its parked samples finish without running."""
        parent = self._by_id.get(request_id)
        if parent is None:
            return None
        for s in parent.parked:
            s.status = RequestStatus.FINISHED
        parent.parked = []
        return self._remove(parent)

    def _remove(self, parent: ParentRequest) -> ParentRequest:
        del self._by_id[parent.request_id]
        for s in parent.samples:
            del self._of_sample[s.request_id]
        return parent
