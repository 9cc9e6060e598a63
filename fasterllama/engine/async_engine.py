"""EngineLoop: one always-on LLMEngine shared by many callers (threads or asyncio tasks).

The engine is not thread-safe, so it belongs to one background thread that runs `engine.step()`
while there is work and sleeps on a condition variable when idle. Other threads only enqueue
commands (add, abort, stop) and read what the loop publishes: every request gets a
`RequestHandle`, an iterator (sync or async) of `SequenceOutput`s, one per new token of each of
its n sequences. A step that raises fails the requests it was running (an error output each)
and the loop goes on."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from ..errors import FasterLlamaError
from ..sampling_params import SamplingParams
from .llm_engine import LLMEngine
from .sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "the server is shutting down"


class EngineLoopClosed(FasterLlamaError):
    """The loop was shut down: it accepts no new requests."""


@dataclass(frozen=True)
class SequenceOutput:
    """What one step added to one of a request's n sequences.

    text is the new printable text (held back while it may still become a stop string, so a
    delta can be empty); logprobs has one {token id: logprob} dict per new token (the chosen
    token plus the top N) when the request asked for them. The last output of a sequence has a
    finish_reason: "stop", "length", "abort" or "error" (then `error` says why)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    time: float  # time.monotonic() when the loop produced it
    error: str | None = None
    request_error: bool = False  # the error is the request's own (its constraint failed), not the engine's
    stop_reason: int | str | None = None  # on the last output: the stop token id or stop string that ended it


@dataclass(frozen=True)
class LoopStats:
    """A snapshot the loop publishes after every iteration (read from any thread)."""

    running_requests: int = 0
    waiting_requests: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    prefix_cache_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0  # of those, found there (not computed)
    preemptions: int = 0
    steps: int = 0
    spec_draft_tokens: int = 0  # speculative decoding: tokens drafted and verified
    spec_accepted_tokens: int = 0  # of those, accepted


