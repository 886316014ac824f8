"""The records that travel between a rank task (in its worker) and the rank's own process,
over their link (:mod:`dask_ddp._rank.rankproc`): typed, as every record between the wings is
(:mod:`dask_ddp._shared.protocol`), read by field on both sides.

Worker -> rank: :class:`Go` (the rank to run), :class:`Stop`, and the answers to its calls
(:class:`Reply`, :class:`ReplyBytes`, :class:`ReplyOutOfBand`). Rank -> worker:
:class:`Hello` (its process group), :class:`Emit`, :class:`Blob` and :class:`LogEvent` (what
its channel and ``get_worker().log_event`` send), :class:`Call` (a handler of the worker's,
by name) and :class:`End` (its value or error, and how it ended). A record that says raw
buffers follow (``ReplyBytes``, ``ReplyOutOfBand``, ``Call(has_data=True)``) is followed at
once by them on the same link.

>>> Stop("cancelled by the user", None).reason
'cancelled by the user'
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = [
    "Blob",
    "Call",
    "Emit",
    "End",
    "Go",
    "Hello",
    "LogEvent",
    "Reply",
    "ReplyBytes",
    "ReplyOutOfBand",
    "Stop",
]


# -- to the rank ------------------------------------------------------------------------------
class Go(NamedTuple):
    """Run this rank: the client's pickled ``(fn, args, kwargs)``, its plan, its worker's
    stand-in (``get_worker()`` in the rank), what its process runs (``RankBody``) and where
    its task's channel stopped (``turn``)."""

    payload: bytes
    spec: Any  # RankSpec
    worker: Any  # WorkerStandIn
    body: Any  # RankBody
    turn: Any


class Stop(NamedTuple):
    """Stop (a SIGTERM follows): why, and the rank whose failure caused it, if one did."""

    reason: str
    failed_rank: int | None


class Reply(NamedTuple):
    """The answer to call ``call_id``: ``data`` is its pickled value (``ok``) or error."""

    call_id: int
    ok: bool
    data: bytes


class ReplyBytes(NamedTuple):
    """The answer to call ``call_id`` is ``nbytes`` raw bytes, which follow."""

    call_id: int
    nbytes: int


class ReplyOutOfBand(NamedTuple):
    """The answer to call ``call_id`` is ``head`` (a protocol-5 pickle) and buffers of
    ``sizes`` bytes, which follow."""

    call_id: int
    head: bytes
    sizes: list[int]


# -- from the rank ----------------------------------------------------------------------------
class Hello(NamedTuple):
    """The spare is ready, leading process group ``group``."""

    group: int


class Emit(NamedTuple):
    """An event of the rank's channel, for its worker's ``log_event``."""

    topic: str
    event: dict[str, Any]


class Blob(NamedTuple):
    """A large message, kept in the worker for the client that fetches it."""

    key: str
    message: list[Any]


class LogEvent(NamedTuple):
    """The rank's own ``get_worker().log_event(topic, message)``."""

    topic: str | list[str]
    message: Any


class Call(NamedTuple):
    """Call the worker's handler ``name`` on ``args`` (and a raw buffer, which follows, if
    ``has_data``); answered by a reply to ``call_id``."""

    call_id: int
    name: str
    args: tuple
    has_data: bool


class End(NamedTuple):
    """The rank's last record: its pickled value or error, how it ended (a ``RankOutcome``
    on the wire) and whether it started CUDA."""

    value: bytes | None
    error: bytes | None
    outcome: Any
    used_cuda: bool
