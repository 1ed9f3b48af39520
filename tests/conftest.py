import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

import mpmd


@pytest.fixture(scope="session")
def mesh2():
    """Two real `mpmd-actor` subprocesses on ipc sockets, shared by the tests that only read from them."""
    with mpmd.RemoteMesh.local(num_actors=2) as mesh:
        yield mesh
