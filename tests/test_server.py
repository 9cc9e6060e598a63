"""`fasterllama serve`: the EngineLoop and the OpenAI-compatible HTTP server, on a tiny random model.

The server runs in this process (uvicorn on 127.0.0.1, a free port, a background thread) and is
driven by the official `openai` client and by httpx for raw bodies; its answers are checked
against offline `LLM.generate` / `LLM.chat` on the same checkpoint (greedy and seeded sampling
give the same text and logprobs). Also: 16 concurrent streams, clients that leave mid-stream
(their KV slots come back, read from /metrics), an engine step that fails, API keys, a batch of
malformed bodies (4xx JSON errors, never a 500), and the CLI's SIGTERM handling. Loopback only;
every wait is bounded."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import tiny_models as tm

from fasterllama import LLM, SamplingParams
from fasterllama.engine.async_engine import (
    SHUTDOWN_MESSAGE,
    EngineLoop,
    EngineLoopClosed,
)
from fasterllama.server.logprobs import CompletionLogprobs, TokenTexts

MODEL = "tiny"
CONTEXT = 4096  # long enough that a request left running would be seen running on
MAX_NUM_SEQS = 8
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TIMEOUT = 30.0  # seconds, any single HTTP call


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny GQA model (context 4096) as a HF folder whose tokenizer has a chat template."""
    spec = dataclasses.replace(tm.SPECS["gqa"], max_position_embeddings=CONTEXT)
    folder = tm.save_hf_checkpoint(tm.build_hf_model(spec), str(tmp_path_factory.mktemp("serve") / "gqa"))
    tm.add_chat_template(folder, CHAT_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def offline(model_dir: str) -> LLM:
    return LLM(model_dir, progress=False)


class Server:
    """create_app over an EngineLoop, served by uvicorn in a thread on 127.0.0.1:<free port>."""

    def __init__(self, model_dir: str, api_key: str | None = None, tensor_parallel_size: int = 1, speculative_config: dict | None = None) -> None:
        import uvicorn

        from fasterllama.server import create_app

        self.llm = LLM(model_dir, progress=False, max_num_seqs=MAX_NUM_SEQS, tensor_parallel_size=tensor_parallel_size,
                       speculative_config=speculative_config)
        if speculative_config is not None:
            self.llm.engine.speculator.row_cost = self.llm.engine.speculator.draft_cost = 0.0  # draft all it may: every answer goes through verify steps
        self.loop = EngineLoop(self.llm.engine)
        self.app = create_app(self.loop, MODEL, api_key, trust_request_chat_template=True)  # (its refusal: test_api_key's app)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        self.base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0, timeout=TIMEOUT, **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)

    def metrics(self) -> str:
        return httpx.get(self.base + "/metrics", timeout=TIMEOUT).text

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.loop.shutdown(timeout=15)
        self.llm.engine.shutdown()


@pytest.fixture(scope="module")
def servers(model_dir: str) -> Iterator[dict[int | str, Server]]:
    """Servers by tensor_parallel_size (or "ngram"), started when first asked for."""
    started: dict[int | str, Server] = {}
    yield started
    for s in started.values():
        s.close()


@pytest.fixture(params=[1, 2, "ngram"], ids=["tp1", "tp2", "ngram"])
def server(request: pytest.FixtureRequest, servers: dict[int | str, Server], model_dir: str) -> Server:
    """The same API tests over a model in one process, split over two (tensor parallelism), and
    with prompt-lookup speculative decoding (answers equal to the offline model's without it)."""
    if request.param not in servers:
        if request.param == "ngram":
            spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
            servers[request.param] = Server(model_dir, speculative_config=spec)
        else:
            servers[request.param] = Server(model_dir, tensor_parallel_size=request.param)
    return servers[request.param]


@pytest.fixture()
def server_one(servers: dict[int, Server], model_dir: str) -> Server:
    if 1 not in servers:
        servers[1] = Server(model_dir)
    return servers[1]


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample's value from Prometheus text (labels as written, e.g. 'status="ok"')."""
    pattern = "^" + re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)$"
    m = re.search(pattern, text, re.MULTILINE)
    assert m, f"{name}{{{labels}}} not in /metrics"
    return float(m.group(1))


