import pytest

from k3.bench.timing import threads


@pytest.fixture(autouse=True, scope="package")
def one_thread():
    """Smoke runs check that an experiment runs, not its speed: one intra-op thread keeps them fast on a
    shared, busy CPU (two threads contending with other processes can be 10x slower on these tiny ops)."""
    with threads(1):
        yield
