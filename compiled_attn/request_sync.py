"""Rank 0's requests on every rank of a tensor-parallel engine, step by step.

With tensor parallelism every rank runs the same :class:`~compiled_attn.engine.Engine` on its
shard, and every rank's scheduler must take the same decisions at the same step, since each
forward is a collective (issue 14: "rank 0 schedules and broadcasts the step's inputs").
The scheduler is deterministic, so equal inputs suffice: at the start of each step rank 0
broadcasts the requests added to it since its last step (:meth:`RequestSync.exchange`, over
the group's gloo twin: :func:`~compiled_attn.distributed.broadcast_object`), and every other
rank queues exactly those, in that order. Another rank may

* add the same requests itself (the CLI and ``Engine.generate`` do, on every rank): such a
  request waits until rank 0's arrives and must equal it (id, prompt, parameters, seed),
  else a ``RuntimeError``; its results land in the rank's own request object;
* add none and run :meth:`Engine.serve_worker <compiled_attn.engine.Engine.serve_worker>`:
  it steps in lock-step with rank 0 and runs what rank 0 adds, until rank 0 calls
  :meth:`Engine.stop_workers <compiled_attn.engine.Engine.stop_workers>`.

Each step costs one 8-byte gloo broadcast on the host, two when rank 0 has something new.
"""

from __future__ import annotations

from .distributed import TensorParallel, broadcast_object
from .scheduler import Request


class RequestSync:
    """The requests of one rank's engine, held to rank 0's order (see the module docstring).

    Args:
        tp: the engine's tensor-parallel group (``world_size > 1``).
    """

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp
        self.stopped = False  # other ranks: rank 0 called stop_workers
        self._added: list[Request] = []  # rank 0: added since its last exchange
        self._expected: dict[int, Request] = {}  # other ranks: added here, not yet seen from rank 0

    @property
    def leader(self) -> bool:
        return self.tp.rank == 0

    @property
    def pending(self) -> bool:
        """Requests added on this (non-zero) rank that rank 0 has not sent yet."""
        return bool(self._expected)

    def add(self, request: Request) -> bool:
        """Note a request added on this rank; returns whether the scheduler takes it now
        (rank 0) or only when rank 0's copy arrives (other ranks)."""
        if self.leader:
            self._added.append(request)
            return True
        self._expected[request.request_id] = request
        return False

    def exchange(self, stop: bool = False) -> list[Request]:
        """The step's broadcast (every rank calls it at the start of each step). Rank 0
        sends its new requests (and ``stop``); another rank gets them and returns the
        requests for its scheduler, its own where it added them.

        Raises:
            RuntimeError: this rank added a request unlike rank 0's of the same id.
        """
        message = None  # nothing new: the common step, one 8-byte broadcast
        if self.leader and (stop or self._added):
            message = (stop, [(r.request_id, r.prompt_ids, r.params, r.seed) for r in self._added])
        message = broadcast_object(message, self.tp)
        if self.leader:
            self._added.clear()
            return []
        if message is None:
            return []
        self.stopped, received = message
        requests = []
        for request_id, prompt_ids, params, seed in received:
            own = self._expected.pop(request_id, None)
            if own is not None and (own.prompt_ids, own.params, own.seed) != (prompt_ids, params, seed):
                raise RuntimeError(f"rank {self.tp.rank} added request {request_id} unlike rank 0's: every rank "
                                   "must add the same requests in the same order, or none (Engine.serve_worker)")
            requests.append(own if own is not None else Request(request_id, prompt_ids, params, seed))
        return requests

    def clear(self) -> None:
        """Forget requests not exchanged yet (an engine's ``generate`` that failed)."""
        self._added.clear()
        self._expected.clear()