def wait_for(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def slots_free(server: Server) -> bool:
    text = server.metrics()
    return metric(text, "fasterllama_kv_blocks_used") == 0 and metric(text, "fasterllama_requests_running") == 0


def sse_events(response: httpx.Response) -> list[Any]:
    """The JSON payloads of an SSE body, with '[DONE]' kept as a string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_logprobs_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4


# -- EngineLoop on its own --------------------------------------------------------------------------
@pytest.fixture()
def loop(model_dir: str) -> Iterator[EngineLoop]:
    llm = LLM(model_dir, progress=False, max_num_seqs=4)
    loop = EngineLoop(llm.engine)
    yield loop
    loop.shutdown(timeout=15)


def test_loop_matches_offline_from_threads(loop: EngineLoop, offline: LLM) -> None:
    """Requests added and read from several threads at once: each gets what LLM.generate gives,
    n=2 samples seeded seed and seed + 1, logprobs included."""
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=12, n=2, logprobs=2)
    prompts = ["Hello there", "The cat sat", [5, 6, 7, 8]]
    results: dict[int, dict[int, tuple[str, list[int], list[dict[int, float]]]]] = {}

    def run(i: int) -> None:
        handle = loop.add_request(prompts[i], params)
        got: dict[int, tuple[str, list[int], list[dict[int, float]]]] = {k: ("", [], []) for k in range(2)}
        for out in handle:
            text, ids, lps = got[out.index]
            got[out.index] = (text + out.text, ids + out.token_ids, lps + (out.logprobs or []))
        assert handle.finished
        results[i] = got

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert sorted(results) == [0, 1, 2]
    for i, prompt in enumerate(prompts):
        ref = offline.generate([prompt], params)[0]
        for k, want in enumerate(ref.outputs):
            text, ids, lps = results[i][k]
            assert (text, ids) == (want.text, want.token_ids)
            assert_logprobs_close([lp[t] for lp, t in zip(lps, ids)], [lp[t] for lp, t in zip(want.logprobs, want.token_ids)])
    wait_for(lambda: loop.stats.kv_blocks_used == 0, what="free KV blocks")


def test_loop_step_error_fails_the_running_requests_only(loop: EngineLoop) -> None:
    """A step that raises ends its requests with an error output; the loop keeps serving."""
    engine = loop.engine
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step() -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_step()

    engine.step = flaky_step
    try:
        handle = loop.add_request("Hello", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, n=2))
        outs = list(handle)
    finally:
        engine.step = real_step
    finals = [o for o in outs if o.finish_reason is not None]
    assert sorted(o.index for o in finals) == [0, 1]
    assert all(o.finish_reason == "error" and "boom" in (o.error or "") for o in finals)
    again = list(loop.add_request("Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)))
    assert sum(len(o.token_ids) for o in again) == 5 and again[-1].finish_reason == "length"
    wait_for(lambda: loop.stats.kv_blocks_used == 0, what="free KV blocks")


def test_loop_abort_and_shutdown(loop: EngineLoop) -> None:
    """abort() frees a request's slots at once; shutdown() ends the rest with an error output
    and refuses new requests."""

    async def main() -> int:
        aborted = loop.add_request("Hello", SamplingParams(temperature=0, max_tokens=900, ignore_eos=True))
        count = 0
        async for out in aborted:
            count += len(out.token_ids)
            if count == 3:
                aborted.abort()
        return count

    count = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert count < 900
    wait_for(lambda: loop.stats.kv_blocks_used == 0, what="free KV blocks")
    running = loop.add_request("Hello", SamplingParams(temperature=0, max_tokens=900, ignore_eos=True))
    first = next(iter(running))
    assert first.token_ids
    loop.shutdown(timeout=15)
    rest = list(running)
    assert rest[-1].finish_reason == "error" and rest[-1].error == SHUTDOWN_MESSAGE
    assert not loop.is_running
    with pytest.raises(EngineLoopClosed):
        loop.add_request("Hello")


# -- the HTTP server ----------------------------------------------------------------------------------
def test_models_health_metrics(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.base + "/health", timeout=TIMEOUT).json() == {"status": "ok"}
    assert httpx.head(server.base + "/health", timeout=TIMEOUT).status_code == 200  # (load balancers probe with HEAD)
    # an x-request-id on every response: the client's own, else a new one each time
    ids = [httpx.get(server.base + "/v1/models", timeout=TIMEOUT).headers["x-request-id"] for _ in range(2)]
    assert len(set(ids)) == 2 and all(len(i) == 32 for i in ids)
    r = httpx.post(server.base + "/v1/completions", json={"model": "nope", "prompt": "Hi"}, headers={"X-Request-Id": "trace-7"}, timeout=TIMEOUT)
    assert r.status_code == 404 and r.headers["x-request-id"] == "trace-7"
    text = server.metrics()
    assert metric(text, "fasterllama_kv_blocks_total") == server.llm.engine.blocks.num_blocks > 0
    for name in ("fasterllama_time_to_first_token_seconds_count", "fasterllama_inter_token_latency_seconds_count",
                 "fasterllama_prompt_tokens_total", "fasterllama_generation_tokens_total", "fasterllama_requests_waiting",
                 "fasterllama_prefix_cache_queried_tokens_total", "fasterllama_preemptions_total"):
        metric(text, name)
    assert "# TYPE fasterllama_preemptions_total counter" in text  # (they only grow: counters, for rate())
    # each sequence's end: by its finish reason, and its time from the request's arrival
    length = 'finish_reason="length"'
    before = [metric(text, "fasterllama_finished_sequences_total", length), metric(text, "fasterllama_e2e_request_latency_seconds_count")]
    server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=2, n=2, temperature=0.5, extra_body={"ignore_eos": True})
    text = server.metrics()
    after = [metric(text, "fasterllama_finished_sequences_total", length), metric(text, "fasterllama_e2e_request_latency_seconds_count")]
    assert [b - a for a, b in zip(before, after)] == [2, 2]


def test_completion_greedy_matches_offline(server: Server, offline: LLM) -> None:
    client = server.client()
    for prompt in ["Hello world, this is", [17, 42, 99, 7, 250]]:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
        ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12, logprobs=3))[0]
        (choice,) = r.choices
        assert choice.text == ref.text
        assert choice.finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        lp = choice.logprobs
        assert b"".join(token_bytes(name) for name in lp.tokens) == b"".join(TokenTexts(offline.tokenizer).get(t)[1] for t in ref.token_ids)
        assert_logprobs_close(lp.token_logprobs, [d[t] for d, t in zip(ref.logprobs, ref.token_ids)])
        assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # logit_bias (token ids as strings) and allowed_token_ids: what the engine makes of them
    banned = ref.token_ids[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logit_bias={str(banned): -100},
                                  extra_body={"allowed_token_ids": list(range(10, 300))})
    ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12, logit_bias={banned: -100}, allowed_token_ids=list(range(10, 300))))[0]
    assert r.choices[0].text == ref.text and banned not in ref.token_ids and all(10 <= t < 300 for t in ref.token_ids)
    # several prompts in one request: choices in prompt order
    prompts = ["Hello world, this is", "Once upon a time"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for c, prompt in zip(r.choices, prompts):
        assert c.text == offline.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0].text
    if server.llm.engine.speculator is not None:  # the answers came through verify steps, some drafts accepted
        text = server.metrics()
        assert 0 < metric(text, "fasterllama_spec_decode_accepted_tokens_total") < metric(text, "fasterllama_spec_decode_draft_tokens_total")


def token_bytes(name: str) -> bytes:
    """A /v1/completions logprobs token's bytes: its text, or "bytes:\\x.." for part of a character."""
    return bytes.fromhex(name[6:].replace("\\x", "")) if name.startswith("bytes:") else name.encode()


def test_completion_logprobs_name_parts_of_characters_by_their_bytes(offline: LLM) -> None:
    """Tokens holding part of a UTF-8 character are "bytes:\\x.." (their text alone, U+FFFD, would
    be one key for all of them in top_logprobs), and text_offset counts the characters before."""
    text = "Emoji: \U0001F600\U0001F389 and \u4e2d\u6587 done"
    ids = offline.tokenizer.encode(text)
    tops = [{t: -1.0 - j for j, t in enumerate(ids[i : i + 3])} for i in range(len(ids))]
    part = CompletionLogprobs(TokenTexts(offline.tokenizer)).add(ids, tops)
    assert b"".join(token_bytes(name) for name in part["tokens"]) == text.encode()
    assert any(name.startswith("bytes:") for name in part["tokens"])
    assert [len(top) for top in part["top_logprobs"]] == [len(t) for t in tops]  # no two alternatives under one name
    done = [b"".join(token_bytes(name) for name in part["tokens"][:i]) for i in range(len(ids))]
    assert part["text_offset"] == [len(b.decode("utf-8", errors="ignore")) for b in done]


def test_an_added_bos_takes_no_room_in_an_echoed_text(offline: LLM) -> None:
    """Echoing a text prompt its tokenizer put a BOS before: the BOS's entry has offset 0 and the
    text's tokens keep theirs (they were shifted by the BOS's text)."""
    from fasterllama.server.completions import _added_specials

    tok = offline.tokenizer
    special = next(iter(tok.all_special_ids))
    text = "Hello there"
    ids = [special, *tok.encode(text)]
    assert _added_specials(tok, text, ids) == 1 and _added_specials(tok, tok.decode(ids), ids) == 0
    part = CompletionLogprobs(TokenTexts(tok)).add(ids, [None] + [{t: -1.0} for t in ids[1:]], zero_width=1)
    assert part["text_offset"][:2] == [0, 0] and all(text[o:].startswith(t) for o, t in zip(part["text_offset"][1:], part["tokens"][1:]))


def test_completion_streaming_seeded_n2_matches_offline(server: Server, offline: LLM) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, n=2, logprobs=1)
    ref = offline.generate(["The quick brown fox"], params)[0]
    stream = server.client().completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=16, temperature=0.9,
                                                top_p=0.95, seed=1234, n=2, logprobs=1, stream=True,
                                                stream_options={"include_usage": True})
    texts, reasons, lps, usage = ["", ""], [None, None], [[], []], None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
            if c.logprobs is not None:
                lps[c.index] += c.logprobs.token_logprobs
    assert texts == [o.text for o in ref.outputs]
    assert reasons == [o.finish_reason for o in ref.outputs]
    for k, o in enumerate(ref.outputs):
        assert_logprobs_close(lps[k], [d[t] for d, t in zip(o.logprobs, o.token_ids)])
    assert usage is not None and usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs)
    assert usage.prompt_tokens == len(ref.prompt_token_ids)
    assert usage.prompt_tokens_details.cached_tokens == 0


