"""``python -m dask_ddp`` as a user runs it: fast answers, prompt exits, nothing left behind.

The other command-line tests (a successful run, the failing rank's message said once, a
scheduler given) are in test_script.py.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from distributed import Client, Event, LocalCluster
from processes import DaskProcesses, Output, stacks

import dask_ddp

# How long the command may take to exit after the last rank finished or failed (issue: 2 s),
# measured from the moment the script says so to the command's exit, plus the interpreter's
# own teardown; generous against a loaded 2-core machine.
EXIT_LIMIT = 4.0

STUCK_PEER = textwrap.dedent(
    """
    import os, sys, time
    if os.environ["RANK"] == "1":
        print("FAILING", time.time(), flush=True)
        raise ValueError("rank 1 broke on purpose")
    time.sleep(3600)  # stuck until its stop (SIGTERM) or the SIGKILL after the grace
    """
)

ONE_STEP = textwrap.dedent(
    """
    import os, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
    model(torch.ones(4, 8)).sum().backward()
    dist.barrier()
    dist.destroy_process_group()
    os.write(1, f"FINISHED {time.time()}\\n".encode())  # one write: ranks share stdout
    """
)


def _cli(
    *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float, int]:
    """Run the command in a session of its own: (result, time it exited, its group id)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dask_ddp", *args],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out, err = proc.communicate(timeout=240)
    ended = time.time()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), ended, proc.pid


def _alive_in_group(pgid: int) -> list[psutil.Process]:
    """The live (not zombie) processes in process group ``pgid``."""
    alive = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return alive


def _assert_group_empty(pgid: int) -> None:
    """Nothing the command started is alive once it exited: it waits for its processes' end
    (a shell's next command, or an outside timer, finds none of them still exiting)."""
    alive = _alive_in_group(pgid)
    assert not alive, [(p.pid, p.info["status"], p.cmdline()) for p in alive]


def _stamp(text: str, word: str) -> list[float]:
    """The times the ranks printed after ``word``."""
    return [float(t) for t in re.findall(rf"{word} (\d+\.\d+)", text)]


