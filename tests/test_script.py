"""torchrun-style scripts through launch_script() and ``python -m dask_ddp``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from distributed import Client

import dask_ddp

TORCHRUN_STYLE = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    assert rank == dist.get_rank() and int(os.environ["WORLD_SIZE"]) == dist.get_world_size()
    assert os.environ["LOCAL_RANK"] == str(rank)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    assert sys.argv[1:] == ["--flag", "value"], sys.argv
    if rank == int(os.environ.get("FAIL_RANK", "-1")):
        sys.exit(3)
    dist.destroy_process_group()
    """
)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train_script.py"
    path.write_text(TORCHRUN_STYLE)
    return path


def test_launch_script_runs_as_main_on_each_rank(client: Client, script: Path) -> None:
    job = dask_ddp.launch_script(client, script, ["--flag", "value"])
    assert job.result(timeout=120) == [0, 0]


def test_script_failure_names_the_rank(client: Client, tmp_path: Path) -> None:
    path = tmp_path / "fails.py"
    path.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(3)\n")
    job = dask_ddp.launch_script(client, path)
    with pytest.raises(dask_ddp.RankFailedError, match=r"rank 1 .*exited with status 3"):
        job.result(timeout=120)
    assert dask_ddp.launch_script(client, script_ok(tmp_path)).result(timeout=120) == [0, 0]


def script_ok(tmp_path: Path) -> Path:
    path = tmp_path / "ok.py"
    path.write_text("print('ok')\n")
    return path


