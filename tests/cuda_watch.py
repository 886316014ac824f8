"""Imported first by a test's fork server (tests/test_rank_process.py): every call of
torch's lazy CUDA initialisation from then on is recorded in :data:`calls`, with where it
came from."""

from __future__ import annotations

import traceback

import torch.cuda

calls: list[str] = []
_lazy_init = torch.cuda._lazy_init


def _recorded() -> None:
    calls.append("".join(traceback.format_stack(limit=12)))
    _lazy_init()


torch.cuda._lazy_init = _recorded
