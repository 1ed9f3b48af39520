"""The low-level runtime API: place arrays on actors, run jitted functions there, fetch results.

    python examples/embedding_api.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import mpmd


@jax.jit
def affine(params, x):
    return jnp.tanh(x @ params["w"] + params["b"])


def main() -> None:
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((8, 4)).astype(np.float32), "b": np.zeros(4, np.float32)}
    x = rng.standard_normal((2, 8)).astype(np.float32)
    with mpmd.RemoteMesh.local(num_actors=2) as mesh:
        remote_params = jax.tree.map(mesh.actor(1).put, params)  # lives on actor 1 from now on
        y = mesh.actor(1).run(affine, remote_params, x)  # lowered here, compiled once on actor 1
        print(repr(y), "->", [round(float(v), 3) for v in y.to_numpy().ravel()])
        np.testing.assert_array_equal(y.to_numpy(), np.asarray(affine(params, x)))
        print("actor 1 stats:", mesh.actor(1).stats())


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()  # --help
    main()
