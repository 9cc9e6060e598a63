"""Serving benchmark: `fasterllama serve` under streamed chat load, against offline LLM.generate.

    python benchmarks/serve.py [--model M] [--concurrency 1,8,32] [--num-requests 64] [--max-tokens 64]
                               [--max-num-seqs 16] [--client httpx|raw] [--rounds 1] [--json out.json]

Starts `fasterllama serve` as a subprocess on 127.0.0.1 (a free port), waits for /health, and
sends a fixed set of chat requests (16 prompt lengths, greedy, ignore_eos, so every request
generates exactly --max-tokens tokens) with stream=true at each concurrency level, at most
`concurrency` in flight: through an httpx AsyncClient, or with --client raw a hand-written
HTTP/1.1 client that spends a third of httpx's CPU per token (the client shares the machine).
Per level: requests/s, output tokens/s, time to first token (TTFT: from sending a request to its
first chunk with content), inter-token latency (ITL: between consecutive content chunks of a
stream), p50/p99, and the CPU time the server process and this client process spent per token.

Offline `LLM.generate` of the same prompts, with the same SamplingParams and max_num_seqs, runs
in this process before the first round of levels and after each round, while the server is up
but idle (never alongside a level: the CPU is shared); each level's output tokens/s is reported
as a ratio to the mean of the offline runs either side of its round (target: >= 0.8 at the
highest concurrency). Every pass (a level, an offline run) has prompts of its own, so prefix
caching reuses nothing across passes. On a machine shared with other work, --rounds 2 or 3
gives a median ratio. Every wait is bounded (--timeout for the server's start and each level).
Results: docs/performance.md, Serving."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import httpx

SERVED_NAME = "bench"
SYSTEM = "You are a helpful assistant. Answer in plain prose."
TOPICS = [
    "how a refrigerator keeps food cold", "the water cycle", "why the sky is blue", "how vaccines train the immune system",
    "the rules of chess", "what a compiler does", "how bees make honey", "the causes of the seasons",
    "how a bicycle stays upright", "what inflation is", "how tides work", "the life cycle of a star",
    "how a hash table works", "why bread rises", "how airplanes fly", "what a neural network is",
]
FILLER = ("Please be thorough and concrete, give one everyday example, mention a common misconception, and explain "
          "it as you would to a curious student who has read a little about it but wants the real mechanism. ")
REPEATS = [0, 1, 0, 2, 0, 4, 1, 0, 8, 0, 1, 2, 0, 1, 0, 3]  # filler repeats: prompts of 37 to 351 tokens (default model)


WARMUP = len(REPEATS)  # the server and offline warm up on requests 0..15 (every length once), 2 tokens each:
# a fresh engine's first steps at a new batch shape are slower
WARMUP_PASS = 99


def messages(i: int, run: int) -> list[dict[str, str]]:
    """Request i's conversation in measured pass `run` (10..98): deterministic, lengths cycling
    through REPEATS. Its first block of tokens is unique to (run, i), so no pass reuses the KV
    cache blocks of an earlier one (prefix caching is on), and passes of the same i have the same
    length."""
    topic = TOPICS[i % len(TOPICS)]
    user = f"Question {run}-{i}: explain {topic}. " + FILLER * REPEATS[(i * 7) % len(REPEATS)]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user.strip()}]


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; nan for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# -- the client ----------------------------------------------------------------------------------
@dataclass
class RequestResult:
    ttft: float
    itls: list[float]
    tokens: int  # completion_tokens of the usage chunk
    latency: float


@dataclass
class Level:
    concurrency: int
    requests: int
    wall_s: float
    output_tokens: int
    requests_per_s: float
    output_tok_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    latency_p50_s: float
    server_cpu_s: float | None  # CPU time of the server process (every thread) over the level
    client_cpu_s: float  # CPU time of this process (the client) over the level
    ratio_to_offline: float | None = None


PATH = "/v1/chat/completions"


class HttpxSession:
    """The httpx AsyncClient (one pool shared by the workers of a level)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """The data fields of the response's SSE events."""
        async with self.client.stream("POST", PATH, json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    yield line[6:].encode()

    async def aclose(self) -> None:
        pass


class RawSession:
    """HTTP/1.1 by hand over one keep-alive asyncio connection (one per worker): about a third of
    httpx's CPU per streamed token, which on a small machine is CPU taken from the server."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        if self.conn is None:
            self.conn = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.conn
        data = json.dumps(body).encode()
        writer.write(f"POST {PATH} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        head = (await reader.readuntil(b"\r\n\r\n")).lower()
        status = int(head.split(b" ", 2)[1])
        if status != 200 or b"transfer-encoding: chunked" not in head:
            self.conn = None
            writer.close()
            raise RuntimeError(f"HTTP {status}: {head[:300]!r}")
        buf = b""
        while True:  # chunked body: size line, data, CRLF; a 0 size ends it
            size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return
            buf += chunk[:-2]
            *events, buf = buf.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    yield event[6:]

    async def aclose(self) -> None:
        if self.conn is not None:
            self.conn[1].close()


async def one_request(session: HttpxSession | RawSession, i: int, run: int, max_tokens: int) -> RequestResult:
    body = {"model": SERVED_NAME, "messages": messages(i, run), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    itls: list[float] = []
    tokens = None
    async for data in session.stream(body):  # read to the end (a raw connection is reused)
        if data == b"[DONE]":
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"request {i}: {chunk['error']}")
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if any(c["delta"].get("content") for c in chunk["choices"]):
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                itls.append(now - last)
            last = now
    end = time.perf_counter()
    if first is None or tokens is None:
        raise RuntimeError(f"request {i}: no content or no usage chunk")
    return RequestResult(first - t0, itls, tokens, end - t0)


def process_cpu_s(pid: int) -> float | None:
    """user + system CPU seconds of a process, every thread (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_level(base: str, client: str, concurrency: int, ids: list[int], run: int, max_tokens: int, timeout: float,
                    server_pid: int) -> Level:
    """Send requests `ids` of pass `run` with at most `concurrency` in flight; bounded by `timeout` seconds."""
    results: list[RequestResult] = []
    todo = list(reversed(ids))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    url = httpx.URL(base)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(timeout), limits=limits) as pool:

        async def worker() -> None:
            session = HttpxSession(pool) if client == "httpx" else RawSession(url.host, url.port or 80)
            try:
                while todo:
                    results.append(await one_request(session, todo.pop(), run, max_tokens))
            finally:
                await session.aclose()

        cpu0, server0, t0 = time.process_time(), process_cpu_s(server_pid), time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), timeout)
        wall = time.perf_counter() - t0
        client_cpu, server1 = time.process_time() - cpu0, process_cpu_s(server_pid)
    tokens = sum(r.tokens for r in results)
    ttfts = [r.ttft for r in results]
    itls = [x for r in results for x in r.itls]
    return Level(concurrency, len(results), wall, tokens, len(results) / wall, tokens / wall,
                 1e3 * percentile(ttfts, 50), 1e3 * percentile(ttfts, 99), 1e3 * percentile(itls, 50), 1e3 * percentile(itls, 99),
                 percentile([r.latency for r in results], 50), None if server0 is None or server1 is None else server1 - server0,
                 client_cpu)


