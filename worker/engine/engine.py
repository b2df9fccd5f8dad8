"""The engine: requests in, finished outputs out, one scheduling step at a time.

    schedule -> run model -> sample -> update (stop checks, detokenize)

It knows nothing of Redis: the queue loop calls add_request / step / abort
and takes finished outputs back; ``generate`` does the same for a list.
Embedding requests (``add_embedding``, ``embed``) share the steps: their
prompts are computed like any prefill, pooled, and never decode.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Sequence
from typing import Any

from batchgen.jobs.schema.constraints import StructuredOutput
from batchgen.jobs.schema.reasoning import ReasoningParser
from batchgen.worker.engine.admission import Capacity, check_fits
from batchgen.worker.engine.block_manager import BlockManager
from batchgen.worker.engine.constrained import AnswerGate, Grammars
from batchgen.worker.engine.detokenizer import StopStringMatcher
from batchgen.worker.engine.kv_window import SlidingRelease
from batchgen.worker.engine.outputs import EngineStats, build_output
from batchgen.worker.engine.parent_request import ParentRequest, ParentRequests, sample_id
from batchgen.worker.engine.prompt_text import PromptText
from batchgen.worker.engine.request import (
    EmbedTask,
    EngineFinishReason,
    EngineRequest,
    RequestOutput,
)
from batchgen.worker.engine.runner.loading import EngineLimits, build_engine
from batchgen.worker.engine.runner.model_runner import ModelRunner
from batchgen.worker.engine.sampling_params import SamplingParams
from batchgen.worker.engine.scheduler import Scheduler
from batchgen.worker.engine.stopping import stop_reason
from batchgen.worker.engine_config import EngineConfig
from batchgen.worker.worker_errors import GrammarError, RequestRejected

_EMBED_PARAMS = SamplingParams(max_tokens=1)  # an embedding request's (never sampled)


class Engine:
    """Build with ``Engine.from_pretrained(path, **settings)`` (settings: ``EngineConfig``)."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any,
        limits: EngineLimits,
        eos_token_ids: tuple[int, ...],
        enable_prefix_caching: bool = True,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.text = PromptText(tokenizer)
        self.limits = limits
        self.max_model_len = limits.max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_manager = BlockManager(
            limits.num_kv_blocks, limits.block_size, enable_prefix_caching
        )
        window = runner.model.config.release_window
        release = None
        if window is not None:
            release = SlidingRelease(window, limits.block_size, enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            limits.max_num_seqs,
            limits.max_num_batched_tokens,
            watermark_blocks=max(1, limits.num_kv_blocks // 100),
            embeds_read_prefix_cache=runner.pooling.reads_prefix_cache,
            sliding_release=release,
        )
        blocks_needed = self.block_manager.blocks_needed
        if release is not None:
            step_tokens = limits.max_num_batched_tokens
            blocks_needed = functools.partial(release.peak_blocks, max_step_tokens=step_tokens)
        self._capacity = Capacity(
            runner.model.config.vocab_size, self.max_model_len, blocks_needed,
            self.block_manager.num_blocks,
        )  # fmt: skip
        self.grammars = Grammars(tokenizer, runner.model.config.vocab_size, eos_token_ids)
        self._requests = ParentRequests()  # n > 1 fans out above the core, joined here
        self._arrivals = itertools.count()
        self._generate_ids = itertools.count()
        self._num_steps = 0
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._generated = 0

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], **kwargs: Any) -> Engine:
        """Loads an HF checkpoint directory (config.json, safetensors, tokenizer).

        The keyword arguments are ``EngineConfig``'s fields (device, dtype,
        block_size, num_kv_blocks, max_num_seqs, max_num_batched_tokens,
        enable_prefix_caching, max_model_len, kv_cache_bytes,
        gpu_memory_utilization, use_triton, use_cuda_graphs, seed, model_impl,
        threads, tensor_parallel_size, quantization); see it for what each does. An unknown name is a TypeError, a bad value an
        ``InvalidEngineConfig`` (a ValueError).
        """
        return cls.from_config(path, EngineConfig.from_kwargs(kwargs))

    @classmethod
    def from_config(cls, path: str | os.PathLike[str], config: EngineConfig) -> Engine:
        loaded = build_engine(path, config)
        return cls(
            loaded.runner, loaded.tokenizer, loaded.limits, loaded.eos_token_ids,
            loaded.enable_prefix_caching,
        )  # fmt: skip

    def close(self) -> None:
        """Stops the other ranks of a tensor-parallel engine (nothing to do on one rank)."""
        if self.runner.peers is not None:
            self.runner.peers.close()

    # -- requests in ----------------------------------------------------------
    def encode(
        self, prompt: str | Sequence[dict[str, Any]], template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:  # fmt: skip
        return self.text.encode(prompt, template_kwargs, tools)  # see PromptText.encode

    def decode(self, token_ids: Sequence[int], keep_special: bool = False) -> str:
        return self.text.decode(token_ids, keep_special)  # see PromptText.decode

    def token_text(self, token_id: int) -> str:
        return self.text.token_text(token_id)  # see PromptText.token_text

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[dict[str, Any]] | Sequence[int],
        params: SamplingParams | None = None,
        *,
        resume_token_ids: Sequence[int] | None = None,
        priority: int = 0,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        """Queues a request. Raises RequestRejected when it can never run here.
        ``reasoning``: the parser of an output that reasons first; its structured output
        then constrains only the answer, from the text after the parser's marker."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise RequestRejected(request_id, "a request with this id is already in the engine")
        prompt_ids = self.text.prompt_ids(prompt)
        resumed = [int(t) for t in resume_token_ids or ()]
        params = check_fits(self._capacity, request_id, prompt_ids, resumed, params)
        samples = []
        for i in range(params.n):
            req = EngineRequest(
                request_id=sample_id(request_id, i, params.n),
                token_ids=prompt_ids + resumed,
                num_prompt_tokens=len(prompt_ids),
                params=params,
                arrival_order=next(self._arrivals),
                priority=priority,
                sample_index=i,
                num_resumed_tokens=len(resumed),
                logprobs=[] if params.logprobs is not None else None,
            )
            if params.stop:
                req.stop_matcher = StopStringMatcher(
                    self.tokenizer, params.stop, params.skip_special_tokens
                )
                req.stop_matcher.skip(resumed)
            if params.structured_output is not None:
                try:
                    self._constrain(req, params.structured_output, resumed, reasoning)
                except GrammarError as exc:
                    raise RequestRejected(request_id, f"structured_output: {exc}") from None
            samples.append(req)
        self._requests.add(ParentRequest(request_id, samples), self.scheduler.add)

    def _constrain(
        self, req: EngineRequest, constraint: StructuredOutput, resumed: list[int],
        reasoning: ReasoningParser | None,
    ) -> None:  # fmt: skip
        """Gives ``req`` its matcher, or an answer gate while its reasoning goes on."""
        if reasoning is None:
            req.matcher = self.grammars.matcher(constraint, resumed)
            return
        gate = AnswerGate(self.tokenizer, reasoning)
        answer = gate.skip(resumed)
        if answer is None:
            req.answer_gate = gate
        else:  # the resumed tokens ended the reasoning
            req.matcher = self.grammars.answer_matcher(constraint, answer)

    def _open_answer(self, req: EngineRequest) -> bool:
        """After a gated request's new token: starts its matcher once the reasoning ended
        (False: the text after the marker cannot follow the constraint)."""
        assert req.answer_gate is not None and req.params.structured_output is not None
        answer = req.answer_gate.feed(req.output_token_ids)
        if answer is None:
            return True
        req.answer_gate = None
        try:
            req.matcher = self.grammars.answer_matcher(req.params.structured_output, answer)
        except GrammarError:
            return False
        return True

    def add_embedding(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        dimensions: int | None = None,
        *,
        priority: int = 0,
    ) -> None:
        """Queues an embedding request: a string (tokenized with special tokens, no
        chat template) or token ids. It is scheduled with generation work (chunked
        prefill included), never decodes, and frees its KV blocks as soon as its
        prompt is computed; ``step`` then returns a ``RequestOutput`` with
        ``embedding`` set, ``finish_reason`` "stop", empty ``token_ids`` and
        ``text``. ``dimensions`` keeps the first that many values (re-normalized
        when the pooling normalizes). An aborted or drained one has no partial
        result (``embedding`` None, "abort"): run it again from the start.
        Raises RequestRejected when it can never run here.
        """
        if request_id in self._requests:
            raise RequestRejected(request_id, "a request with this id is already in the engine")
        unsupported = self.runner.pooling.unsupported
        if unsupported is not None:
            raise RequestRejected(request_id, f"this model cannot embed: {unsupported}")
        hidden = self.runner.model.config.hidden_size
        if dimensions is not None and (
            isinstance(dimensions, bool) or not isinstance(dimensions, int)
            or not 1 <= dimensions <= hidden
        ):  # fmt: skip
            raise RequestRejected(
                request_id, f"dimensions must be an integer in [1, {hidden}], got {dimensions!r}"
            )
        if isinstance(prompt, str):
            prompt_ids = list(self.tokenizer.encode(prompt, add_special_tokens=True))
        elif all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = [int(t) for t in prompt]
        else:
            raise RequestRejected(request_id, "an embedding input is a string or token ids")
        params = _EMBED_PARAMS
        check_fits(self._capacity, request_id, prompt_ids, [], params, generates=False)
        req = EngineRequest(
            request_id=request_id,
            token_ids=prompt_ids,
            num_prompt_tokens=len(prompt_ids),
            params=params,
            arrival_order=next(self._arrivals),
            priority=priority,
            embed=EmbedTask(dimensions),
        )
        self._requests.add(ParentRequest(request_id, [req]), self.scheduler.add)

    # -- one step -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one scheduling step; returns the requests that finished in it."""
        self._requests.release_parked(self.scheduler.add)
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        self._num_steps += 1
        for req in plan.first_admitted:
            self._prompt_tokens += req.num_prompt_tokens
            self._cached_tokens += req.num_cached_tokens
        sampling, result = self.runner.run(plan)
        grown = self.scheduler.update(plan, result.token_ids)
        assert grown == sampling
        finished: list[EngineRequest] = []
        for req, logprobs in zip(grown, result.logprobs):
            self._generated += 1
            if req.logprobs is not None and logprobs is not None:
                req.logprobs.append(logprobs)
            if (req.matcher is not None and not req.matcher.consume_token(req.token_ids[-1])) or (
                req.answer_gate is not None and not self._open_answer(req)
            ):
                # cannot happen while masks apply (nor, usually, when the reasoning ends:
                # the marker's token holds nothing after it); ends the request, not the worker
                req.finish_reason = EngineFinishReason.ABORT
                self.scheduler.finish(req)
                finished.append(req)
                continue
            reason = stop_reason(req, self.eos_token_ids, self.max_model_len)
            if reason is not None:
                req.finish_reason = reason
                self.scheduler.finish(req)
                finished.append(req)
        for req in plan.embeds:  # pooled by the runner; blocks freed at once
            if req.num_computed_tokens == req.num_tokens:
                req.finish_reason = EngineFinishReason.STOP
                self.scheduler.finish(req)
                finished.append(req)
        return [build_output(p.request_id, p.samples, self.tokenizer)
                for p in self._requests.finished(finished)]  # fmt: skip

    # -- control --------------------------------------------------------------
    def abort(self, request_id: str) -> RequestOutput | None:
        """Takes a request out; its output holds the tokens generated so far."""
        parent = self._requests.pop(request_id)
        if parent is None:
            return None
        for s in parent.samples:
            if not s.is_finished:
                s.finish_reason = EngineFinishReason.ABORT
                self.scheduler.finish(s)
        return build_output(request_id, parent.samples, self.tokenizer)

    def drain(self) -> list[RequestOutput]:
        """Aborts everything unfinished (a worker handing its work back)."""
        return [out for p in self._requests if (out := self.abort(p.request_id)) is not None]

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def output_token_counts(self) -> dict[str, int]:
        """Tokens generated so far by each unfinished request (all its samples; resumed
        tokens included): live progress, read every few seconds for the heartbeat."""
        return {p.request_id: sum(len(s.output_token_ids) for s in p.samples)
                for p in self._requests}  # fmt: skip

    def free_capacity(self) -> int:
        """How many more requests to add now to keep the in-flight set full: a
        running batch of max_num_seqs plus a short queue behind it."""
        target = self.limits.max_num_seqs + max(2, self.limits.max_num_seqs // 4)
        return max(0, target - len(self._requests))

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_steps=self._num_steps,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generated,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_rate=self._cached_tokens / max(self._prompt_tokens, 1),
            kv_usage=bm.num_used_blocks / bm.num_blocks,
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting + self._requests.num_parked,
            cuda_graph_replays=self.runner.num_graph_replays,
        )

    # -- batch API --------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str | Sequence[int] | Sequence[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        batch = next(self._generate_ids)
        ids = [f"generate-{batch}-{i}" for i in range(len(prompts))]
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.add_request(rid, prompt, p)
        except RequestRejected:
            for rid in ids:  # none of the batch stays behind
                self.abort(rid)
            raise
        return self._run_to_completion(ids)

    def embed(
        self, inputs: Sequence[str | Sequence[int]], dimensions: int | None = None
    ) -> list[list[float]]:
        """Embeds every input (a string or token ids; see ``add_embedding``); the
        vectors come back in input order."""
        batch = next(self._generate_ids)
        ids = [f"embed-{batch}-{i}" for i in range(len(inputs))]
        try:
            for rid, text in zip(ids, inputs):
                self.add_embedding(rid, text, dimensions)
        except RequestRejected:
            for rid in ids:  # none of the batch stays behind
                self.abort(rid)
            raise
        vectors = []
        for out in self._run_to_completion(ids):
            assert out.embedding is not None
            vectors.append(out.embedding)
        return vectors

    def _run_to_completion(self, ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        pending = set(ids)
        while pending:
            if not self.scheduler.has_work() and not self._requests.num_parked:
                raise RuntimeError(f"engine stalled with {len(pending)} requests unfinished")
            for out in self.step():
                if out.request_id in pending:
                    pending.discard(out.request_id)
                    done[out.request_id] = out
        return [done[rid] for rid in ids]
