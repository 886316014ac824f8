"""Rank side of growing an elastic job: every rank stops at the same checkpoint.

When workers join a job that runs with fewer ranks than it may use, the client claims
them and asks the job's rank 0 (through its worker's slot) to grow. At the next
:func:`dask_ddp.save_checkpoint`, once the checkpoint has landed, rank 0 writes the
decision for that step into the job's store and every rank reads it there, so all of them
stop after the same step (or none does); the client then restarts the job from that
checkpoint with more ranks. Jobs that cannot grow never pay for this.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from .slot import RankRun, this_slot

_GROW, _GO = b"grow", b"go"
_WAITING = "dask-ddp/grow-waiting"  # the step the other ranks wait at, for release_waiters


class GrowAtCheckpoint(BaseException):
    """Unwinds the user's function after the checkpoint of ``step``.

    A BaseException, so that ``except Exception`` in training code lets it through; the rank
    task then ends without an error (:class:`dask_ddp._rank.tasks.Resized`).
    """

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step


def at_checkpoint(run: RankRun, rank: int, step: int, timeout: float) -> None:
    """After the checkpoint of ``step``: stop here if the job grows (every rank alike).

    Rank 0 takes the client's request and writes the decision; the others wait for it
    (at most ``timeout`` seconds: rank 0 may still be writing a large checkpoint). A job
    that grows restarts from this checkpoint: every rank waits until what it saved is
    durable (an asynchronous save returned before) before it stops.
    """
    key = _word(step)
    if rank == 0:
        if run.relay is not None:  # a rank in its own process: its worker was asked
            grow = run.relay.call("grow")
        else:
            grow = this_slot().take_grow_request(run.job_id)
        if grow and run.saver is not None:
            run.saver.flush()
        run.store.set(key, _GROW if grow else _GO)
    else:
        # A stop (bootstrap.abort_rank) cannot reach a thread inside the C++ wait: say which
        # step is waited for, so that release_waiters can end the wait.
        run.store.set(_WAITING, str(step))
        run.store.wait([key], timedelta(seconds=timeout))
        run.check_stop()  # released by the stop, not by rank 0's word
        grow = run.store.get(key) == _GROW
        if grow and run.saver is not None:
            run.saver.flush()
    if grow:
        raise GrowAtCheckpoint(step)


def release_waiters(store: Any, mark: bytes) -> None:
    """End the wait of ranks waiting for rank 0's word at a checkpoint, with ``mark`` as the
    word: the stop that called this is raised as soon as the wait returns. Without it, a
    rank stopped there (rank 0 failed or was stopped before its checkpoint) would wait out
    the collective timeout and cost its worker a restart.
    """
    if store.check([_WAITING]):
        store.compare_set(_word(int(store.get(_WAITING))), "", mark)


def _word(step: int) -> str:
    return f"dask-ddp/grow-at-{step}"
