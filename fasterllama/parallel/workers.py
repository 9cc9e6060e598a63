"""Starting the ranks of a tensor-parallel engine: N-1 spawned worker processes on this machine
(`LLMEngine(tensor_parallel_size=N)`), or every process of a `torchrun` launch (several machines).

Every rank builds the engine a single process builds (load, quantize), then keeps its shard
(sharding.py) and a KV cache of its heads; rank 0 schedules and samples, the others run
ModelRunner.run_worker. The machine's threads are divided between the ranks of one machine."""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import FasterLlamaError
from .group import DEFAULT_TIMEOUT, Rendezvous, TPGroup


@dataclass
class Workers:
    """Rank 0's handle on the processes it spawned (none under torchrun)."""

    processes: list[Any] = field(default_factory=list)

    def describe_failures(self, grace: float = 2.0) -> str:
        """Which workers exited. A closed connection can fail rank 0's send before the killed
        worker is reaped, so wait up to `grace` seconds for one to exit (a hung one never does)."""
        deadline = time.monotonic() + grace
        while self.processes and all(p.exitcode is None for p in self.processes) and time.monotonic() < deadline:
            multiprocessing.connection.wait([p.sentinel for p in self.processes], timeout=min(0.1, max(0.0, deadline - time.monotonic())))
        dead = [f"rank {i + 1} exited with code {p.exitcode}" for i, p in enumerate(self.processes) if p.exitcode is not None]
        return "; ".join(dead)

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for the workers to exit (after the stop command), then end any that did not."""
        for p in self.processes:
            p.join(timeout)
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(2)
            if p.is_alive():
                p.kill()
                p.join()


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when this process was started by torchrun with several ranks."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


def _timeout() -> float:
    return float(os.environ.get("FASTERLLAMA_TP_TIMEOUT", DEFAULT_TIMEOUT))


def _threads_per_rank(ranks_here: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(torch.get_num_threads(), cores) // ranks_here)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def start(size: int, device: torch.device, engine_kwargs: dict[str, Any]) -> tuple[TPGroup, Workers]:
    """Rank 0's side: this process becomes rank 0 of `size` ranks; the others start here (spawned
    workers building the engine from engine_kwargs) or were started by torchrun."""
    env = torchrun_env()
    if env is not None:
        rank, world, local = env
        if size not in (1, world):
            raise FasterLlamaError(f"tensor_parallel_size {size} differs from torchrun's {world} processes")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(_threads_per_rank(local_world))
        store = None
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent hosts the store: join it
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                                  timeout=datetime.timedelta(seconds=300))
            store = dist.PrefixStore(f"fasterllama/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        rendezvous = Rendezvous(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), _timeout())
        return TPGroup(rank, world, rendezvous, rank_device(device, local), store), Workers()
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise FasterLlamaError(f"tensor_parallel_size {size} needs {size} GPUs, this machine has {torch.cuda.device_count()}")
    threads = _threads_per_rank(size)
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=datetime.timedelta(seconds=300), wait_for_workers=False)
    ctx = torch.multiprocessing.get_context("spawn")
    workers = Workers([ctx.Process(target=_worker_main, args=(rank, size, store.port, threads, _timeout(), device.type, engine_kwargs), daemon=True,
                                   name=f"fasterllama-tp{rank}") for rank in range(1, size)])
    for p in workers.processes:
        p.start()
    try:
        _wait_until_up(store, workers)
        group = TPGroup(0, size, Rendezvous("127.0.0.1", store.port, _timeout()), rank_device(device, 0), store)
    except BaseException:
        workers.stop(0)
        raise
    return group, workers


def _wait_until_up(store: dist.TCPStore, workers: Workers, timeout: float = 300.0) -> None:
    """Until every spawned worker has said it runs (a key in the store): one that exits before (a
    script without the `__main__` guard, whose import spawns again; an import error) fails here,
    where the group's rendezvous would wait for it forever."""
    keys = [f"up/{rank}" for rank in range(1, len(workers.processes) + 1)]
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        dead = workers.describe_failures(grace=0)
        if dead:
            raise FasterLlamaError(f"tensor-parallel worker {dead} before joining (a script that makes an LLM with tensor_parallel_size > 1 "
                                   "needs the `if __name__ == \"__main__\":` guard; the worker's error is above)")
        if time.monotonic() > deadline:
            raise FasterLlamaError(f"tensor-parallel workers did not start within {timeout:.0f} s")
        multiprocessing.connection.wait([p.sentinel for p in workers.processes], timeout=0.05)


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the process that spawned it exits, however it exits."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_main(rank: int, size: int, port: int, threads: int, timeout: float, device_type: str, engine_kwargs: dict[str, Any]) -> None:
    """A spawned worker: join the group, build the engine on it as rank 0 does (loading its shard), serve steps."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops us
    torch.set_num_threads(threads)
    from ..engine.llm_engine import LLMEngine

    device = rank_device(torch.device(device_type), rank)
    try:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=datetime.timedelta(seconds=300))
        store.set(f"up/{rank}", "1")  # (rank 0 waits for it before the group's rendezvous: _wait_until_up)
        group = TPGroup(rank, size, Rendezvous("127.0.0.1", port, timeout), device, store)
        engine = LLMEngine(**{**engine_kwargs, "device": str(device), "progress": False, "tp_group": group})
        engine.runner.run_worker()
    except FasterLlamaError as e:
        print(f"fasterllama tensor-parallel rank {rank}: {e}", file=sys.stderr)
        sys.exit(1)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
