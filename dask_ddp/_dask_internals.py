"""Every use of distributed's private API, in one place.

dask-ddp relies on public distributed API wherever one does the job. What is left here
has no public equivalent in the distributed versions named by :data:`CHECKED_WITH`;
``tests/test_dask_internals.py`` exercises each function against the installed
distributed, so an upgrade that moves one of them fails there, not in a user's job.
"""

from __future__ import annotations

#: The distributed releases these functions were checked against.
CHECKED_WITH = ("2026.8.0",)

# --- used by dask_ddp.events ---


# --- used by dask_ddp.data ---
