"""What a rank prints reaches the client: Job.output, on_output, the live view."""

from __future__ import annotations

import sys

from distributed import Client

import dask_ddp
from dask_ddp._client.job import OutputLine
from dask_ddp._shared.view import render_html


def _chatty(n: int) -> int:
    rank = dask_ddp.get_context().rank
    for i in range(n):
        print(f"rank {rank} line {i}")
    print("to stderr", file=sys.stderr)
    sys.stdout.write("no newline at the end")
    return rank


def test_printed_lines_reach_the_client_in_order(client: Client) -> None:
    seen: list[OutputLine] = []
    job = dask_ddp.launch(client, _chatty, args=(50,), on_output=seen.append)
    assert job.result(timeout=120) == [0, 1]
    for rank in (0, 1):
        mine = [(o.stream, o.text) for o in job.output if o.rank == rank]
        assert mine == [
            *[("stdout", f"rank {rank} line {i}") for i in range(50)],
            ("stderr", "to stderr"),
            ("stdout", "no newline at the end"),
        ]
    assert seen == job.output
    assert "] no newline at the end</pre>" in render_html(job.view_state())  # the latest line


def test_the_worker_streams_are_restored_after_the_rank(client: Client) -> None:
    def streams() -> tuple[str, str]:
        return type(sys.stdout).__name__, type(sys.stderr).__name__

    before = client.run(streams)
    dask_ddp.launch(client, _chatty, args=(1,)).result(timeout=120)
    assert client.run(streams) == before
