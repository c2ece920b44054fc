"""Rank 0's requests on every rank of a tensor-parallel engine, step by step.

With tensor parallelism every rank runs the same :class:`~compiled_attn.engine.Engine` on its
shard, and every rank's scheduler must take the same decisions at the same step, since each
forward is a collective (issue 14: "rank 0 schedules and broadcasts the step's inputs").
The scheduler is deterministic, so equal inputs suffice. A request added on any rank waits
in a :class:`RequestSync` queue; at the start of each step rank 0 broadcasts the requests
added to it since its last step (:meth:`RequestSync.exchange`, over the group's gloo twin:
:func:`~compiled_attn.distributed.broadcast_object`), and every rank, rank 0 included, hands
exactly those to its scheduler, in that order. Another rank may

* add the same requests itself, in the same order (the CLI and ``Engine.generate`` do, on
  every rank): each waits until rank 0's copy arrives, must have the same prompt and
  sampling parameters (else a ``RuntimeError`` on that rank) and takes rank 0's id and
  seed; its results land in the rank's own request object;
* add none and run :meth:`Engine.serve_worker <compiled_attn.engine.Engine.serve_worker>`:
  it steps in lock-step with rank 0, for as long as rank 0 stays idle (no timeout), and
  runs what rank 0 adds, until rank 0 calls
  :meth:`Engine.stop_workers <compiled_attn.engine.Engine.stop_workers>`.

Limits: requests are added from the thread that steps the engine; a request another rank
adds that rank 0 never adds keeps that rank waiting; an error on one rank (a mismatch, an
exception inside a step) leaves the group out of step: restart the processes. Each step
costs one 8-byte gloo broadcast on the host, two when rank 0 has something new.
"""

from __future__ import annotations

from collections import deque

from .distributed import TensorParallel, all_ranks, broadcast_object
from .scheduler import Request


class RequestSync:
    """The requests of one rank's engine, held to rank 0's order (see the module docstring).

    Args:
        tp: the engine's tensor-parallel group (``world_size > 1``).
    """

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp
        self.stopped = False  # rank 0 called stop_workers (and, on rank 0, has not stepped since)
        self._queued: deque[Request] = deque()  # added on this rank, not yet exchanged

    @property
    def leader(self) -> bool:
        return self.tp.rank == 0

    @property
    def pending(self) -> bool:
        """Requests added on this rank that have not reached its scheduler yet."""
        return bool(self._queued)

    def add(self, request: Request) -> None:
        """Queue a request added on this rank until the next :meth:`exchange`."""
        self._queued.append(request)

    def check_engine(self, settings: dict) -> None:
        """Raise on every rank unless every rank's engine ``settings`` (name -> value) equal
        rank 0's (the schedule depends on them).

        Raises:
            RuntimeError: some rank's settings differ from rank 0's; a differing rank names
                the settings, the others say that another rank differs.
        """
        leader = broadcast_object(settings, self.tp)
        differ = [name for name, value in settings.items() if leader.get(name) != value]
        if not all_ranks(not differ, self.tp):
            detail = "; ".join(f"{name}: {settings[name]!r} here, {leader.get(name)!r} on rank 0" for name in differ)
            raise RuntimeError(f"the engines of the tensor-parallel ranks differ ({detail or 'on another rank'}); "
                               "build them with the same arguments and the same model config on every rank")

    def exchange(self, stop: bool = False) -> list[Request]:
        """The step's broadcast: every rank calls it at the start of each step and gets the
        requests for its scheduler, rank 0's new requests (on another rank its own objects
        where it added them). ``stop`` (rank 0) ends the other ranks' ``serve_worker``.

        Raises:
            RuntimeError: this rank added a request unlike rank 0's in the same place.
        """
        message, sent = None, []  # nothing new: the common step, one 8-byte broadcast
        if self.leader:
            self.stopped = stop  # rank 0: whether its last exchange stopped the other ranks
            sent, self._queued = list(self._queued), deque()
            if stop or sent:
                message = (stop, [(r.request_id, r.prompt_ids, r.params, r.seed) for r in sent])
        message = broadcast_object(message, self.tp)
        if self.leader:
            return sent
        if message is None:
            return []
        self.stopped, received = message
        requests = []
        for request_id, prompt_ids, params, seed in received:
            if not self._queued:  # rank 0's alone (serve_worker)
                requests.append(Request(request_id, prompt_ids, params, seed))
                continue
            own = self._queued.popleft()
            if (own.prompt_ids, own.params) != (prompt_ids, params):
                what = "prompt" if own.prompt_ids != prompt_ids else "sampling parameters"
                raise RuntimeError(f"rank {self.tp.rank}'s request {own.request_id} differs from rank 0's request "
                                   f"{request_id} in its {what}: every rank must add the same requests in the same "
                                   "order, or none (Engine.serve_worker)")
            own.request_id, own.seed = request_id, seed
            requests.append(own)
        return requests

    def clear(self) -> None:
        """Forget requests not exchanged yet (an engine's ``generate`` that failed)."""
        self._queued.clear()
