"""n > 1 above the engine core: ParentRequests hands the core one sample at a time as an
independent request, parks the rest until the first's prompt is computed, and joins
them when all are done (the engine's own n > 1 tests run it end to end)."""

from __future__ import annotations

from batchgen.worker.engine.parent_request import ParentRequest, ParentRequests, sample_id
from batchgen.worker.engine.request import EngineRequest, RequestStatus
from batchgen.worker.engine.sampling_params import SamplingParams


def parent(request_id: str, n: int, prompt_len: int = 5) -> ParentRequest:
    params = SamplingParams(n=n, temperature=1.0, seed=1)
    samples = [
        EngineRequest(
            sample_id(request_id, i, n),
            list(range(prompt_len)),
            prompt_len,
            params,
            arrival_order=i,
            sample_index=i,
        )
        for i in range(n)
    ]
    return ParentRequest(request_id, samples)


def test_siblings_reach_the_core_once_the_first_prompt_is_computed_and_join_at_the_end():
    requests, core = ParentRequests(), list[EngineRequest]()
    a, b = parent("a", 3), parent("b", 1)
    requests.add(a, core.append)
    requests.add(b, core.append)
    assert [r.request_id for r in core] == ["a#0", "b"]
    assert requests.num_parked == 2 and len(requests) == 2

    a.samples[0].num_computed_tokens = 4  # one prompt token to go
    requests.release_parked(core.append)
    assert [r.request_id for r in core] == ["a#0", "b"]
    a.samples[0].num_computed_tokens = 5
    requests.release_parked(core.append)
    assert [r.request_id for r in core] == ["a#0", "b", "a#1", "a#2"]
    assert requests.num_parked == 0

    for s in (a.samples[0], a.samples[2], b.samples[0]):
        s.status = RequestStatus.FINISHED
    assert [p.request_id for p in requests.finished([a.samples[0], a.samples[2]])] == []
    assert [p.request_id for p in requests.finished([b.samples[0]])] == ["b"]
    a.samples[1].status = RequestStatus.FINISHED
    done = requests.finished([a.samples[1], a.samples[0]])  # two of one request: joined once
    assert [p.request_id for p in done] == ["a"] and done[0].samples == a.samples
    assert len(requests) == 0 and "a" not in requests


def test_an_aborted_request_finishes_its_parked_samples_without_the_core():
    requests, core = ParentRequests(), list[EngineRequest]()
    a = parent("a", 2)
    requests.add(a, core.append)
    popped = requests.pop("a")
    assert popped is a and a.samples[1].status is RequestStatus.FINISHED
    assert a.samples[0].status is RequestStatus.WAITING  # in the core: the engine aborts it
    requests.release_parked(core.append)
    assert [r.request_id for r in core] == ["a#0"] and requests.pop("a") is None


def test_siblings_still_parked_when_the_first_finishes_in_its_prefill_step(toy_model):
    """max_tokens=1: the first sample is done in the step that computes its prompt, so
    the core has no work while its siblings wait; generate must release them, not stall."""
    from batchgen import Engine

    engine = Engine.from_pretrained(toy_model("qwen2"), num_kv_blocks=64)
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=3, n=3, ignore_eos=True)
    out = engine.generate([list(range(3, 40))], params)[0]
    assert [len(s.token_ids) for s in out.samples] == [1, 1, 1]
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == 64