def test_continuous_usage_stats(server_one: Server) -> None:
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries its
    choice's usage so far (its prompt, its tokens), counting up to the final usage chunk's; without
    it chunks carry null. With two prompts and n=2, each choice counts its own."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server_one.base, timeout=TIMEOUT) as client:
        for continuous in (True, False):
            options = {"include_usage": True, "continuous_usage_stats": continuous}
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream_options": options}) as r:
                events = sse_events(r)
            assert events[-1] == "[DONE]" and events[-2]["choices"] == []
            final, chunks = events[-2]["usage"], events[:-2]
            assert final["completion_tokens"] == 6 and final["total_tokens"] == final["prompt_tokens"] + 6
            if not continuous:
                assert all(c["usage"] is None for c in chunks)
                continue
            counts = [c["usage"]["completion_tokens"] for c in chunks]
            assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 6
            assert all(c["usage"]["prompt_tokens"] == final["prompt_tokens"] for c in chunks)
        prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
        many = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 4, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        with client.stream("POST", "/v1/completions", json=many) as r:
            events = sse_events(r)
        seen: dict[int, list[int]] = {}
        for e in events[:-2]:
            (c,) = e["choices"]
            assert e["usage"]["prompt_tokens"] == len(prompts[c["index"] // 2])
            seen.setdefault(c["index"], []).append(e["usage"]["completion_tokens"])
        assert sorted(seen) == [0, 1, 2, 3] and all(v == sorted(v) and v[-1] == 4 for v in seen.values()), seen
        assert events[-2]["usage"]["completion_tokens"] == 16 and events[-2]["usage"]["prompt_tokens"] == 8


def test_responses_api(server_one: Server, offline: LLM) -> None:
    """POST /v1/responses (OpenAI's Responses API, text): the chat completion of the same
    conversation, whole or as the API's events through the official client; json_schema through
    text.format; what it does not do refused by name."""
    client = server_one.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Name a colour."}]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=8))[0]
    r = client.responses.create(model=MODEL, instructions="Be brief.", temperature=0, max_output_tokens=8,
                                input=[{"role": "user", "content": "Hello there"},
                                       {"role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
                                       {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}])
    assert r.output_text == want.outputs[0].text and r.usage.output_tokens == len(want.outputs[0].token_ids)
    assert r.usage.input_tokens == len(want.prompt_token_ids) and r.id.startswith("resp_")
    finished = want.outputs[0].finish_reason == "length"
    assert r.status == ("incomplete" if finished else "completed") and (r.incomplete_details is not None) == finished
    events = list(client.responses.create(model=MODEL, input="Hello there", max_output_tokens=6, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True}))  # (vLLM's sampling extras apply as on chat)
    alone = offline.chat([{"role": "user", "content": "Hello there"}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert alone.finish_reason == "length" and len(alone.token_ids) == 6
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if alone.finish_reason == "length" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == alone.text == events[-1].response.output_text and events[-1].response.usage.output_tokens == len(alone.token_ids)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Answer in JSON.", max_output_tokens=20, temperature=0,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert isinstance(json.loads(r.output_text)["ok"], bool)
    with httpx.Client(base_url=server_one.base, timeout=TIMEOUT) as raw:
        for body, param in [({"tools": [{"type": "function", "name": "f"}]}, "tools"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
                            ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
                            ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
                            ({"input": []}, None), ({"max_output_tokens": 0}, "max_output_tokens"), ({"top_k": "x"}, "top_k")]:
            r = raw.post("/v1/responses", json={"model": MODEL, "input": "Hi", **body})
            assert r.status_code == 400 and (param is None or (r.json()["error"]["param"] or "").startswith(param)), (body, r.text)
        assert raw.post("/v1/responses", json={"model": "gpt-4", "input": "Hi"}).status_code == 404
    wait_for(lambda: slots_free(server_one), what="every KV slot free after the responses")


def test_chat_matches_offline(server: Server, offline: LLM) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10, logprobs=3))[0]
    r = server.client().chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0,
                                                logprobs=True, top_logprobs=3)
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(offline.chat_prompt(messages))
    content = choice.logprobs.content
    assert_logprobs_close([e.logprob for e in content], [d[t] for d, t in zip(ref.logprobs, ref.token_ids)])
    for entry, d, _t in zip(content, ref.logprobs, ref.token_ids):
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.top_logprobs[0].logprob == pytest.approx(max(d.values()), abs=1e-4)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token or "\ufffd" in entry.token
    # streamed, seeded, n=2: the same samples as offline
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, n=2)
    ref2 = offline.chat(messages, params)[0]
    stream = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=5, n=2, stream=True)
    texts, roles, reasons = ["", ""], [None, None], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            roles[c.index] = c.delta.role or roles[c.index]
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert roles == ["assistant", "assistant"]
    assert texts == [o.text for o in ref2.outputs]
    assert reasons == [o.finish_reason for o in ref2.outputs]


def test_structured_output_over_http(server: Server, offline: LLM) -> None:
    """response_format json_schema / json_object (chat) and guided_regex (completions): the offline
    engine's constrained text; a schema that cannot compile is a 400."""
    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "color"],
              "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}}}
    messages = [{"role": "user", "content": "Colour?"}]
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=40, json_schema=schema))[0]
    r = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    assert r.choices[0].message.content == ref.text and json.loads(ref.text)["color"] in ("red", "green", "blue")
    assert r.choices[0].finish_reason == "stop"
    r = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].message.content == offline.chat(messages, SamplingParams(temperature=0, max_tokens=60, json_object=True))[0].text
    c = server.client().completions.create(model=MODEL, prompt="Answer:", max_tokens=20, temperature=0, extra_body={"guided_regex": "(yes|no)!"})
    assert c.choices[0].text in ("yes!", "no!") and c.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="cannot compile the json constraint"):
        server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})
    with pytest.raises(openai.BadRequestError, match="at most one"):
        server.client().completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"guided_regex": "a", "guided_grammar": 'start: "a"'})
    # vLLM's guided_choice and structured_outputs (they were ignored: free text)
    for extra in ({"guided_choice": ["yes", "no"]}, {"structured_outputs": {"choice": ["yes", "no"]}}):
        c = server.client().completions.create(model=MODEL, prompt="Answer:", max_tokens=20, temperature=0, extra_body=extra)
        assert c.choices[0].text in ("yes", "no") and c.choices[0].finish_reason == "stop", extra
    for extra, fragment in (({"structured_outputs": {"structural_tag": "x"}}, "structural_tag"),
                            ({"guided_choice": ["a"], "structured_outputs": {"regex": "b"}}, "give one of")):
        with pytest.raises(openai.BadRequestError, match=fragment):
            server.client().completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body=extra)
    # a constraint failing after its first token (llguidance's parser limits): a 400 for it alone
    huge = "start: " + " | ".join(f'"w{i}"' for i in range(2001))
    with httpx.Client(base_url=server.base, timeout=TIMEOUT) as client:
        free = {"model": MODEL, "prompt": "Hello", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(2) as pool:
            other = pool.submit(client.post, "/v1/completions", json=free)
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5, "guided_grammar": huge})
            assert r.status_code == 400 and "structured output failed" in r.json()["error"]["message"], r.text
            assert other.result().status_code == 200 and other.result().json()["usage"]["completion_tokens"] == 40
    assert slots_free(server)