class RequestHandle:
    """One request's outputs, filled by the loop thread and read by one consumer at a time.

    Iterate it with `for` (blocks a thread) or `async for` (wakes the asyncio loop it was first
    awaited on); both end after every sequence has had its final output."""

    def __init__(self, loop: EngineLoop, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival_time = time.monotonic()
        self.cached_tokens = 0  # prompt tokens found in the prefix cache (set when the prompt is in)
        self.prompt_logprobs: list[dict[int, float] | None] | None = None  # (params.prompt_logprobs: set when the prompt is in)
        self._loop = loop
        self._cond = threading.Condition()
        self._items: deque[SequenceOutput] = deque()
        self._open = params.n  # sequences without a final output yet
        self._done: set[int] = set()  # indexes that had their final output
        self._waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    @property
    def finished(self) -> bool:
        """Every sequence has produced its final output (there may still be outputs to read)."""
        with self._cond:
            return self._open == 0

    def abort(self) -> None:
        """Stop generating and free the request's KV blocks (no-op once finished)."""
        self._loop.abort(self.request_id)

    # -- loop thread side ------------------------------------------------------------------
    def _push(self, out: SequenceOutput) -> None:
        with self._cond:
            if out.index in self._done:  # one final output per sequence, nothing after it
                return
            self._items.append(out)
            if out.finish_reason is not None:
                self._done.add(out.index)
                self._open -= 1
            self._cond.notify_all()
            waker = self._waker
        if waker is not None:
            try:
                waker[0].call_soon_threadsafe(waker[1].set)
            except RuntimeError:  # that event loop is closed: its consumer is gone
                pass

    # -- consumer side ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[SequenceOutput]:
        while True:
            with self._cond:
                while not self._items and self._open:
                    self._cond.wait()
                if not self._items:
                    return
                out = self._items.popleft()
            yield out

    async def __aiter__(self) -> AsyncIterator[SequenceOutput]:
        event = asyncio.Event()
        with self._cond:
            self._waker = (asyncio.get_running_loop(), event)
        while True:
            with self._cond:
                if self._items:
                    out: SequenceOutput | None = self._items.popleft()
                elif not self._open:
                    return
                else:
                    out = None
                    event.clear()  # under the lock: a push after this sets it again
            if out is None:
                await event.wait()
            else:
                yield out


class _Request:
    """Loop-thread bookkeeping of one request: its handle and its engine sequences."""

    def __init__(self, handle: RequestHandle) -> None:
        self.handle = handle
        self.seqs: list[Sequence] = []


class EngineLoop:
    """Owns an LLMEngine and the one thread that calls it; see the module docstring."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.stats = LoopStats(kv_blocks_total=engine.blocks.num_blocks)
        self._cond = threading.Condition(threading.RLock())  # reentrant: shutdown() may run in a signal handler
        self._commands: deque[tuple[str, Any]] = deque()
        self._stopping = False
        self._handles: dict[str, RequestHandle] = {}  # the requests not finished yet, by id (guarded by _cond)
        self._requests: dict[str, _Request] = {}  # loop thread only
        self._owner: dict[int, tuple[_Request, int]] = {}  # seq_id -> (request, index); loop thread only
        self._steps = 0
        self._thread = threading.Thread(target=self._run, name="fasterllama-engine-loop", daemon=True)
        self._thread.start()

    # -- any thread ------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def encode(self, prompt: str | Seq[int], keep_last: int | None = None) -> list[int]:
        """Prompt token ids (the last keep_last where given), checked against the vocabulary and the
        context (FasterLlamaError if not). Uses only the tokenizer and the config, so it is safe
        from any thread."""
        return self.engine.encode_prompt(prompt, keep_last)

    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None, request_id: str | None = None) -> RequestHandle:
        """Queue a request of params.n sequences (sample k seeded with seed + k, as LLM.generate).

        The prompt is encoded here, and its structured-output constraint compiled, so a bad prompt
        or constraint raises in the caller's thread."""
        params = self.engine.check_params(params)
        if params.beam_width > 1:
            raise FasterLlamaError("beam search is not supported by the engine loop")
        ids = self.encode(prompt)
        self.engine.structured.matcher(params)  # a constraint that cannot compile raises here (compiled once, cached)
        request_id = request_id or uuid.uuid4().hex
        handle = RequestHandle(self, request_id, ids, params)
        with self._cond:
            if self._stopping:
                raise EngineLoopClosed("the engine loop is shut down")
            if request_id in self._handles:
                raise FasterLlamaError(f"request id {request_id!r} is already running")
            self._handles[request_id] = handle
            self._commands.append(("add", handle))
            self._cond.notify()
        return handle

    def abort(self, request_id: str) -> None:
        """Finish a request's sequences and free their KV blocks before the next step."""
        with self._cond:
            if request_id in self._handles:
                self._commands.append(("abort", request_id))
                self._cond.notify()

    def shutdown(self, wait: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests, end the running ones with an error output, stop the thread.

        wait=False only asks (safe in a signal handler); the thread ends after its step."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if wait and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def end_open_requests(self, message: str = SHUTDOWN_MESSAGE) -> None:
        """End every open request's outputs with an error now, without waiting for the step in
        progress (shutdown ends them after it: a server's graceful wait may be shorter than a long
        prefill step, and then its clients got a bare 500). Any thread but a signal handler (the
        handles' locks are not reentrant); the loop still frees their blocks after its step."""
        with self._cond:
            handles = list(self._handles.values())
        now = time.monotonic()
        for handle in handles:
            for k in range(handle.params.n):  # (the handle drops those already finished)
                handle._push(SequenceOutput(k, "", [], None, "error", now, error=message))

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    # -- loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while self._iterate():
            pass

    def _iterate(self) -> bool:
        """Apply queued commands, then run one step if there is work; False once stopped."""
        engine = self.engine
        with self._cond:
            while not self._commands and not self._stopping and not engine.has_unfinished():
                self._cond.wait()
            commands = list(self._commands)
            self._commands.clear()
            stopping = self._stopping
        try:
            for kind, payload in commands:
                if kind == "add":
                    self._add(payload)
                else:
                    self._abort(payload)
            if stopping:
                for req in list(self._requests.values()):
                    self._fail(req, SHUTDOWN_MESSAGE)
            elif engine.has_unfinished():
                self._step()
        except Exception as e:  # a bug outside the step: fail everything in flight, keep the loop
            logger.exception("engine loop iteration failed")
            for req in list(self._requests.values()):
                self._fail(req, f"internal error: {type(e).__name__}: {e}")
        self._publish()
        return not stopping

    def _add(self, handle: RequestHandle) -> None:
        req = _Request(handle)
        self._requests[handle.request_id] = req
        try:
            req.seqs = self.engine.add_group(handle.prompt_token_ids, handle.params)
            for k, seq in enumerate(req.seqs):
                self._owner[seq.seq_id] = (req, k)
        except Exception as e:  # a request the engine refuses fails alone
            logger.exception("adding request %s failed", handle.request_id)
            self._fail(req, f"{type(e).__name__}: {e}")

    def _abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None:
            return
        open_ = [k for k, seq in enumerate(req.seqs) if not seq.is_finished]  # (each reported aborted, started or not)
        for k in open_:
            if not req.seqs[k].is_finished:
                self.engine.abort(req.seqs[k])
            req.handle._push(SequenceOutput(k, "", [], None, "abort", time.monotonic()))
        self._forget(req)

    def _step(self) -> None:
        try:
            updates = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed")
            # the batch: running sequences, and those the step finished before it raised (their
            # final outputs are lost with it)
            running = {seq.seq_id for seq in self.engine.scheduler.running}
            affected = [r for r in self._requests.values()
                        if any(s.seq_id in running or (s.is_finished and s.seq_id in self._owner) for s in r.seqs)]
            for req in affected or list(self._requests.values()):
                self._fail(req, f"engine step failed: {type(e).__name__}: {e}")
            return
        self._steps += 1
        now = time.monotonic()
        for update in updates:
            seq = update.seq
            owner = self._owner.get(seq.seq_id)
            if owner is None:
                continue
            req, k = owner
            if k == 0 and len(seq.output_token_ids) <= 1:
                req.handle.cached_tokens, req.handle.prompt_logprobs = seq.num_prefix_cached, seq.prompt_logprobs
            logprobs = [update.logprobs] if update.logprobs is not None else None
            reason = update.finish_reason  # (a speculative step emits several tokens: only its last may finish)
            if reason == "error":
                req.handle._push(SequenceOutput(k, "", [], None, reason, now, error=seq.error, request_error=seq.error_is_request))
            else:
                req.handle._push(SequenceOutput(k, update.text_delta, [update.token_id], logprobs, reason, now, stop_reason=seq.stop_reason))
            if reason is not None:
                del self._owner[seq.seq_id]
                if not any(s.seq_id in self._owner for s in req.seqs):  # its last sequence's final output
                    self._forget(req)

    def _fail(self, req: _Request, message: str) -> None:
        """End every unfinished sequence of a request with an error output and free its blocks."""
        now = time.monotonic()
        for seq in req.seqs:
            try:
                self.engine.abort(seq)
            except Exception:  # the engine is in a bad state; blocks may leak, the loop lives on
                logger.exception("aborting a failed sequence raised")
        for k in range(req.handle.params.n):  # the handle drops those already finished
            req.handle._push(SequenceOutput(k, "", [], None, "error", now, error=message))
        self._forget(req)

    def _forget(self, req: _Request) -> None:
        for seq in req.seqs:
            self._owner.pop(seq.seq_id, None)
        self._requests.pop(req.handle.request_id, None)
        with self._cond:
            self._handles.pop(req.handle.request_id, None)

    def _publish(self) -> None:
        running = sum(1 for r in self._requests.values() if any(s.status == SequenceStatus.RUNNING for s in r.seqs))
        blocks, scheduler = self.engine.blocks, self.engine.scheduler
        spec = self.engine.speculator
        self.stats = LoopStats(running, len(self._requests) - running, blocks.num_blocks, blocks.num_used, scheduler.prefix_queried_tokens,
                               scheduler.prefix_hit_tokens, scheduler.num_preemptions, self._steps,
                               spec.num_draft_tokens if spec else 0, spec.num_accepted_tokens if spec else 0)
