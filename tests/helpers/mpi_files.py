"""The test files that hold MPI tests (``pytest.mark.mpi``): the MPI passes of scripts/test.sh collect these alone.

Every rank of an MPI pass imports what it collects; the files without an MPI test (about half, some of them
importing transformers or starting nothing but subprocesses) would cost each rank seconds of CPU to deselect. The
serial pass checks that every test marked ``mpi`` is in a file listed here (tests/conftest.py), so that no MPI test
is left out of the MPI passes.
"""

import re
import sys
from pathlib import Path

MARKED = re.compile(r"\bmark\.mpi\b")
"""How a file marks an MPI test: ``@pytest.mark.mpi``, ``pytestmark = pytest.mark.mpi``, ``marks=pytest.mark.mpi``."""


def mpi_files(root: Path) -> list[str]:
    """The test files under ``root/tests`` that mark a test ``mpi``, relative to ``root``, sorted."""
    return sorted(str(path.relative_to(root)) for path in (root / "tests").rglob("test_*.py")
                  if MARKED.search(path.read_text()))


if __name__ == "__main__":
    print("\n".join(mpi_files(Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd())))