def test_schemas_close_their_objects() -> None:
    """Objects that list their properties take no others, as OpenAI's strict mode and vLLM's default
    backend read them ("strict": true was ignored and the model added keys; structured_outputs'
    disable_additional_properties was refused with a 400, though the Python API takes it); an
    object that lists none stays any object, as does one that requires keys it does not list."""
    from fasterllama.server.protocol import CompletionRequest

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    closed = {**schema, "additionalProperties": False}

    def constraint(**fields) -> dict:
        params = CompletionRequest.model_validate({"model": MODEL, "prompt": "x", **fields}).sampling_params(5, None)
        return json.loads(params.constraint[1])

    for strict in (True, False, None):
        assert constraint(response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": strict}}) == closed
    for flags in ({"disable_additional_properties": True}, {"disable_any_whitespace": True}, {}):
        assert constraint(structured_outputs={"json": schema, **flags}) == closed
    for open_object in ({"type": "object"}, {"type": "object", "properties": {"a": {}}, "required": ["b"]},
                        {"properties": {"a": {}}, "minProperties": 2}, {**schema, "additionalProperties": {"type": "integer"}}):
        assert constraint(guided_json=open_object) == open_object


def test_64_concurrent_streams_complete_and_16_aborted_free_their_blocks(server: Server) -> None:
    """64 streams of mixed lengths (8x the seats: most wait); 16 clients leave mid-stream. The
    other 48 finish with every token, and no KV block stays used."""

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str | None]:
        max_tokens = 8 + (i * 7) % 40
        prompt = f"Request number {i}: " + "and more " * (i % 9)
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.7, seed=i,
                                                 stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        tokens, reason, chunks = 0, None, 0
        async for chunk in stream:
            chunks += 1
            if i % 4 == 0 and chunks == 3:  # this client leaves
                await stream.close()
                return -1, "left"
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for c in chunk.choices:
                reason = c.finish_reason or reason
        return tokens - max_tokens, reason

    async def main() -> list[tuple[int, str | None]]:
        client = server.async_client()
        try:
            return await asyncio.gather(*(one(client, i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(asyncio.wait_for(main(), 120))
    assert results.count((-1, "left")) == 16 and results.count((0, "length")) == 48
    wait_for(lambda: slots_free(server), what="no used KV blocks")


def test_prefix_cache_over_http(server: Server, model_dir: str) -> None:
    """A second request sharing a 256-token prefix reports it as cached_tokens and gets the tokens
    it gets with prefix caching off."""
    prefix = [(7 * i) % 300 + 10 for i in range(256)]
    client = server.client()
    first = client.completions.create(model=MODEL, prompt=prefix + [11, 12], max_tokens=6, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prefix + [13, 14, 15], max_tokens=6, temperature=0, logprobs=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 256
    off = LLM(model_dir, progress=False, enable_prefix_caching=False)
    want = off.generate([prefix + [13, 14, 15]], SamplingParams(temperature=0, max_tokens=6))[0]
    assert second.choices[0].text == want.text
    assert metric(server.metrics(), "fasterllama_prefix_cache_hit_tokens_total") >= 256


def test_client_leaving_mid_stream_frees_its_slots(server: Server) -> None:
    before = server.metrics()
    aborted_before = metric(before, "fasterllama_requests_total", 'status="aborted"')
    steps_before = server.loop.stats.steps
    max_tokens = CONTEXT - 64

    async def leave_early(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL, "prompt": f"Long story {i}", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        if i % 2:
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"Long story {i}"}], "max_tokens": max_tokens,
                    "ignore_eos": True, "stream": True}
        url = server.base + ("/v1/chat/completions" if i % 2 else "/v1/completions")
        seen = 0
        async with client.stream("POST", url, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 4:
                    break  # leaving the block closes the connection
        return seen

    async def main() -> list[int]:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            return await asyncio.gather(*(leave_early(client, i) for i in range(4)))

    assert asyncio.run(asyncio.wait_for(main(), 60)) == [4] * 4
    wait_for(lambda: slots_free(server), what="free KV slots")
    wait_for(lambda: metric(server.metrics(), "fasterllama_requests_total", 'status="aborted"') == aborted_before + 4, what="4 aborts")
    assert server.loop.stats.steps - steps_before < max_tokens / 2  # stopped, not run to max_tokens
    # and the server goes on answering
    r = server.client().completions.create(model=MODEL, prompt="Still there?", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def test_client_leaving_before_a_whole_response_aborts_it(server: Server) -> None:
    """A non-streaming request whose client gives up (a read timeout) is aborted too."""
    before = server.metrics()
    aborted_before = metric(before, "fasterllama_requests_total", 'status="aborted"')
    steps_before = server.loop.stats.steps
    max_tokens = CONTEXT - 64
    body = {"model": MODEL, "prompt": "Patience", "max_tokens": max_tokens, "ignore_eos": True, "n": 2}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", json=body, timeout=httpx.Timeout(TIMEOUT, read=0.3))
    wait_for(lambda: metric(server.metrics(), "fasterllama_requests_total", 'status="aborted"') == aborted_before + 1, what="the abort")
    wait_for(lambda: slots_free(server), what="free KV slots")
    assert server.loop.stats.steps - steps_before < max_tokens / 2  # stopped, not run to max_tokens


def test_failed_step_ends_the_stream_with_an_error_event(server: Server) -> None:
    engine = server.loop.engine
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step() -> Any:
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("simulated kernel failure")
        return real_step()

    engine.step = flaky_step
    try:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=TIMEOUT) as response:
            assert response.status_code == 200
            events = sse_events(response)
    finally:
        engine.step = real_step
    assert events[-1] == "[DONE]"
    assert "simulated kernel failure" in events[-2]["error"]["message"]
    assert events[-2]["error"]["type"] == "server_error"
    with pytest.raises(openai.APIError):  # the client raises on the error event
        engine.step = flaky_step
        calls["n"] = 0
        try:
            for _ in server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=200, stream=True,
                                                        extra_body={"ignore_eos": True}):
                pass
        finally:
            engine.step = real_step
    wait_for(lambda: slots_free(server), what="free KV slots")
    assert server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=3).usage.completion_tokens >= 1


def test_api_key(model_dir: str) -> None:
    """With an API key, /v1 needs `Authorization: Bearer KEY` (401 otherwise); probes do not."""
    from fasterllama.server import create_app

    llm = LLM(model_dir, progress=False, max_num_seqs=2)
    loop = EngineLoop(llm.engine)
    app = create_app(loop, MODEL, api_key="sekrit")

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=TIMEOUT) as client:
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "ignore_eos": True}  # (sampled: EOS could end it sooner)
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}, {"Authorization": "Basic sekrit"}):
                for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/responses")):
                    r = await client.request(method, path, json=body, headers=headers)
                    assert r.status_code == 401, (headers, path)
                    assert r.json()["error"]["code"] == "invalid_api_key"
            ok = {"Authorization": "Bearer sekrit"}
            for path in ("/tokenize", "/detokenize"):  # (vLLM's, outside /v1: the key all the same)
                assert (await client.post(path, json={"prompt": "Hi", "tokens": [5]})).status_code == 401
                assert (await client.post(path, json={"prompt": "Hi", "tokens": [5]}, headers=ok)).status_code == 200
            assert (await client.get("/tokenizer_info")).status_code == 401
            assert (await client.get("/tokenizer_info", headers=ok)).status_code == 200
            assert (await client.get("/version")).status_code == 200
            assert (await client.get("/v1/models", headers=ok)).status_code == 200
            r = await client.post("/v1/completions", json=body, headers=ok)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            assert (await client.get("/health")).status_code == 200
            metrics = (await client.get("/metrics")).text
            assert metric(metrics, "fasterllama_requests_total", 'status="rejected"') == 19
            assert metric(metrics, "fasterllama_requests_total", 'status="ok"') == 1
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "chat_template": "{{ 'ab' * 10 }}"}
            r = await client.post("/v1/chat/completions", json=chat, headers=ok)  # (a request's template: only where the server trusts it)
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
            assert "--trust-request-chat-template" in r.json()["error"]["message"]
            await check_cors(client, allowed=["http://localhost:3000", "http://127.0.0.1", "https://[::1]:8443"],
                             refused=["https://chat.example.com", "http://localhost.example.com", "null"])
        named = create_app(loop, MODEL, api_key="sekrit", allowed_origins=["https://chat.example.com"])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=named), base_url="http://testserver", timeout=TIMEOUT) as client:
            await check_cors(client, allowed=["https://chat.example.com", "http://localhost:5173"],
                             refused=["https://chat.example.com:8443", "https://other.example.com"])

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        loop.shutdown(timeout=15)


async def check_cors(client: httpx.AsyncClient, allowed: list[str], refused: list[str]) -> None:
    """A browser's preflight (no API key: browsers send none) and the request after it are allowed
    from `allowed` origins and from no other: a request from another page's origin is refused
    (403) before it runs, whatever its body says it is (a simple POST needs no preflight)."""
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    for origin in allowed + refused:
        r = await client.options("/v1/chat/completions", headers={"Origin": origin, **preflight})
        assert (r.status_code == 200) == (origin in allowed), (origin, r.status_code)
        assert r.headers.get("access-control-allow-origin") == (origin if origin in allowed else None), origin
        r = await client.get("/v1/models", headers={"Origin": origin, "Authorization": "Bearer sekrit"})
        if origin in allowed:
            assert r.status_code == 200 and r.headers.get("access-control-allow-origin") == origin
        else:
            assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", (origin, r.text)
            r = await client.post("/v1/completions", content=b'{"model": "tiny", "prompt": "Hi", "max_tokens": 1}',  # (an untyped body)
                                  headers={"Origin": origin, "Authorization": "Bearer sekrit"})
            assert r.status_code == 403, (origin, r.text)


