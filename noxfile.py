"""Test sessions per Python: ``nox`` (``pip install nox``).

- ``nox -s smoke``: on every Python that ``python_requires`` admits and this machine has
  (``nox`` skips the ones it cannot find), the package and a smoke set of tests, marked
  ``smoke``: a job, several ranks per worker, a cancel while a rank spins in Python, a stall,
  the command line. Each Python installs torch (about 1 GB) on its first run.
- ``nox -s tests``: the whole suite on the README's Python (what ``.ci/run`` runs).
"""

from __future__ import annotations

import nox

#: The Pythons ``setup.cfg``'s ``python_requires`` admits (tests/test_structure.py checks
#: that the two agree).
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]

#: Where the smoke set lives (named, so that a Python collects only these modules' imports).
SMOKE = ["tests/test_ranks_per_worker.py"]

nox.options.sessions = ["smoke"]
nox.options.reuse_venv = "yes"


@nox.session(python=PYTHONS)
def smoke(session: nox.Session) -> None:
    session.install("-e", ".[smoke]", "-c", "constraints.txt")
    session.run(
        "pytest", "-m", "smoke", "-p", "no:cacheprovider", "-n", "0", *(session.posargs or SMOKE)
    )  # fmt: skip


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test]", "-c", "constraints.txt")
    session.run("pytest", *session.posargs)
