"""An HF ``transformers.Trainer`` callback that reports to dask_ddp: its logs, its checkpoints.

Add :class:`DaskDDPCallback` to the Trainer's callbacks and:

- what the Trainer logs (``loss``, ``learning_rate``, ``grad_norm``, eval metrics) reaches
  :attr:`Job.metrics <dask_ddp.Job.metrics>`, the live view and ``launch(on_report=...)``,
  at the Trainer's global step;
- every checkpoint it saves (``save_steps``) also goes to the job's ``checkpoint_dir``
  through :func:`dask_ddp.save_checkpoint`, as the files of the Trainer's checkpoint
  directory, so a restarted or resized job resumes from it, optimizer, scheduler and
  step included: ``trainer.train(resume_from_checkpoint=DaskDDPCallback.resume_dir())``.

Examples
--------
>>> from dask_ddp.integrations.transformers import DaskDDPCallback
>>> trainer = Trainer(model, args, train_dataset=data,   # doctest: +SKIP
...                   callbacks=[DaskDDPCallback()])
>>> trainer.train(resume_from_checkpoint=DaskDDPCallback.resume_dir())  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

from transformers import TrainerCallback

from ..errors import CheckpointDirMissingError, NotInRankError
from ._values import send

__all__ = ["DaskDDPCallback"]

logger = logging.getLogger(__name__)


class DaskDDPCallback(TrainerCallback):
    """Forwards the Trainer's logs to :func:`dask_ddp.report` and its checkpoints to
    :func:`dask_ddp.save_checkpoint` (see the module's description).

    The Trainer calls callbacks on every process: each rank reports its own values (the
    Trainer's loss is already averaged over ranks), and every rank takes part in saving a
    checkpoint as dask_ddp asks (rank 0, whose process wrote the directory, sends it).
    Outside a dask_ddp rank nothing is sent.
    """

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        send(logs or {}, int(state.global_step))

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        from .. import get_context, save_checkpoint

        try:
            rank = get_context().rank
        except NotInRankError:
            return
        files: dict[str, bytes] = {}
        import torch.distributed as dist

        if dist.is_initialized():
            # Every process writes its own files there (rng_state_<rank>.pth): rank 0
            # reads the directory once they all have, never a half-written one.
            dist.barrier()
        if rank == 0:
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            files = _read_dir(path)
        try:
            save_checkpoint(
                {"hf_checkpoint": files, "global_step": int(state.global_step)},
                step=int(state.global_step),
            )
        except CheckpointDirMissingError as exc:
            logger.debug("DaskDDPCallback: checkpoint not forwarded (%s)", exc)

    @staticmethod
    def resume_dir(directory: str | None = None) -> str | None:
        """The job's newest forwarded checkpoint, written out as a Trainer checkpoint
        directory under ``directory`` (default: a new temporary one) on this rank: pass it
        as ``resume_from_checkpoint``. None on a job's first attempt, without
        ``checkpoint_dir``, or outside a dask_ddp rank."""
        from .. import get_checkpoint

        try:
            state = get_checkpoint()
        except NotInRankError:
            return None
        if not state or not state.get("hf_checkpoint"):
            return None
        out = os.path.join(
            directory or tempfile.mkdtemp(prefix="dask-ddp-hf-"),
            f"checkpoint-{state['global_step']}",
        )
        for name, data in state["hf_checkpoint"].items():
            target = os.path.join(out, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                f.write(data)
        return out


def _read_dir(path: str) -> dict[str, bytes]:
    """Every file under ``path``, by its path relative to it."""
    files = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                files[os.path.relpath(full, path)] = f.read()
    return files
