"""The exceptions a caller decides on: one class per decision, no aliases, and each one
pickles back from a worker with its fields."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import dask_ddp
import dask_ddp.data
from dask_ddp import errors


def _public_exceptions() -> dict[str, type]:
    found = {}
    for module in (dask_ddp, dask_ddp.data, errors):
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, BaseException):
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_exception_is_in_dask_ddp_errors_under_its_own_name() -> None:
    # Importable where the docs say (dask_ddp.errors, the data errors from dask_ddp.data
    # too, the ones a user catches from dask_ddp), always the same class under its own name:
    # no aliases.
    for name, cls in _public_exceptions().items():
        assert name.rsplit(".", 1)[1] == cls.__name__, name
        assert cls.__module__ == "dask_ddp.errors", name
        assert getattr(errors, cls.__name__) is cls
    assert {n for n in dask_ddp.__all__ if n.endswith("Error")} <= set(errors.__all__)


def test_the_package_exports_the_errors_a_user_catches_and_the_docs_name_each() -> None:
    # docs/errors.md lists what dask_ddp exports: each with when it is raised and what to
    # do; the rest stay in dask_ddp.errors, out of the top level.
    page = (Path(__file__).parents[1] / "docs" / "errors.md").read_text()
    top = {n for n in dask_ddp.__all__ if isinstance(getattr(dask_ddp, n), type)}
    top_errors = {n for n in top if issubclass(getattr(dask_ddp, n), BaseException)}
    listed = set(re.findall(r"^### `(\w+)`", page, re.MULTILINE))
    assert listed == top_errors, "docs/errors.md's sections and dask_ddp's errors differ"
    for name in top_errors:
        section = page.split(f"### `{name}`", 1)[1].split("\n### ", 1)[0]
        assert "Raised" in section and "What to do" in section, name
    assert len(top_errors) <= 10
    assert "NotInRankError" not in dask_ddp.__all__ and "NotInRankError" not in dir(dask_ddp)
    assert dask_ddp.errors.NotInRankError.__module__ == "dask_ddp.errors"


def test_each_outcome_of_a_job_is_one_class_to_catch() -> None:
    # what a caller of job.result() decides on
    infrastructure = {
        "InfrastructureError", "NoWorkersError", "WorkerBusyError", "RendezvousTimeoutError",
        "WorkerLostError", "ScaleTimeoutError", "TooManyResizesError", "ChannelError",
        "SchedulerPluginError",
        "SampleFetchError", "StorageAccessError", "DatasetPartitionLostError",
        "CheckpointUploadError", "RankDiedError",
    }  # fmt: skip
    for name, cls in _public_exceptions().items():
        if cls.__name__ in infrastructure:
            assert issubclass(cls, dask_ddp.InfrastructureError), name
        else:
            assert not issubclass(cls, dask_ddp.InfrastructureError), name
    for cls in (
        dask_ddp.RankFailedError,
        dask_ddp.JobCancelledError,
        dask_ddp.RetryableError,
        dask_ddp.data.DataNotFoundError,
        dask_ddp.data.CorruptDataError,
    ):
        assert not issubclass(cls, dask_ddp.InfrastructureError)
    assert issubclass(dask_ddp.data.DataNotFoundError, FileNotFoundError)
    assert issubclass(dask_ddp.data.CorruptDataError, ValueError)
    assert issubclass(dask_ddp.errors.RendezvousTimeoutError, TimeoutError)
    assert issubclass(dask_ddp.errors.CheckpointUploadError, OSError)
    assert issubclass(dask_ddp.errors.CheckpointShardsError, ValueError)


def test_the_job_s_errors_pickle_and_travel_as_plain_values() -> None:
    for error in (
        dask_ddp.WorkerLostError(1, "tcp://10.0.0.7:1", "ddp_train-rank1-3f2a", finished=True),
        dask_ddp.ScaleTimeoutError("3f2a", 3, 2, 300.0),
        dask_ddp.errors.TooManyResizesError("3f2a", 20, 20, "shrink: rank 1 was lost"),
        dask_ddp.JobCancelledError("3f2a", "no client followed it"),
        dask_ddp.RankStoppedError(0, "ValueError: bad batch", failed_rank=1),
        dask_ddp.RankFailedError(1, "tcp://w:1", "k", "ValueError: x", "Traceback ..."),
        dask_ddp.errors.CheckpointUploadError(
            0, 20, "s3://b/r/c.pt", "PermissionError: denied", 10
        ),
        dask_ddp.errors.CheckpointShardsError("s3://b/r", 40, 4, 2),
        dask_ddp.errors.RankDiedError(1, "tcp://w:1", "k", -9),
        dask_ddp.JobStalledError("3f2a", "no rank progressed for 120 s", (1,)),
    ):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error)
        wired = errors.from_wire(errors.to_wire(error))
        assert type(wired) is type(error) and str(wired) == str(error)


def _example_value(name: str, annotation: str) -> object:
    """A made-up argument for parameter ``name`` of a constructor, by its annotation."""
    if "Literal" in annotation or name == "problem":
        return "credentials" if "credentials" in annotation else "unreachable"
    if annotation.startswith(("int", "float")) or annotation in ("int | None", "float | None"):
        return 3 if "int" in annotation else 2.5
    if annotation.startswith("bool"):
        return True
    if annotation.startswith(("Mapping", "dict")):
        return {"a.py": 5}
    if annotation.startswith(("tuple", "list", "Sequence")):
        return ("a", "b") if "str" in annotation else (1, 2)
    return f"<{name}>"


def _every_error() -> list[type]:
    return [
        getattr(errors, name)
        for name in errors.__all__
        if isinstance(getattr(errors, name), type)
        and issubclass(getattr(errors, name), errors.DaskDDPError)
    ]


def test_every_error_round_trips_from_its_named_fields() -> None:
    # The scheduler sends a job's error to its clients by class name and named fields; a
    # constructor that changes without its attributes (or the other way) fails here instead
    # of degrading, on the client, into a plain DaskDDPError with the text.
    import inspect

    import msgpack

    checked = []
    for cls in _every_error():
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        if any(p.kind is p.VAR_POSITIONAL for p in params):  # Exception's own: its message
            again = errors.from_wire(errors.to_wire(cls("what happened")))
            assert type(again) is cls and str(again) == "what happened", cls.__name__
            checked.append(cls.__name__)
            continue
        kwargs = {
            p.name: _example_value(p.name, str(p.annotation))
            for p in params
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        }
        error = cls(**kwargs)
        wire = msgpack.unpackb(msgpack.packb(errors.to_wire(error)))
        assert wire["fields"] is not None, f"{cls.__name__} does not keep its arguments"
        again = errors.from_wire(wire)
        assert type(again) is cls and str(again) == str(error), cls.__name__
        checked.append(cls.__name__)
    assert len(checked) == len(_every_error()) > 30