@pytest.mark.slow
def test_cli_starts_a_local_cluster(script: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "dask_ddp", str(script), "--flag", "value"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "every rank finished" in ok.stderr


@pytest.mark.slow
def test_cli_fails_with_the_failing_rank(script: Path) -> None:
    failed = subprocess.run(
        [sys.executable, "-m", "dask_ddp", str(script), "--flag", "value"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "FAIL_RANK": "1"},
    )
    assert failed.returncode == 1
    assert "rank 1 failed" in failed.stderr and "exited with status 3" in failed.stderr
    # Said once, by the CLI: not again by the job's log or each worker's "Compute Failed".
    assert failed.stderr.count("rank 1 failed") == 1, failed.stderr[-3000:]
    assert "Compute Failed" not in failed.stderr


def test_cli_with_a_scheduler_shows_what_the_ranks_print(client: Client, tmp_path: Path) -> None:
    path = tmp_path / "chatty.py"
    path.write_text(
        "import os, sys\n"
        "print('hello from', os.environ['RANK'])\n"
        "print('a warning', file=sys.stderr)\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "dask_ddp", "--scheduler", client.scheduler.address, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(out.stdout.splitlines()) == ["[rank 0] hello from 0", "[rank 1] hello from 1"]
    assert out.stderr.count("a warning") == 2


def test_cli_usage_errors_exit_2_before_starting_anything(tmp_path: Path) -> None:
    missing = subprocess.run(
        [sys.executable, "-m", "dask_ddp", str(tmp_path / "missing.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2
    assert "no script at" in missing.stderr and "LocalCluster" not in missing.stderr


def _worker_state() -> tuple[str, list[str], bool, str]:
    import os
    import sys

    return sys.modules["__main__"].__name__, list(sys.path), "helper" in sys.modules, os.getcwd()


def test_a_worker_that_does_not_see_the_folder_gets_the_modules_shipped(
    client: Client, tmp_path: Path
) -> None:
    """The script's folder exists on the client only: the rank imports a copy of the
    modules the script imports from there, then the worker is as it was."""
    from dask_ddp._shared.script import ScriptFiles, run_script, script_files

    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "helper.py").write_text("VALUE = 42\n")
    (folder / "unused.py").write_text("raise RuntimeError('not imported, not shipped')\n")
    source = (
        "import os, sys, pickle\n"
        "from helper import VALUE\n"
        "class Point:\n"
        "    pass\n"
        "assert VALUE == 42 and pickle.loads(pickle.dumps(Point())).__class__ is Point\n"
        "assert sys.modules['__main__'].__file__ == __file__ and __name__ == '__main__'\n"
        "os.chdir('/')\n"
        "sys.path.append('/somewhere')\n"
    )
    (folder / "train.py").write_text(source)
    files = script_files(str(folder / "train.py"))
    assert sorted(files.modules) == ["helper.py"]
    before = client.run(_worker_state)
    elsewhere = ScriptFiles("/nowhere/train.py", "/nowhere", files.modules)  # not on the worker
    ran = client.submit(run_script, source, "train.py", [], files=elsewhere, pure=False)
    assert ran.result(timeout=60) == 0
    assert client.run(_worker_state) == before


def test_over_the_limit_the_folder_serves_workers_that_see_it(
    client: Client, tmp_path: Path
) -> None:
    import dask

    (tmp_path / "helper.py").write_text("VALUE = 42\n")
    path = tmp_path / "uses_helper.py"
    path.write_text("from helper import VALUE\nassert VALUE == 42\n")
    with dask.config.set({"ddp.script-modules-limit": 1}):  # one byte: nothing fits
        assert dask_ddp.launch_script(client, path).result(timeout=120) == [0, 0]


def test_what_is_wrong_is_said_with_the_fix() -> None:
    from dask_ddp._shared.script import (
        ScriptModulesTooLargeError,
        ScriptSettingsError,
        script_settings,
    )

    block = "# /// script\n# [tool.dask-ddp]\n# {}\n# ///\n"
    with pytest.raises(ScriptSettingsError, match=r"t.py: .* 'resum'; known keys: resume"):
        script_settings(block.format("resum = 'own-snapshots'"), "t.py")
    with pytest.raises(ScriptSettingsError, match=r"resume = 'mine'; accepted: 'own-snapshots'"):
        script_settings(block.format("resume = 'mine'"), "t.py")
    with pytest.raises(ScriptSettingsError, match=r"is not valid TOML"):
        script_settings(block.format("resume = own"), "t.py")
    too_large = ScriptModulesTooLargeError("train.py", {"big.py": 3 << 20, "small.py": 10}, 1 << 20)
    assert "big.py (3072 KiB)" in str(too_large)
    assert "DASK_DDP__SCRIPT_MODULES_LIMIT=64MiB" in str(too_large)


def test_a_package_s_module_runs_as_python_m_where_the_worker_does_not_see_it(
    client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun's ``-m pkg.train`` from the client's working directory: on a worker that
    does not see that folder, the module, its package and what it imports from there are
    shipped, and it runs as ``python -m`` runs it (relative imports, ``__spec__``)."""
    from dask_ddp._shared.script import ScriptFiles, module_files, run_module

    project = tmp_path / "project"
    (project / "pkg").mkdir(parents=True)
    (project / "pkg" / "__init__.py").write_text("")
    (project / "pkg" / "helper.py").write_text("VALUE = 42\n")
    (project / "common.py").write_text("NAME = 'common'\n")
    (project / "unused.py").write_text("raise RuntimeError('not imported, not shipped')\n")
    (project / "pkg" / "train.py").write_text(
        "import sys\n"
        "from .helper import VALUE\n"
        "from common import NAME\n"
        "assert __name__ == '__main__' and __spec__.name == 'pkg.train', __spec__\n"
        "assert (VALUE, NAME) == (42, 'common') and sys.argv[1:] == ['--epochs', '2']\n"
    )
    monkeypatch.chdir(project)
    files = module_files("pkg.train")
    assert sorted(files.modules) == [
        "common.py",
        "pkg/__init__.py",
        "pkg/helper.py",
        "pkg/train.py",
    ]
    assert files.folder == str(project.resolve())
    before = client.run(_worker_state)
    elsewhere = ScriptFiles("/nowhere/pkg/train.py", "/nowhere", files.modules)
    ran = client.submit(run_module, "pkg.train", ["--epochs", "2"], files=elsewhere, pure=False)
    assert ran.result(timeout=60) == 0
    assert client.run(_worker_state) == before
    job = dask_ddp.launch_script(client, "pkg.train", ["--epochs", "2"], module=True)
    assert job.result(timeout=120) == [0, 0] and job.name == "pkg.train"


REPORTS = textwrap.dedent(
    """
    import os
    import dask_ddp

    for step in range(3):
        dask_ddp.report({"loss": 1.0 / (step + 1)}, step=step)
    print("rank", os.environ["RANK"], "done", flush=True)
    """
)


def test_launch_script_names_detaches_and_calls_back(client: Client, tmp_path: Path) -> None:
    path = tmp_path / "reports.py"
    path.write_text(REPORTS)
    records: list[dask_ddp.MetricRecord] = []
    lines: list[dask_ddp.OutputLine] = []
    job = dask_ddp.launch_script(
        client, path, name="reporting-script", detach=True,
        on_report=records.append, on_output=lines.append,
    )  # fmt: skip
    assert job.result(timeout=120) == [0, 0]
    assert sorted((r.rank, r.step) for r in records) == [(r, s) for r in (0, 1) for s in range(3)]
    assert sorted(line.text for line in lines) == ["rank 0 done", "rank 1 done"]
    (info,) = [j for j in dask_ddp.jobs(client) if j.job_id == job.job_id]
    assert info.name == "reporting-script" and info.detached
    assert dask_ddp.attach(client, "reporting-script").result(timeout=60) == [0, 0]
