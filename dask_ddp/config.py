"""Package defaults under ``ddp:`` in dask.config, resolved once per launch on the client.

The defaults live in ``dask_ddp.yaml`` beside this module and are loaded on import with
``dask.config.update_defaults``, so ``dask.config.set``, ``DASK_DDP__*`` environment
variables and the user's YAML files override them. Rank code never reads dask.config: the
client resolves every value here and ships it in the job's plan.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from typing import Any

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

_HERE = os.path.dirname(__file__)

with open(os.path.join(_HERE, "dask_ddp.yaml")) as _f:
    _DEFAULTS = yaml.safe_load(_f)
dask.config.update_defaults(_DEFAULTS)


def get(key: str) -> Any:
    """``dask.config.get(key)``, falling back to the package's default. The fallback
    matters when the first ``import`` of this module happened inside a
    ``dask.config.set(...)`` block: leaving it takes the whole ``ddp`` section away again.

    >>> get("ddp.rendezvous-timeout")
    '60s'
    """
    return dask.config.get(key, default=dask.config.get(key, config=_DEFAULTS))


TimeoutLike = float | int | str | timedelta


@dataclasses.dataclass(frozen=True)
class Settings:
    """Configuration resolved on the client for one launch (seconds as floats)."""

    backend: str | None
    timeout: float
    rendezvous_timeout: float
    failure_grace: float
    gpu_count: int | None
    threads_per_rank: int | None
    tune_malloc: bool = True
    max_event_bytes: int = 64_000  # ddp.max-event-bytes: 64kB
    result_limit: int = 1_048_576  # ddp.result-limit: 1MiB
    event_flush_interval: float = 0.05
    job_event_rate: float = 2000.0
    event_drain_timeout: float = 10.0
    scale_timeout: float = 300.0
    orphan_timeout: float = 600.0
    max_resizes: int | None = 20  # None: no limit
    checkpoint_mode: str = "async"
    checkpoint_replicas: bool = True
    replica_fraction: float = 0.25
    stall_timeout: float | None = 120.0  # None: off
    stall_action: str = "warn"


def _seconds(value: Any, key: str) -> float:
    if isinstance(value, timedelta):
        return value.total_seconds()
    seconds = parse_timedelta(value, default="seconds")
    if seconds is None or seconds <= 0:
        raise ValueError(f"ddp.{key} must be a positive duration such as '60s'; got {value!r}")
    return float(seconds)


def _bytes(value: Any, key: str) -> int:
    try:
        number = parse_bytes(value) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        raise ValueError(f"ddp.{key} must be a size such as '64kB'; got {value!r}") from None
    if number <= 0:
        raise ValueError(f"ddp.{key} must be a positive size such as '64kB'; got {value!r}")
    return number


def _rate(value: Any, key: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"ddp.{key} must be a number of events a second; got {value!r}") from None
    if not number > 0:
        raise ValueError(f"ddp.{key} must be a positive number such as 2000; got {value!r}")
    return number


def _optional_int(value: Any, key: str) -> int | None:
    if value is None:
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"ddp.{key} must be a whole number or null; got {value!r}") from None
    if number < 0:
        raise ValueError(f"ddp.{key} must not be negative; got {value!r}")
    return number


_MODES = ("async", "sync")


def _mode(value: Any) -> str:
    if value not in _MODES:
        raise ValueError(
            f"checkpoint_mode (ddp.checkpoint.mode) must be 'async' or 'sync'; got {value!r}"
        )
    return value


def _fraction(value: Any, key: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"ddp.{key} must be a fraction such as 0.25; got {value!r}") from None
    if not 0 <= number <= 1:
        raise ValueError(f"ddp.{key} must be between 0 and 1; got {value!r}")
    return number


def resolve(
    *,
    backend: str | None = None,
    timeout: TimeoutLike | None = None,
    checkpoint_mode: str | None = None,
    stall_timeout: TimeoutLike | None = None,
) -> Settings:
    """Read ``ddp.*`` once; explicit arguments win over configuration.

    >>> resolve(timeout="90s").timeout
    90.0
    >>> resolve(checkpoint_mode="sync").checkpoint_mode
    'sync'
    >>> resolve(stall_timeout="30s").stall_timeout, resolve(stall_timeout=0).stall_timeout
    (30.0, None)
    """
    stall = stall_timeout if stall_timeout is not None else get("ddp.stall-timeout")
    mode = checkpoint_mode if checkpoint_mode is not None else get("ddp.checkpoint.mode")
    return Settings(
        backend=backend if backend is not None else get("ddp.backend"),
        timeout=_seconds(timeout if timeout is not None else get("ddp.timeout"), "timeout"),
        rendezvous_timeout=_seconds(get("ddp.rendezvous-timeout"), "rendezvous-timeout"),
        failure_grace=_seconds(get("ddp.failure-grace"), "failure-grace"),
        gpu_count=_optional_int(get("ddp.gpu-count"), "gpu-count"),
        threads_per_rank=_optional_int(get("ddp.threads-per-rank"), "threads-per-rank"),
        tune_malloc=bool(get("ddp.tune-malloc")),
        max_event_bytes=_bytes(get("ddp.max-event-bytes"), "max-event-bytes"),
        result_limit=_bytes(get("ddp.result-limit"), "result-limit"),
        event_flush_interval=_seconds(get("ddp.event-flush-interval"), "event-flush-interval"),
        job_event_rate=_rate(get("ddp.job-event-rate"), "job-event-rate"),
        event_drain_timeout=_seconds(get("ddp.event-drain-timeout"), "event-drain-timeout"),
        scale_timeout=_seconds(get("ddp.scale-timeout"), "scale-timeout"),
        orphan_timeout=_seconds(get("ddp.orphan-timeout"), "orphan-timeout"),
        max_resizes=_optional_int(get("ddp.max-resizes"), "max-resizes"),
        checkpoint_mode=_mode(mode),
        checkpoint_replicas=bool(get("ddp.checkpoint.replicas")),
        replica_fraction=_fraction(
            get("ddp.checkpoint.replica-memory"), "checkpoint.replica-memory"
        ),
        stall_timeout=None if stall in (None, 0, "0", False) else _seconds(stall, "stall-timeout"),
        stall_action=_stall_action(get("ddp.stall-action")),
    )


_STALL_ACTIONS = ("warn", "restart", "fail")


def _stall_action(value: Any) -> str:
    if value not in _STALL_ACTIONS:
        raise ValueError(
            f"ddp.stall-action must be one of {', '.join(_STALL_ACTIONS)}; got {value!r}"
        )
    return str(value)


def script_modules_limit() -> int:
    """``ddp.script-modules-limit`` in bytes: the most a script's own modules may weigh
    when shipped with its job (see :func:`dask_ddp.launch_script`)."""
    return _bytes(get("ddp.script-modules-limit"), "script-modules-limit")


def client_security(security: Any, role: str) -> Any:
    """The security a ``Client`` made inside a server of the cluster connects with: the
    cluster's own, with that server's (``role``: ``"scheduler"``, ``"worker"``) certificate
    and key in the client's role.

    A ``Client`` presents its ``tls_client_*`` certificate, which a scheduler or worker
    started with only its own (``dask scheduler --tls-cert``, dask-gateway's clusters) does
    not have. A cluster without TLS is left as it is.

    >>> from distributed.security import Security
    >>> sec = client_security(Security(tls_ca_file="ca.pem",
    ...     tls_scheduler_cert="scheduler.pem", tls_scheduler_key="scheduler.key"), "scheduler")
    >>> sec.tls_client_cert, sec.tls_client_key, sec.require_encryption
    ('scheduler.pem', 'scheduler.key', True)
    >>> client_security(Security(), "worker").tls_client_cert is None
    True
    """
    from distributed.security import Security

    fields = {name: getattr(security, name) for name in Security.__slots__}
    if getattr(security, f"tls_{role}_cert"):
        fields["tls_client_cert"] = getattr(security, f"tls_{role}_cert")
        fields["tls_client_key"] = getattr(security, f"tls_{role}_key")
    return Security(**fields)