MALFORMED: list[tuple[str, Any, int]] = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"", 400),
    ("/v1/completions", b"[1, 2, 3]", 400),
    ("/v1/completions", {"model": MODEL}, 400),  # no prompt
    ("/v1/completions", {"prompt": "Hi"}, 400),  # no model
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": "5"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 5.5}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "temperature": "hot"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "temperature": -1}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "top_p": 0}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "n": 0}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "logprobs": 21}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "stop": ["ok", 3]}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "stream": "yes"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": CONTEXT}, 400),  # beyond the context
    ("/v1/completions", {"model": MODEL, "prompt": list(range(3, 3 + CONTEXT)), "max_tokens": 1}, 400),  # prompt over it
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**6]}, 400),  # outside the vocabulary
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2], "mixed"]}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "suffix": "!"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "use_beam_search": True}, 400),  # vLLM's fields we do not honour
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "prompt_logprobs": 21}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "add_special_tokens": False}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "stream_options": {"include_usage": True}}, 400),  # without stream
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "min_tokens": 3}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "truncate_prompt_tokens": 0}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "min_tokens": 40}, 400),  # (over max_tokens' default, 16)
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "prompt_embeds": "AAAA"}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True, "prompt_logprobs": 1}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2, "min_tokens": 3}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "echo": True}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400),  # (an assistant's may be left out)
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "system", "content": None}, {"role": "user", "content": "Hi"}]}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "modalities": ["text", "audio"]}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "audio": {"voice": "alloy", "format": "wav"}}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "web_search_options": {"search_context_size": "low"}}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "best_of": 2}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "logit_bias": {"abc": 1}}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "logit_bias": {"5": 101}}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "logit_bias": {"100000": 1}}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "allowed_token_ids": []}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "seed": 2**70}, 400),
    ("/v1/completions", {"model": "gpt-4", "prompt": "Hi"}, 404),
    ("/v1/chat/completions", {"model": MODEL}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": "Hi"}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "Hi"}]}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "", "content": "Hi"}]}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 21}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 10**6}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]}, 400),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "Hi"}]}, 404),
    ("/v1/no-such-route", {"model": MODEL}, 404),
]


def test_malformed_requests_get_json_errors(server: Server) -> None:
    errors_before = metric(server.metrics(), "fasterllama_requests_total", 'status="error"')
    with httpx.Client(base_url=server.base, timeout=TIMEOUT) as client:
        cases: list[tuple[str, httpx.Response, int]] = []
        for path, body, status in MALFORMED:
            if isinstance(body, bytes):
                r = client.post(path, content=body, headers={"Content-Type": "application/json"})
            else:
                r = client.post(path, json=body)
            cases.append((f"{path} {body!r:.80}", r, status))
        big = b'{"model": "tiny", "prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
        cases.append(("5 MB body", client.post("/v1/completions", content=big), 413))
        chunked = (big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20))  # no Content-Length
        cases.append(("5 MB chunked body", client.post("/v1/completions", content=chunked), 413))
        cases.append(("GET on a POST route", client.get("/v1/completions"), 405))
        for what, r, status in cases:
            assert r.status_code == status, (what, r.status_code, r.text)
            error = r.json()["error"]
            assert isinstance(error["message"], str) and error["message"], what
            assert isinstance(error["type"], str) and "param" in error and "code" in error, what
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert metric(server.metrics(), "fasterllama_requests_total", 'status="error"') == errors_before  # no 500s


def test_null_fields_and_more_samples_than_seats(server_one: Server, offline: LLM) -> None:
    """A field sent as null is as if not sent (some clients send every field), tools with
    tool_choice "none" are no tools; n above the engine's max_num_seqs runs (in groups) rather
    than waiting forever for seats."""
    nulls = dict.fromkeys(("stream", "n", "stream_options", "ignore_eos", "min_tokens", "skip_special_tokens", "temperature", "stop"))
    with httpx.Client(base_url=server_one.base, timeout=TIMEOUT) as client:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi", "name": None}], "max_tokens": 2, "logprobs": None,
                "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none", **nulls}
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
        turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": "Go"}]
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": turns, "max_tokens": 1})
        empty = [{**m, "content": m["content"] or ""} for m in turns]  # (null content rendered as "None")
        assert r.json()["usage"]["prompt_tokens"] == len(offline.chat_prompt(empty)), r.text
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "echo": None, "suffix": None, **nulls})
        assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
        n = MAX_NUM_SEQS + 3
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4, "n": n, "seed": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(n))
    ref = offline.generate(["Hi"], SamplingParams(n=n, seed=3, max_tokens=4, ignore_eos=True))[0]
    assert [c["text"] for c in choices] == [o.text for o in ref.outputs]
    wait_for(lambda: slots_free(server_one), what="no used KV blocks")