def test_help_answers_without_torch_or_distributed() -> None:
    probe = (
        "import sys, time, runpy\n"
        "sys.argv = ['dask_ddp', '--help']\n"
        "start = time.perf_counter()\n"
        "try:\n"
        "    runpy.run_module('dask_ddp', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "print('SECONDS', time.perf_counter() - start, file=sys.stderr)\n"
        "print('IMPORTED', sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'distributed', 'dask')), file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and "--dashboard" in out.stdout
    assert "IMPORTED []" in out.stderr, out.stderr  # what made --help slow: torch, dask


def test_usage_error_answers_without_torch(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "dask_ddp", "--nworkers", "0", "x.py"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--nworkers must be at least 1" in out.stderr
    assert "| torch" not in out.stderr and "| distributed" not in out.stderr


@pytest.mark.slow
def test_the_command_s_processes_are_gone_when_it_exits() -> None:
    # A killed process with much memory takes a while to end (its pages are freed): the
    # command waits for that, as for its workers, template and ranks, before it exits.
    from dask_ddp._client.cli import _kill_and_wait

    big = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; b = bytearray(2 << 30); print(1, flush=True); "
         "time.sleep(600)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert big.stdout.readline() == b"1\n"  # its 2 GiB touched
    process = psutil.Process(big.pid)
    _kill_and_wait([process], timeout=30)
    assert process.status() == psutil.STATUS_ZOMBIE  # ended; only its exit status is left
    big.wait()


WHERE_FORKED = """\
import os, sys, psutil
parent = os.getppid()
# One write a line: the ranks share the terminal (unbuffered, print writes each piece)
os.write(1, f"FORKED-FROM {parent} {psutil.Process(parent).ppid()}\\n".encode())
found = ["torch.distributed" in sys.modules, "torch._dynamo" in sys.modules]
os.write(1, f"PRELOADED {found[0]} {found[1]}\\n".encode())
"""


# A record of one of Dask's loggers as the command's handler writes it ("2026-... name
# message") or as a worker's own handler does ("2026-... - name - INFO - message").
DASK_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (- )?distributed\b", re.M)


def test_a_success_exits_promptly_quietly_leaving_nothing_its_ranks_forked_from_one_template(
    tmp_path: Path,
) -> None:
    # One run of the command's own cluster, four promises of it (each cluster the command
    # starts costs seconds; what each assertion checks is independent of the others).
    script = tmp_path / "one_step.py"
    script.write_text(WHERE_FORKED + ONE_STEP)
    done, ended, command = _cli(str(script))
    assert done.returncode == 0, done.stderr[-3000:]
    # Prompt: it exits within EXIT_LIMIT of the last rank's end, and nothing it started
    # is left alive.
    finished = _stamp(done.stdout, "FINISHED")
    assert len(finished) == 2, done.stdout
    assert ended - max(finished) < EXIT_LIMIT, ended - max(finished)
    _assert_group_empty(command)
    # Quiet by default: none of Dask's logs, and one line of its own.
    assert len(DASK_LOG_LINE.findall(done.stdout + done.stderr)) == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("dask_ddp:")]
    assert len(said) == 1 and said[0].startswith("dask_ddp: every rank finished: 2 ranks"), said
    # The command's own cluster's nannies are in its process: they hold one template for
    # both workers, started before the cluster (its imports beside the workers' start),
    # which imports what every script needs (_template.LEAN).
    forked = re.findall(r"FORKED-FROM (\d+) (\d+)", done.stdout)
    assert len(forked) == 2 and len(set(forked)) == 1, done.stdout
    assert int(forked[0][1]) == command
    # It imported torch.distributed for them, and not dynamo: the command's cluster runs one
    # script, and a script that needs dynamo (a DDP one) imports it, as under torchrun.
    assert done.stdout.count("PRELOADED True False") == 2, done.stdout


@pytest.mark.slow
def test_exits_promptly_after_a_failure_with_a_stuck_peer(tmp_path: Path) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_PEER)
    failed, ended, pgid = _cli(str(script))
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "rank 1 failed" in failed.stderr and "rank 1 broke on purpose" in failed.stderr
    # The rank's traceback, then the line that points at it ("above"), as Python prints.
    said = failed.stderr.index("dask_ddp: rank 1 failed")
    assert failed.stderr.index("Traceback (most recent call last)") < said, failed.stderr
    assert failed.stderr[said:].startswith("dask_ddp: rank 1 failed on tcp://")
    assert "traceback above" in failed.stderr and "printed above" not in failed.stderr
    (failing,) = _stamp(failed.stdout, "FAILING")
    assert ended - failing < EXIT_LIMIT, ended - failing
    _assert_group_empty(pgid)


@pytest.mark.slow
def test_with_a_scheduler_exits_promptly_after_a_failure(
    client: Client, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_PEER)
    address = client.scheduler.address
    pids = client.run(os.getpid)
    # On a shared cluster the command leaves it clean: the stuck rank's process is
    # stopped (SIGTERM: its sleep ends at once) and its worker is left alone.
    grace = 1.0
    with caplog.at_level(logging.WARNING, logger="dask_ddp"):  # the scheduler's log
        failed, ended, pgid = _cli(
            "--scheduler", address, str(script), env={"DASK_DDP__FAILURE_GRACE": f"{grace}s"}
        )
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "rank 1 broke on purpose" in failed.stderr
    (failing,) = _stamp(failed.stdout, "FAILING")
    assert "restarting those workers" not in caplog.text
    assert ended - failing < grace + EXIT_LIMIT, (ended - failing, failed.stderr[-3000:])
    _assert_group_empty(pgid)
    assert client.run(os.getpid) == pids  # no worker was restarted


@pytest.mark.slow
@pytest.mark.parametrize("library", ["lightning", "accelerate"])
def test_a_library_script_s_logged_metrics_reach_the_command_line(
    library: str, dask_processes: DaskProcesses, tmp_path: Path
) -> None:
    """The Lightning and accelerate scripts of the integration tests, unchanged but for the
    one line, run with `python -m dask_ddp` (on the module's cluster: what is checked is
    the command's output); their logged metrics reach the job, whose last values the
    command prints when it ends."""
    pytest.importorskip(library)
    if library == "lightning":
        from test_lightning import LIGHTNING_SCRIPT as source
    else:
        from test_accelerate import ACCELERATE_SCRIPT as source
    script = tmp_path / f"train_{library}.py"
    script.write_text(source)
    result, _, _ = _cli("--scheduler", dask_processes.address, str(script))
    assert result.returncode == 0, result.stderr
    summary = [line for line in result.stderr.splitlines() if " reports; last: " in line]
    assert len(summary) == 1 and "train_loss" in summary[0], result.stderr


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train.py"


