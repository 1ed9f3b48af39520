import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Four host devices in the test process, for jax.jit references on a mesh of an actor's shape (SPMD tests);
# actors set their own device count.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import pytest

import mpmd


@pytest.fixture(scope="session")
def mesh2():
    """Two real `mpmd-actor` subprocesses on ipc sockets, shared by the tests that only read from them."""
    with mpmd.RemoteMesh.local(num_actors=2) as mesh:
        yield mesh