# -- the server ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(cmd: list[str], base: str, timeout: float) -> Iterator[int]:
    """`cmd` running until /health answers 200; SIGTERM (then kill) on exit. Its log is shown if it
    fails. It runs in the folder holding the fasterllama package this process imports, with that
    folder first on its path, so the server and offline run the same code."""
    import fasterllama  # light: the API loads on first use

    root = os.path.dirname(os.path.dirname(os.path.abspath(fasterllama.__file__)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    with tempfile.TemporaryFile("w+") as log:

        def output() -> str:
            log.flush()
            log.seek(0)
            return log.read()[-4000:]

        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited ({proc.returncode}):\n{output()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s:\n{output()}")
                try:
                    if httpx.get(base + "/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            yield proc.pid
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


# -- offline -----------------------------------------------------------------------------------------
class Offline:
    """LLM.generate of the benchmark's requests: the server's prompt token ids, SamplingParams and max_num_seqs."""

    def __init__(self, args: argparse.Namespace, ids: list[int]) -> None:
        from fasterllama import LLM, SamplingParams

        self.llm = LLM(args.model, quantization=args.quantization, max_num_seqs=args.max_num_seqs, progress=False)
        self.params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        self.ids = ids
        warmup = [self.llm.chat_prompt(messages(i, WARMUP_PASS)) for i in range(WARMUP)]
        self.llm.generate(warmup, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))

    def run(self, run: int) -> dict[str, float]:
        prompts = [self.llm.chat_prompt(messages(i, run)) for i in self.ids]
        cpu0, t0 = time.process_time(), time.perf_counter()
        outs = self.llm.generate(prompts, self.params)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"requests": len(prompts), "wall_s": wall, "output_tokens": tokens, "output_tok_per_s": tokens / wall,
                "cpu_s": cpu, "prompt_tokens": sum(len(p) for p in prompts)}


# -- main ----------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file, HF folder or known name (default: the default model)")
    ap.add_argument("--quantization", default=None, help="as LLM / fasterllama serve (default: theirs)")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated levels (default 1,8,32)")
    ap.add_argument("--num-requests", type=int, default=64, help="requests per level, and offline (default 64)")
    ap.add_argument("--serial-requests", type=int, default=16, help="requests at concurrency 1 (default 16: every prompt length once)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="most sequences decoded together, server and offline (default 16, the server's)")
    ap.add_argument("--client", choices=["httpx", "raw"], default="httpx",
                    help="httpx AsyncClient (default), or raw: HTTP/1.1 by hand on asyncio streams, a third of the CPU per token")
    ap.add_argument("--rounds", type=int, default=1, help="server levels and offline runs alternate this many times (default 1)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds allowed for each level and for server start (default 300)")
    ap.add_argument("--no-offline", action="store_true", help="skip the offline runs (and the ratio)")
    ap.add_argument("--json", default=None, help="also write the results as JSON to this file")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.rounds * len(levels) > 80:
        ap.error("at most 80 levels in all (--rounds x concurrency levels)")
    command = shlex.join(["python", *sys.argv])
    log = functools.partial(print, file=sys.stderr, flush=True)

    # offline runs while the server is up but idle (its threads sleep), between rounds of levels
    off = None if args.no_offline else Offline(args, list(range(args.num_requests)))
    offline_runs: list[dict[str, float]] = []

    def run_offline() -> None:
        if off is not None:
            offline_runs.append(off.run(10 + len(offline_runs)))
            log(f"offline: {offline_runs[-1]['output_tok_per_s']:.1f} output tok/s")

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "fasterllama", "serve", "--host", "127.0.0.1", "--port", str(port), "-q",
           "--served-model-name", SERVED_NAME, "--max-num-seqs", str(args.max_num_seqs)]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--quantization", args.quantization] if args.quantization else []
    rounds: list[list[Level]] = []
    passes = 0  # server levels run so far (each its own prompts: see messages)
    with running_server(cmd, base, args.timeout) as pid:
        asyncio.run(run_level(base, args.client, WARMUP, list(range(WARMUP)), WARMUP_PASS, 2, args.timeout, pid))
        run_offline()
        for _ in range(args.rounds):
            rounds.append([])
            for c in levels:
                n = args.serial_requests if c == 1 else args.num_requests
                rounds[-1].append(asyncio.run(run_level(base, args.client, c, list(range(n)), 10 + passes, args.max_tokens, args.timeout,
                                                        pid)))
                passes += 1
                log(f"concurrency {c}: {rounds[-1][-1].output_tok_per_s:.1f} output tok/s")
            run_offline()

    for k, levels_k in enumerate(rounds):  # each round against the mean of the offline runs either side of it
        ref = (offline_runs[k]["output_tok_per_s"] + offline_runs[k + 1]["output_tok_per_s"]) / 2 if offline_runs else None
        for r in levels_k:
            r.ratio_to_offline = r.output_tok_per_s / ref if ref else None
            if r.output_tokens != r.requests * args.max_tokens:
                log(f"warning: concurrency {r.concurrency} generated {r.output_tokens} tokens, not {r.requests} x {args.max_tokens}")

    print(f"\n$ {command}")
    print(f"model {args.model or 'default'}, max_num_seqs {args.max_num_seqs}, {args.max_tokens} tokens per request "
          f"(greedy, ignore_eos), streamed chat, {args.client} client; {os.cpu_count()} CPUs\n")
    head = (f"{'round':>5} {'conc':>4} {'reqs':>4} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
            f"{'ITL p99':>8} {'vs offline':>10} {'CPU ms/tok srv+cli':>18}")
    print(head)
    print("-" * len(head))
    for k, levels_k in enumerate(rounds):
        for r in levels_k:
            ratio = f"{r.ratio_to_offline:.2f}" if r.ratio_to_offline else "-"
            srv = "-" if r.server_cpu_s is None else f"{1e3 * r.server_cpu_s / r.output_tokens:.1f}"
            cpu = f"{srv}+{1e3 * r.client_cpu_s / r.output_tokens:.1f}"
            print(f"{k + 1:>5} {r.concurrency:>4} {r.requests:>4} {r.requests_per_s:>7.2f} {r.output_tok_per_s:>9.1f} "
                  f"{r.ttft_p50_ms:>7.0f}ms {r.ttft_p99_ms:>7.0f}ms {r.itl_p50_ms:>6.1f}ms {r.itl_p99_ms:>6.1f}ms {ratio:>10} {cpu:>18}")
    summary: dict[str, Any] = {}
    if offline_runs:
        runs = ", ".join(f"{r['output_tok_per_s']:.1f}" for r in offline_runs)
        cpu_ms = 1e3 * sum(r["cpu_s"] for r in offline_runs) / sum(r["output_tokens"] for r in offline_runs)
        print(f"offline LLM.generate ({args.num_requests} requests, max_num_seqs {args.max_num_seqs}): {runs} output tok/s "
              f"(runs before, between and after the rounds), {cpu_ms:.1f} CPU ms/tok")
        top = max(levels)
        ratios = [r.ratio_to_offline for levels_k in rounds for r in levels_k if r.concurrency == top]
        summary = {"concurrency": top, "ratio": statistics.median(ratios)}
        print(f"output tok/s at concurrency {top} / offline: {summary['ratio']:.2f}"
              f"{' (median of rounds)' if len(ratios) > 1 else ''} (target >= 0.8)")
        server_ms = [1e3 * r.server_cpu_s / r.output_tokens for levels_k in rounds for r in levels_k
                     if r.concurrency == top and r.server_cpu_s is not None]
        if server_ms and cpu_ms > 1.5 * statistics.median(server_ms):
            print(f"note: offline spent {cpu_ms:.1f} CPU ms per token, the server {statistics.median(server_ms):.1f}: offline's "
                  "OpenMP threads spun against other load on this machine, so the ratio overstates the server "
                  "(docs/performance.md, Serving)")
    if args.json:
        out = {"command": command, "model": args.model, "max_num_seqs": args.max_num_seqs, "max_tokens": args.max_tokens,
               "client": args.client, "cpus": os.cpu_count(), "rounds": [[asdict(r) for r in levels_k] for levels_k in rounds], "offline": offline_runs,
               "summary": summary}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