@pytest.mark.slow
def test_the_dashboard_s_address_and_dask_s_logs_with_verbose() -> None:
    # Quiet by default is checked on the default options' run (test_a_success_exits_...);
    # here the example with both options.
    verbose, _, _ = _cli("-v", "--dashboard", str(EXAMPLE), "--steps", "5")
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert "parameters identical on every rank" in verbose.stdout
    assert len(DASK_LOG_LINE.findall(verbose.stderr)) > 5, verbose.stderr
    said = [line for line in verbose.stderr.splitlines() if line.startswith("dask_ddp:")]
    assert said[0].startswith("dask_ddp: Dask dashboard: http"), said
    assert said[-1].startswith("dask_ddp: every rank finished: 2 ranks"), said


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--nworkers", "3:2"], "MIN is more than MAX; give MIN:MAX with MIN <= MAX, as 2:3"),
        (["--nworkers", "2:x"], "give a number of workers (4) or a range MIN:MAX (2:4)"),
        (["--max-restarts", "-1"], "--max-restarts -1: give 0 or more restarts"),
        (["--nworkers", "2:4"], "Pass --checkpoint-dir URL (a folder every worker reaches"),
    ],
)
def test_bad_values_are_refused_before_anything_starts(
    options: list[str], message: str, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch\n")
    out = subprocess.run(
        [sys.executable, "-m", "dask_ddp", *options, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr
    if options == ["--nworkers", "2:4"]:  # the error shows how a script opts in
        assert '# [tool.dask-ddp]\n# resume = "own-snapshots"' in out.stderr


OWN_SNAPSHOTS = textwrap.dedent(
    """
    # /// script
    # [tool.dask-ddp]
    # resume = "own-snapshots"
    # ///
    import os
    import torch.distributed as dist

    dist.init_process_group("gloo")
    line = f"WORLD {dist.get_world_size()} {os.environ['TORCHELASTIC_MAX_RESTARTS']}\\n"
    os.write(1, line.encode())  # one write: the ranks share the terminal
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_a_script_that_keeps_its_own_snapshots_runs_elastic_without_a_checkpoint_dir(
    tmp_path: Path,
) -> None:
    script = tmp_path / "own.py"
    script.write_text(OWN_SNAPSHOTS)
    done, _, pgid = _cli("--nworkers", "1:2", "--max-restarts", "2", str(script))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("WORLD 2 2") == 2, done.stdout  # at its most: 2 workers free
    _assert_group_empty(pgid)


# -- signals, --detach, and waiting for workers with --scheduler ---------------------------
TRAINING = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist

    dist.init_process_group("gloo")
    sys.stdout.write(f"TRAINING {os.environ['RANK']}\\n")  # one write: ranks may share stdout
    sys.stdout.flush()
    while True:  # a long training: a collective, then some work, step after step
        dist.barrier()
        time.sleep(0.05)
    """
)


def _command(*args: str, env: dict[str, str] | None = None) -> Output:
    """The command in a session of its own, its output read as it comes."""
    return Output([sys.executable, "-m", "dask_ddp", *args], env, start_new_session=True)


def _said(command: Output) -> list[str]:
    """The command's own lines."""
    return [line.rstrip("\n") for line in command.lines if line.startswith("dask_ddp:")]


def _exit_code(command: Output, timeout: float) -> int:
    """The command's exit code; a command still running after ``timeout`` fails the test
    with what it printed and where its threads are (py-spy, where it is installed): a bare
    TimeoutExpired says nothing of where it stuck."""
    try:
        return command.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        where = stacks(command.proc.pid)
        command.proc.kill()
        command.stop()
        pytest.fail(f"the command still ran after {timeout} s:\n{command.text()[-4000:]}\n{where}")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_cancels_the_job_and_its_workers_are_free_at_once(
    sig: signal.Signals, dask_processes: DaskProcesses, tmp_path: Path
) -> None:
    script = tmp_path / "long.py"
    script.write_text(TRAINING)
    command = _command("--scheduler", dask_processes.address, "--nworkers", "2", str(script))
    command.wait_for(r"\[rank 0\] TRAINING 0")
    command.wait_for(r"\[rank 1\] TRAINING 1")
    sent = time.time()
    command.proc.send_signal(sig)
    assert _exit_code(command, 120) == 130, command.text()[-3000:]
    command.stop()
    assert "Traceback" not in command.text(), command.text()[-3000:]
    (said,) = _said(command)
    assert re.fullmatch(
        rf"dask_ddp: {sig.name}: job \w+ cancelled; its ranks stopped and their workers are free",
        said,
    ), said
    with Client(dask_processes.address) as client:
        (info,) = dask_ddp.jobs(client)
        assert info.state is dask_ddp.JobState.CANCELLED and sig.name in info.error
        # The next 2-rank job starts on those workers at once (the issue: within 10 s).
        started = dask_ddp.launch(client, time.time, workers=2).result(timeout=120)
        assert max(started) - sent < 10, max(started) - sent


@pytest.mark.slow
def test_ctrl_c_ends_the_command_s_own_cluster_with_one_line(tmp_path: Path) -> None:
    script = tmp_path / "long.py"
    script.write_text(TRAINING)
    command = _command(str(script))
    command.wait_for("TRAINING 0")
    command.wait_for("TRAINING 1")
    os.killpg(command.proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the whole group
    assert _exit_code(command, 120) == 130, command.text()[-3000:]
    command.stop()
    assert "Traceback" not in command.text(), command.text()[-3000:]
    (said,) = _said(command)
    assert re.fullmatch(r"dask_ddp: SIGINT: stopped job \w+ and the command's LocalCluster", said)
    _assert_group_empty(command.proc.pid)


WAITS_FOR_GO = textwrap.dedent(
    """
    import os
    import torch.distributed as dist
    from distributed import Event
    import dask_ddp

    dist.init_process_group("gloo")
    for step in range(5):
        dask_ddp.report({"loss": 1.0 / (step + 1)}, step=step)
    Event("dask-ddp-test-go").wait(240)
    print("DONE", os.environ["RANK"], flush=True)
    """
)


@pytest.mark.slow
def test_detach_leaves_the_job_running_and_says_how_to_attach(
    dask_processes: DaskProcesses, tmp_path: Path
) -> None:
    script = tmp_path / "nightly.py"
    script.write_text(WAITS_FOR_GO)
    command = _command(
        "--scheduler", dask_processes.address, "--name", "nightly", "--detach", str(script)
    )
    assert command.proc.wait(120) == 0, command.text()[-3000:]
    command.stop()
    (said,) = _said(command)
    assert f"runs detached on {dask_processes.address}" in said, said
    # The line shows the call that attaches: run it as it is.
    call = re.search(r"follow it with (dask_ddp\.attach\(.*?\)) \(", said)[1]
    job = eval(call, {"dask_ddp": dask_ddp, "Client": Client})
    try:
        assert job.name == "nightly" and job.state is dask_ddp.JobState.RUNNING
        (info,) = dask_ddp.jobs(job.client)
        assert info.detached and info.name == "nightly"
        job.view_state(lambda s: [r["step"] for r in s["ranks"]] == [4, 4], timeout=120)
        Event("dask-ddp-test-go", client=job.client).set()
        assert job.result(timeout=120) == [0, 0]
        assert sorted(line.text for line in job.output if line.text.startswith("DONE")) == [
            "DONE 0",
            "DONE 1",
        ]
        assert [r.step for r in job.metrics if r.rank == 0] == [0, 1, 2, 3, 4]
    finally:
        job.client.close()


ONE_STEP_QUIET = textwrap.dedent(
    """
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_with_a_scheduler_the_job_waits_for_workers_started_meanwhile(
    dask_processes: DaskProcesses, tmp_path: Path
) -> None:
    script = tmp_path / "one_step.py"
    script.write_text(ONE_STEP_QUIET)
    command = _command("--scheduler", dask_processes.address, "--nworkers", "3", str(script))
    command.wait_for(r"dask_ddp: waiting for 3 workers \(the cluster has 2;")
    dask_processes.workers.append(dask_processes.add_worker())  # as a user would, by hand
    assert command.proc.wait(240) == 0, command.text()[-3000:]
    command.stop()
    assert _said(command)[-1].startswith("dask_ddp: every rank finished: 3 ranks")


@pytest.mark.slow
def test_with_a_scheduler_the_wait_for_workers_ends_at_the_scale_timeout(
    dask_processes: DaskProcesses, tmp_path: Path
) -> None:
    script = tmp_path / "one_step.py"
    script.write_text(ONE_STEP_QUIET)
    command = _command(
        "--scheduler", dask_processes.address, "--nworkers", "3", str(script),
        env={"DASK_DDP__SCALE_TIMEOUT": "3s"},
    )  # fmt: skip
    assert command.proc.wait(240) == 1, command.text()[-3000:]
    command.stop()
    assert "up to ddp.scale-timeout, 3s" in _said(command)[0]
    assert re.search(
        r"needs at least 3 workers, but the cluster had only 2 for 3 s", _said(command)[-1]
    ), _said(command)


@pytest.mark.slow
def test_with_a_scheduler_an_adaptive_cluster_is_asked_for_the_workers(tmp_path: Path) -> None:
    script = tmp_path / "one_step.py"
    script.write_text(ONE_STEP_QUIET)
    with LocalCluster(
        n_workers=0, threads_per_worker=1, processes=True, dashboard_address=":0"
    ) as cluster:
        cluster.adapt(minimum=0, maximum=2, interval="200ms")
        command = _command("--scheduler", cluster.scheduler_address, "--nworkers", "2", str(script))
        assert command.proc.wait(240) == 0, command.text()[-3000:]
        command.stop()
        assert _said(command)[0].startswith("dask_ddp: waiting for 2 workers (the cluster has 0;")
        assert _said(command)[-1].startswith("dask_ddp: every rank finished: 2 ranks")


@pytest.mark.slow
def test_ctrl_c_on_a_no_python_command_ends_its_programs(
    dask_processes: DaskProcesses, tmp_path: Path
) -> None:
    # Each rank's program writes a tick every 0.1 s; after Ctrl-C none is left writing.
    loop = tmp_path / "loop.sh"
    loop.write_text('while true; do echo tick >> "$1/ticks-$RANK"; sleep 0.1; done\n')
    command = _command(
        "--scheduler", dask_processes.address, "--nworkers", "2",
        "--no-python", "bash", str(loop), str(tmp_path),
    )  # fmt: skip
    ticks = [tmp_path / "ticks-0", tmp_path / "ticks-1"]
    deadline = time.monotonic() + 120
    while not all(t.exists() for t in ticks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(t.exists() for t in ticks), command.text()[-3000:]
    command.proc.send_signal(signal.SIGINT)
    assert command.proc.wait(10) == 130, command.text()[-3000:]
    command.stop()
    sizes = [t.stat().st_size for t in ticks]
    time.sleep(1.0)  # ten ticks, had a program been left running
    assert [t.stat().st_size for t in ticks] == sizes
    left = [
        p.pid for p in psutil.process_iter(["cmdline"]) if str(loop) in (p.info["cmdline"] or [])
    ]
    assert left == []


HANGS = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist

    dist.init_process_group("gloo")
    sys.stdout.write(f"HANGING {os.environ['RANK']}\\n")
    sys.stdout.flush()
    if dist.get_rank() == 1:
        time.sleep(600)  # the hang
    dist.barrier()
    """
)


@pytest.mark.slow
def test_a_stalled_job_says_so_in_one_line_and_its_stacks_print_by_name(
    dask_processes: DaskProcesses, tmp_path: Path
) -> None:
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    env = {"DASK_DDP__STALL_TIMEOUT": "2s"}
    command = _command(
        "--scheduler", dask_processes.address, "--nworkers", "2", "--name", "hangs", str(script),
        env=env,
    )  # fmt: skip
    said = command.wait_for(r"dask_ddp: job \w+ stalled: (.*)")[1]
    assert "rank 1 in <module> (hangs.py:" in said and "rank(s) 0" in said, said
    stacks = subprocess.run(
        [sys.executable, "-m", "dask_ddp", "--scheduler", dask_processes.address,
         "--stacks", "hangs"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert stacks.returncode == 0, stacks.stderr
    assert "rank 0 (on tcp://" in stacks.stdout and "rank 1 (on tcp://" in stacks.stdout
    assert "in barrier" in stacks.stdout  # rank 0, blocked in gloo
    command.proc.send_signal(signal.SIGINT)
    assert command.proc.wait(60) == 130, command.text()[-3000:]
    command.stop()