def test_engine_errors_name_their_param(server: Server) -> None:
    """Errors the engine raises on a request's values name the field, as OpenAI's `param` does;
    a client that leaves while still sending its body is an aborted request, not a server error
    (it was counted as a 500, with two tracebacks in the log)."""
    with httpx.Client(base_url=server.base, timeout=TIMEOUT) as client:
        for extra, param in (({"logit_bias": {"100000": 1}}, "logit_bias"), ({"allowed_token_ids": []}, "allowed_token_ids"),
                             ({"allowed_token_ids": [-1]}, "allowed_token_ids"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
                             ({"guided_choice": []}, "guided_choice"), ({"guided_json": "{not json"}, "guided_json"),
                             ({"logit_bias": {"\u0663": 1}}, "logit_bias"), ({"guided_json": {}, "guided_regex": "a"}, "guided_json"),
                             ({"guided_choice": ["a"], "structured_outputs": {"regex": "b"}}, "guided_choice"),
                             ({"guided_regex": "(a"}, "guided_regex"), ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs")):
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    before = server.metrics()
    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\": ")
    wait_for(lambda: metric(server.metrics(), "fasterllama_requests_total", 'status="aborted"')
             == metric(before, "fasterllama_requests_total", 'status="aborted"') + 1, what="the abort")
    assert metric(server.metrics(), "fasterllama_requests_total", 'status="error"') == metric(before, "fasterllama_requests_total", 'status="error"')


def test_chat_template_extras_over_http(server: Server, offline: LLM) -> None:
    """vLLM's chat extras: continue_final_message (with add_generation_prompt false), chat_template,
    chat_template_kwargs; an assistant turn's tool_calls and a tool turn's tool_call_id reach the
    template (they were dropped); the prompt is what LLM.chat_prompt renders."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "content": "42", "tool_call_id": "c1"}, {"role": "assistant", "content": "The answer"}]
    template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}"
                "{% if m.tool_call_id %}<{{ m.tool_call_id }}>{% endif %}{{ mark }}{% endfor %}")
    with httpx.Client(base_url=server.base, timeout=TIMEOUT) as client:
        body = {"model": MODEL, "messages": turns, "max_tokens": 4, "temperature": 0, "add_generation_prompt": False,
                "continue_final_message": True, "chat_template": template, "chat_template_kwargs": {"mark": "|"}}
        r = client.post("/v1/chat/completions", json=body)
        ids = offline.chat_prompt(turns, False, {"mark": "|"}, chat_template=template, continue_final_message=True)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids), r.text
        assert offline.tokenizer.decode(ids).endswith('<c1>|[assistant]The answer') and '"name": "f"' in offline.tokenizer.decode(ids)
        r = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"tokenize": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        # one path with LLM.chat (conversation.py): any role, and the reasoning alias, reach the template (they were refused / dropped)
        turns = [{"role": "narrator", "content": "Once"}, {"role": "assistant", "content": "Yes", "reasoning": "think"}]
        template = "{% for m in messages %}[{{ m.role }}]{{ m.reasoning_content }}{{ m.content }}{% endfor %}"
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": turns, "max_tokens": 1, "chat_template": template})
        ids = offline.chat_prompt(turns, chat_template=template)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids), r.text
        assert offline.tokenizer.decode(ids) == "[narrator]Once[assistant]thinkYes"
        parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
        looped = "{% for m in messages %}{% if m.content is string %}S[{{ m.content }}]{% else %}{% for p in m.content %}P[{{ p.text }}]{% endfor %}{% endif %}{% endfor %}"
        for content_format, want in (("string", "S[one\ntwo]"), ("openai", "P[one]P[two]"), ("auto", "P[one]P[two]")):  # (auto: it loops over parts)
            assert offline.tokenizer.decode(offline.chat_prompt(parts, chat_template=looped, chat_template_content_format=content_format)) == want
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": parts, "max_tokens": 1, "chat_template": looped})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(offline.chat_prompt(parts, chat_template=looped)), r.text


def test_vllm_prompt_and_logprob_extras(server: Server, offline: LLM) -> None:
    """truncate_prompt_tokens keeps a prompt's last tokens (-1: what the context holds),
    return_tokens_as_token_ids names logprobs' tokens by id, vLLM's fields left at their defaults
    pass, and an assistant's refusal content part is its text."""
    prompt = list(range(40, 52))
    with httpx.Client(base_url=server.base, timeout=TIMEOUT) as client:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "truncate_prompt_tokens": 5, "logprobs": 1,
                "return_tokens_as_token_ids": True, "use_beam_search": False, "add_special_tokens": True, "priority": 0, "logits_processors": []}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        want = offline.generate([prompt[-5:]], SamplingParams(temperature=0, max_tokens=4))[0]
        got = r.json()["choices"][0]
        assert r.json()["usage"]["prompt_tokens"] == 5 and got["text"] == want.text
        assert got["logprobs"]["tokens"] == [f"token_id:{t}" for t in want.token_ids]
        assert all(k.startswith("token_id:") for top in got["logprobs"]["top_logprobs"] for k in top)
        r = client.post("/v1/completions", json={**body, "prompt": [40] * (CONTEXT + 5), "truncate_prompt_tokens": -1, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == CONTEXT - 1, r.text
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
                    {"role": "user", "content": "Please"}]
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2, "logprobs": True,
                                                      "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        as_text = [{**m, "content": "No."} if m["role"] == "assistant" else m for m in messages]
        assert r.json()["usage"]["prompt_tokens"] == len(offline.chat_prompt(as_text))
        assert all(e["token"].startswith("token_id:") for e in r.json()["choices"][0]["logprobs"]["content"])


def test_echo_and_prompt_logprobs(server: Server, offline: LLM) -> None:
    """echo puts the prompt (and its tokens' logprobs: null, then each given the ones before) before
    the completion; max_tokens 0 with echo scores the prompt alone (lm-evaluation-harness's
    loglikelihood requests); vLLM's prompt_logprobs, per choice on completions and on the response
    for chat; streamed, the same text."""
    text = "Hello there, my friend"
    ids = offline.engine.encode_prompt(text)
    model = torch.log_softmax(offline.compute_logits(ids), dim=-1)
    given = [model[i - 1, ids[i]].item() for i in range(1, len(ids))]  # each token given the ones before
    with httpx.Client(base_url=server.base, timeout=TIMEOUT) as client:
        body = {"model": MODEL, "prompt": text, "echo": True, "max_tokens": 0, "logprobs": 2, "temperature": 0}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        assert choice["text"] == text and choice["finish_reason"] == "length" and usage["completion_tokens"] == 0
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["text_offset"][-1] + len(lp["tokens"][-1]) == len(text)  # (offsets in the echoed text: a BOS the tokenizer added takes none)
        bos = offline.tokenizer.bos_token_id
        for prompt in ([bos, *ids[1:]] if bos is not None else ids, text):  # token ids (BOS shown) and text
            r = client.post("/v1/completions", json={**body, "prompt": prompt})
            lp, echoed = r.json()["choices"][0]["logprobs"], r.json()["choices"][0]["text"]
            assert all(echoed[off:].startswith(tok) for off, tok in zip(lp["text_offset"], lp["tokens"]) if tok in echoed), (echoed, lp)
        assert lp["token_logprobs"][1:] == pytest.approx(given, abs=1e-3)
        assert all(len(top) <= 3 for top in lp["top_logprobs"][1:])
        want = offline.generate([text], SamplingParams(temperature=0, max_tokens=3, logprobs=2))[0]
        r = client.post("/v1/completions", json={**body, "max_tokens": 3})
        choice = r.json()["choices"][0]
        assert choice["text"] == text + want.text and len(choice["logprobs"]["tokens"]) == len(ids) + 3
        assert choice["logprobs"]["token_logprobs"][len(ids):] == pytest.approx([float(d[t]) for d, t in zip(want.logprobs, want.token_ids)], abs=1e-3)
        with client.stream("POST", "/v1/completions", json={**body, "max_tokens": 3, "stream": True}) as stream:
            chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
        assert chunks[0]["choices"][0]["text"].startswith(text), [c["choices"] for c in chunks]
        assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1, "prompt_logprobs": 1})
        plp = r.json()["choices"][0]["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids) and all(str(t) in e and len(e) <= 2 for t, e in zip(ids[1:], plp[1:]))
        assert [e[str(t)]["logprob"] for t, e in zip(ids[1:], plp[1:])] == pytest.approx(given, abs=1e-3)
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1,
                                                      "prompt_logprobs": 0})
        assert r.status_code == 200 and len(r.json()["prompt_logprobs"]) == r.json()["usage"]["prompt_tokens"], r.text
        assert client.post("/v1/completions", json={**body, "echo": False}).status_code == 400  # (max_tokens 0 without echo)


def test_choices_carry_stop_reason(server: Server) -> None:
    """vLLM's stop_reason: the stop string (or stop token id) that ended a choice, null otherwise;
    on the whole response and on the last chunk of a stream."""
    with httpx.Client(base_url=server.base, timeout=TIMEOUT) as client:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        free = client.post("/v1/completions", json=body).json()["choices"][0]
        assert free["stop_reason"] is None and free["finish_reason"] == "length"
        stop = free["text"][2:4]
        cut = client.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
        assert (cut["finish_reason"], cut["stop_reason"], cut["text"]) == ("stop", stop, free["text"][: free["text"].index(stop)])
        with client.stream("POST", "/v1/completions", json={**body, "stop": [stop], "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["stop_reason"] == stop


def test_openai_client_sees_typed_errors(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="Hi")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=CONTEXT)
    assert info.value.code == "context_length_exceeded"


def test_open_requests_end_before_a_long_step_does(loop: EngineLoop) -> None:
    """On a signal the server ends every open request at once (end_open_requests), not after the
    step in progress: a prefill step longer than uvicorn's graceful wait (10 s) got its client a
    bare-text 500 from uvicorn's cancellation. The loop frees their blocks after the step."""
    engine = loop.engine
    real_step, started, release = engine.step, threading.Event(), threading.Event()

    def slow_step():
        started.set()
        release.wait(TIMEOUT)
        return real_step()

    engine.step = slow_step
    try:
        handles = [loop.add_request("Hello", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, n=n)) for n in (1, 2)]
        assert started.wait(TIMEOUT)
        loop.end_open_requests()
        finals = [[o for o in h if o.finish_reason] for h in handles]  # (would block until the step ends)
        assert [sorted(o.index for o in f) for f in finals] == [[0], [0, 1]]
        assert all(o.finish_reason == "error" and o.error == SHUTDOWN_MESSAGE for f in finals for o in f)
        assert not release.is_set()
        loop.shutdown(wait=False)
    finally:
        release.set()
    loop.shutdown(timeout=15)
    assert not loop.is_running and engine.blocks.num_used == 0


