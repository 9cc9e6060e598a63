"""The ranks of one tensor-parallel model and the collectives between them, on torch.distributed.

Two process groups over one TCP store: `control` (gloo, CPU tensors) carries rank 0's commands
(each step's token ids, positions and block tables, pickled; KV block copies; stop), and `data`
(gloo on the CPU, NCCL on CUDA) the activations' all-reduces and the logits' gather. The groups
are objects of their own rather than torch.distributed's global default group, so one process can
hold several engines one after another (tests) and nothing leaks between them.

A collective that a dead peer can never finish fails when the connection drops; one that a hung
peer never finishes fails after `timeout` seconds. Workers wait for commands without a timeout
(a server may idle for hours); a rank 0 that dies closes their connections, which ends them."""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import FasterLlamaError

DEFAULT_TIMEOUT = 60.0  # seconds a collective may wait for a peer that has stopped answering
_FOREVER = datetime.timedelta(days=365)


class WorkerFailure(FasterLlamaError):
    """A peer rank died or stopped answering: the tensor-parallel engine cannot go on."""


@dataclass
class Rendezvous:
    """Where the ranks meet: rank 0 listens on host:port (port 0 picks a free one)."""

    host: str = "127.0.0.1"
    port: int = 0
    timeout: float = DEFAULT_TIMEOUT


class TPGroup:
    def __init__(self, rank: int, size: int, rendezvous: Rendezvous, device: torch.device, store: dist.Store | None = None) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.timeout = datetime.timedelta(seconds=rendezvous.timeout)
        if store is None:
            store = dist.TCPStore(rendezvous.host, rendezvous.port, size, is_master=rank == 0, timeout=datetime.timedelta(seconds=300))
        self.store = store
        self.port = store.port if isinstance(store, dist.TCPStore) else rendezvous.port
        self.traffic: dict[str, list[int]] = {}  # collective -> [calls, bytes this rank sent] (benchmarks/tensor_parallel.py)
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, size, _FOREVER)
        if device.type == "cuda":
            self.data = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, size)
        else:
            self.data = dist.ProcessGroupGloo(dist.PrefixStore("data", store), rank, size, self.timeout)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def _count(self, what: str, t: torch.Tensor) -> None:
        entry = self.traffic.setdefault(what, [0, 0])
        entry[0] += 1
        entry[1] += t.numel() * t.element_size()

    def _wait(self, start: Callable[[], list[dist.Work]], what: str, timeout: datetime.timedelta | None = None) -> None:
        """Start the messages (a closed connection may fail them at once) and wait for them."""
        try:
            for work in start():
                work.wait(timeout or self.timeout)
        except RuntimeError as e:  # DistBackendError, a timeout, a closed connection
            raise WorkerFailure(f"tensor parallelism: {what} failed (a rank died or stopped answering): {str(e).splitlines()[0]}") from None

    # -- the model's collectives -----------------------------------------------------------------
    # On gloo the collectives are point-to-point messages: its allreduce of a hidden vector took
    # 1.1-1.4 ms between two processes of this machine, a send/recv exchange 0.15-0.3 ms
    # (benchmarks/tensor_parallel.py prints both). Every rank adds the parts in rank order, so all get the same
    # values. NCCL's own collectives are the fast ones on GPUs.
    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """Sum (or max) of t over the ranks, in place; every rank gets the same values."""
        self._count("all_reduce", t)
        if self.device.type == "cuda":
            opts = dist.AllreduceOptions()
            opts.reduceOp, opts.timeout = op, self.timeout
            self._wait(lambda: [self.data.allreduce([t], opts)], "all-reduce")
            return t
        mine = t.contiguous()
        peers = [r for r in range(self.size) if r != self.rank]
        parts = {r: torch.empty_like(mine) for r in peers}
        self._wait(lambda: [self.data.send([mine], r, 0) for r in peers] + [self.data.recv([parts[r]], r, 0) for r in peers], "all-reduce")
        parts[self.rank] = mine
        total = parts[0].clone()
        for r in range(1, self.size):
            total = total + parts[r] if op == dist.ReduceOp.SUM else torch.maximum(total, parts[r])
        return t.copy_(total)

    def gather_last_dim(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Rank 0 gets the ranks' [rows, sizes[r]] pieces side by side; the others None."""
        t = t.contiguous()
        self._count("gather", t)
        if not self.is_first:
            self._wait(lambda: [self.data.send([t], 0, 0)], "gather")
            return None
        pieces = [t] + [t.new_empty(*t.shape[:-1], n) for n in sizes[1:]]
        self._wait(lambda: [self.data.recv([pieces[r]], r, 0) for r in range(1, self.size)], "gather")
        return torch.cat(pieces, dim=-1)

    # -- rank 0's commands ---------------------------------------------------------------------
    def send(self, obj: object) -> object:
        """Rank 0: every worker's next `receive()` returns obj (so does this)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        self._count("commands", data)
        self._wait(lambda: [w for r in range(1, self.size) for w in (self.control.send([size], r, 0), self.control.send([data], r, 0))],
                   "sending a step to the workers")
        return obj

    def receive(self) -> object:
        """Workers: rank 0's next command (waits as long as rank 0 is alive)."""
        n = torch.empty(1, dtype=torch.int64)
        self._wait(lambda: [self.control.recv([n], 0, 0)], "waiting for rank 0", _FOREVER)
        data = torch.empty(int(n), dtype=torch.uint8)
        self._wait(lambda: [self.control.recv([data], 0, 0)], "receiving a step from rank 0")
        return pickle.loads(data.numpy().tobytes())