# -- the command ----------------------------------------------------------------------------------------
def test_cli_serve_sigterm_ends_streams_and_exits_0(model_dir: str, tmp_path: Any) -> None:
    """`fasterllama serve` on a free loopback port, keyed from FASTERLLAMA_API_KEY: answers, then
    on SIGTERM ends an open stream with an error event and exits 0."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "FASTERLLAMA_API_KEY": "k3y", "PYTHONUNBUFFERED": "1"}
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "fasterllama", "serve", "--model", model_dir, "--port", str(port), "-q",
                                 "--served-model-name", MODEL, "--max-num-seqs", "2", "--max-num-batched-tokens", "64",
                                 "--trust-request-chat-template"], stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        assert httpx.get(base + "/v1/models", timeout=TIMEOUT).status_code == 401
        headers = {"Authorization": "Bearer k3y"}
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi " * 100}], "max_tokens": 2,
                "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}  # (trusted here; its prompt in steps of 64)
        r = httpx.post(base + "/v1/chat/completions", json=chat, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 64, r.text
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": CONTEXT - 16, "ignore_eos": True, "stream": True}
        events: list[Any] = []
        with httpx.stream("POST", base + "/v1/completions", json=body, headers=headers, timeout=TIMEOUT) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    if len(events) == 2:
                        proc.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["message"] == SHUTDOWN_MESSAGE
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_only_json_bodies_are_read(server_one: Server) -> None:
    """A body labelled text or form (what a web page may POST to any origin without a CORS
    preflight; from a page elsewhere the Origin check refuses it first) gets a 415 and starts no
    generation; JSON with a charset, application/*+json and no Content-Type at all are read as JSON."""
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    with httpx.Client(base_url=server_one.base, timeout=TIMEOUT) as client:
        before = metric(server_one.metrics(), "fasterllama_requests_total", 'status="ok"')
        for content_type in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            for path in ("/v1/completions", "/tokenize"):
                r = client.post(path, content=body, headers={"Content-Type": content_type})
                assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", (content_type, path, r.text)
                r = client.post(path, content=body, headers={"Content-Type": content_type, "Origin": "https://evil.example"})
                assert r.status_code == 403, r.text  # (a page elsewhere: refused first, whatever the body)
        assert metric(server_one.metrics(), "fasterllama_requests_total", 'status="ok"') == before
        for content_type in ("application/json; charset=utf-8", "APPLICATION/JSON", "application/vnd.api+json", None):
            headers = {} if content_type is None else {"Content-Type": content_type}
            r = client.post("/v1/completions", content=body, headers=headers)
            assert r.status_code == 200, (content_type, r.text)


def test_fuzzed_bodies_never_get_a_5xx(server_one: Server) -> None:
    """600 bodies from hypothesis (hostile ones: fields of both endpoints with values of every JSON
    type, out-of-range numbers, unknown keys, non-JSON bytes; valid ones, and valid ones with one or
    two fields made hostile): each gets a 2xx or a 4xx with an OpenAI error body, never a 5xx or a
    hang; the server answers normally after, with no KV slot held. (The HTTP layer: one model
    process is enough.)"""
    server = server_one
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
                       st.text(max_size=20), st.sampled_from([MODEL, "gpt-4", "", "\x00", "\ud7ff" * 3]))
    value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                         max_leaves=8)
    small = st.one_of(st.integers(1, 4), value)  # generation stays short whenever the value is valid
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]) | value, "content": value | st.text(max_size=30)})
    fields = {
        "model": st.just(MODEL) | value, "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 400), max_size=8) | value,
        "messages": st.lists(message, max_size=3) | value, "max_tokens": small, "max_completion_tokens": small, "n": small,
        "temperature": st.floats(-1, 3) | value, "top_p": st.floats(-0.5, 1.5) | value, "top_k": st.integers(-2, 50) | value,
        "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=5) | value, "seed": st.integers(-(2**64), 2**64) | value,
        "logprobs": st.integers(-1, 25) | st.booleans() | value, "top_logprobs": st.integers(-1, 25) | value,
        "stream": st.booleans() | value, "stream_options": value, "presence_penalty": st.floats(-3, 3) | value,
        "repetition_penalty": st.floats(-1, 3) | value, "min_p": st.floats(-1, 2) | value, "ignore_eos": value,
    }
    body = st.fixed_dictionaries({}, optional=fields) | st.dictionaries(st.text(max_size=10), value, max_size=5)
    raw = st.binary(max_size=64) | st.sampled_from([b"", b"{", b"[]", b"null", b'{"model": "tiny", "prompt": "\\ud800"}', b"\xff\xfe"])
    sensible = {"temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(0, 50), "n": st.integers(1, 2),
                "seed": st.integers(0, 2**31), "stop": st.lists(st.text(max_size=3), max_size=2), "stream": st.booleans(),
                "presence_penalty": st.floats(-2, 2)}
    text_prompt = st.text(min_size=1, max_size=20) | st.lists(st.integers(3, 300), min_size=1, max_size=8)
    chat_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=20)})
    valid = st.tuples(st.just("/v1/completions"), st.fixed_dictionaries(
        {"model": st.just(MODEL), "prompt": text_prompt, "max_tokens": st.integers(1, 4)}, optional={**sensible, "logprobs": st.integers(0, 5)},
    )) | st.tuples(st.just("/v1/chat/completions"), st.fixed_dictionaries(
        {"model": st.just(MODEL), "messages": st.lists(chat_message, min_size=1, max_size=3), "max_tokens": st.integers(1, 4)}, optional=sensible,
    ))
    mutated = st.builds(lambda pb, m: (pb[0], {**pb[1], **m}), valid, st.dictionaries(st.sampled_from(sorted(fields)), value, max_size=2))
    request = st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"]), body | raw) | valid | mutated
    seen: list[int] = []
    deadline = time.monotonic() + 240

    with httpx.Client(base_url=server.base, timeout=TIMEOUT) as client:

        @hypothesis.settings(max_examples=600, deadline=None, derandomize=True, database=None,
                             suppress_health_check=list(hypothesis.HealthCheck))
        @hypothesis.given(request)
        def post(request: tuple[str, Any]) -> None:
            path, payload = request
            assert time.monotonic() < deadline, "fuzzing ran past its time bound"
            if isinstance(payload, bytes):
                r = client.post(path, content=payload, headers={"Content-Type": "application/json"})
            else:
                r = client.post(path, content=json.dumps(payload, allow_nan=False), headers={"Content-Type": "application/json"})
            seen.append(r.status_code)
            assert r.status_code < 500, (path, payload, r.status_code, r.text[:300])
            if r.status_code >= 400:
                assert isinstance(r.json()["error"]["message"], str), r.text[:300]

        post()
        assert len(seen) >= 500 and any(s >= 400 for s in seen) and any(s == 200 for s in seen)
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    wait_for(lambda: slots_free(server), what="every KV slot free after fuzzing")


def test_tokenize_and_detokenize(server_one: Server, offline: LLM) -> None:
    """vLLM's /tokenize (a prompt, or a conversation as chat renders it) and /detokenize give the
    model's own tokens and text, a prompt over the context included (counting is what they are
    for); bad bodies get 400s, another model a 404; /version answers."""
    import fasterllama

    tok = offline.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    with httpx.Client(base_url=server_one.base, timeout=TIMEOUT) as client:
        r = client.post("/tokenize", json={"model": MODEL, "prompt": "Hello there"})
        assert r.status_code == 200, r.text
        assert r.json() == {"count": len(tok.encode("Hello there")), "max_model_len": CONTEXT, "tokens": tok.encode("Hello there"), "token_strs": None}
        r = client.post("/tokenize", json={"prompt": "Hello there", "add_special_tokens": False, "return_token_strs": True}).json()
        assert r["tokens"] == tok.encode("Hello there", add_special_tokens=False) and r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
        chat = client.post("/tokenize", json={"messages": messages}).json()
        assert chat["tokens"] == offline.chat_prompt(messages) and chat["count"] == len(chat["tokens"])
        continued = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
        assert continued["tokens"] == offline.chat_prompt(messages, add_generation_prompt=False) != chat["tokens"]
        long = client.post("/tokenize", json={"prompt": "word " * CONTEXT}).json()
        assert long["count"] > long["max_model_len"] == CONTEXT
        ids = chat["tokens"]
        r = client.post("/detokenize", json={"model": MODEL, "tokens": ids})
        assert r.status_code == 200 and r.json() == {"prompt": tok.decode(ids)}
        for path, body, status, param in [("/tokenize", {"prompt": 5}, 400, "prompt"), ("/tokenize", {}, 400, None),
                                          ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
                                          ("/tokenize", {"messages": []}, 400, "messages"), ("/tokenize", {"prompt": "\ud800"}, 400, None),
                                          ("/detokenize", {"tokens": [tm.SPECS["gqa"].vocab_size]}, 400, "tokens"),
                                          ("/detokenize", {"tokens": [1.5]}, 400, "tokens"), ("/detokenize", {"tokens": "abc"}, 400, "tokens")]:
            r = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
            assert r.status_code == status and (param is None or (r.json()["error"]["param"] or "").startswith(param)), (path, body, r.text)
        assert client.post("/tokenize", content=b"{not json", headers={"Content-Type": "application/json"}).status_code == 400
        deep = b'{"prompt": "x", "a": ' + b"[" * 5000 + b"]" * 5000 + b"}"  # (json.loads: RecursionError, not a ValueError)
        r = client.post("/tokenize", content=deep, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "error" in r.json(), r.text
        assert client.post("/tokenize", json={"prompt": "Hello there", "messages": None}).json()["tokens"] == tok.encode("Hello there")
        assert client.get("/version").json() == {"version": fasterllama.__version__}
        with_bos = client.post("/tokenize", json={"messages": messages, "add_special_tokens": True}).json()["tokens"]
        assert with_bos == tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=True)
        info = client.get("/tokenizer_info").json()  # (lm-evaluation-harness's remote tokenizer starts here)
        assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token and info["model_max_length"] == CONTEXT
        assert info["chat_template"] == CHAT_TEMPLATE and info["add_bos_token"] == (tok.encode("a")[:1] == [tok.bos_token_id])


def test_release_openmp_threads_frees_the_idle_team_and_torch_still_runs() -> None:
    """serve() releases the main thread's idle OpenMP team (so the engine thread's team is the
    runtime's only one and keeps its full idle spin); a later parallel op builds a new team and
    computes as before. In a fresh process, whose threads are known."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("counts threads in /proc (Linux)")
    code = (
        "import os, torch\n"
        "from fasterllama.server.run import release_openmp_threads\n"
        "torch.manual_seed(0); x = torch.randn(512, 512); before = (x @ x).sum().item()\n"
        "n0 = len(os.listdir('/proc/self/task'))\n"
        "released = release_openmp_threads()\n"
        "n1 = len(os.listdir('/proc/self/task'))\n"
        "print(released, torch.get_num_threads(), n0, n1, (x @ x).sum().item() == before)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout.split()
    released, threads, n0, n1, same = out[0] == "True", int(out[1]), int(out[2]), int(out[3]), out[4] == "True"
    assert same
    if not released:
        pytest.skip("no OpenMP runtime with omp_pause_resource_all loaded")
    if threads > 1:
        assert n1 <= n0 - (threads - 1), (n0, n1)  # the team's workers are gone


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                                          "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"], "additionalProperties": False}}}]


def streamed_tool_calls(stream: Any) -> tuple[str, list[dict[str, str]], str | None]:
    """(content, calls as {"id", "name", "arguments"}, finish_reason) put together from a chat stream's deltas."""
    content, calls, finish = "", [], None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for call in c.delta.tool_calls or []:
                if call.index == len(calls):
                    calls.append({"id": call.id, "name": call.function.name, "arguments": ""})
                calls[call.index]["arguments"] += call.function.arguments or ""
            finish = c.finish_reason or finish
    return content, calls, finish


def test_tool_calls_over_http(server_one: Server, offline: LLM) -> None:
    """OpenAI tool calling: a named tool_choice or "required" constrains the reply to the call's
    JSON (any model calls it: arguments as the offline engine constrained to the same schema
    writes them); "auto" reads calls from the reply (here a Hermes-style call the regex makes the
    model write); streamed deltas put together give the same calls; the template is shown the tools."""
    client = server_one.client()
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    weather = TOOLS[0]["function"]["parameters"]
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=40, json_schema=weather), tools=TOOLS)[0]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=named, max_tokens=40, temperature=0)
    message = r.choices[0].message
    assert message.content is None and r.choices[0].finish_reason == ref.finish_reason == "stop"
    assert [(c.type, c.function.name, c.function.arguments) for c in message.tool_calls] == [("function", "get_weather", ref.text)]
    assert isinstance(json.loads(ref.text)["city"], str) and message.tool_calls[0].id.startswith("call_")
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=named, max_tokens=40,
                                            temperature=0, stream=True)
    content, calls, finish = streamed_tool_calls(stream)
    assert (content, [(c["name"], c["arguments"]) for c in calls], finish) == ("", [("get_weather", ref.text)], "stop")

    from fasterllama.server.tools import forced_call_schema

    schema = forced_call_schema({t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}, "required", False)
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=80, json_schema=schema), tools=TOOLS)[0]
    want = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(ref.text)]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=80, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] == want and len(want) == 1
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                            max_tokens=80, temperature=0, stream=True)
    content, calls, finish = streamed_tool_calls(stream)
    assert (content, [(c["name"], c["arguments"]) for c in calls], finish) == ("", want, "tool_calls")

    regex = r'Checking\.\n<tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=200, temperature=0,
                                       extra_body={"guided_regex": regex})
    assert r.choices[0].message.tool_calls, r
    (call,) = r.choices[0].message.tool_calls
    assert (r.choices[0].message.content, call.function.name, r.choices[0].finish_reason) == ("Checking.\n", "add", "tool_calls")
    assert set(json.loads(call.function.arguments)) == {"a", "b"}
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=200, temperature=0, stream=True,
                                            extra_body={"guided_regex": regex})
    assert streamed_tool_calls(stream)[::2] == ("Checking.\n", "tool_calls")
    free = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="auto", max_tokens=8, temperature=0)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert free.choices[0].message.content == plain.choices[0].message.content and not free.choices[0].message.tool_calls

    with httpx.Client(base_url=server_one.base, timeout=TIMEOUT) as http:
        template = "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 1, "chat_template": template})
        assert r.json()["usage"]["prompt_tokens"] == len(offline.chat_prompt(messages, chat_template=template, tools=TOOLS)), r.text
        for extra, fragment in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
                                ({"tool_choice": "required", "tools": None}, "needs tools"),
                                ({"tool_choice": "sometimes"}, "tool_choice"),
                                ({"tool_choice": named, "response_format": {"type": "json_object"}}, "does not combine"),
                                ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
                                ({"tools": [TOOLS[0], TOOLS[0]]}, "twice"),
                                ({"tools": [{"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}]}, "type 'object'"),
                                ({"tools": None, "functions": [TOOLS[0]["function"]]}, "deprecated")):
            r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 4, **extra})
            assert r.status_code == 400 and fragment in r.text, (extra, r.text)
            assert r.json()["error"]["param"].split(".")[0] in ("tool_choice", "tools", "functions"), r.text
        # the stream's shape, as OpenAI's: a forced call's first delta has null content; the finish comes in a chunk of its own
        body = {"model": MODEL, "messages": messages, "tools": TOOLS, "tool_choice": "required", "max_tokens": 80, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            events = [e["choices"][0] for e in sse_events(r) if e != "[DONE]"]
        assert events[0]["delta"] == {"role": "assistant", "content": None}
        assert "tool_calls" in events[-2]["delta"] and (events[-2]["finish_reason"], events[-1]["delta"], events[-1]["finish_reason"]) == (None, {}, "tool_calls")
        # functions named like the modes are forced by name ("auto" was read as the mode: no call; "required" as that mode)
        for name in ("auto", "required"):
            tool = {"type": "function", "function": {"name": name, "parameters": TOOLS[1]["function"]["parameters"]}}
            r = http.post("/v1/chat/completions", json={**body, "stream": False, "tools": [tool], "max_tokens": 200,
                                                        "tool_choice": {"type": "function", "function": {"name": name}}})
            choice = r.json()["choices"][0]
            assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == [name] and choice["finish_reason"] == "stop", r.text
        # a pydantic tool's $defs (a 400 under "required": its references did not resolve), objects closed to their properties
        address = {"type": "object", "properties": {"street": {"type": "string", "maxLength": 10}}, "required": ["street"]}
        move = {"type": "function", "function": {"name": "move", "parameters": {
            "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}}, "required": ["to"], "$defs": {"Address": address}}}}
        r = http.post("/v1/chat/completions", json={**body, "tools": [move], "stream": False, "max_tokens": 200, "parallel_tool_calls": False})
        assert r.status_code == 200 and "tool_calls" in r.json()["choices"][0]["message"], r.text
        (call,) = r.json()["choices"][0]["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"]).keys() == {"to"} and json.loads(call["function"]["arguments"])["to"].keys() == {"street"}
