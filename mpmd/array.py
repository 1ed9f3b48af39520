"""RemoteArray: a handle to a buffer that lives on one or more actors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from mpmd.mesh import RemoteMesh


class RemoteArray:
    """A handle to an array held by actors. The data stays remote until `to_numpy()` (or `np.asarray`).

    `actors` lists the actors holding a copy (usually one); `buffers` maps each to its buffer id there.
    Dropping the last reference frees the remote buffers (batched, asynchronously); `delete()` frees now.
    """

    __slots__ = ("__weakref__", "buffers", "dtype", "mesh", "shape")

    def __init__(self, mesh: RemoteMesh, buffers: dict[int, int], shape: tuple[int, ...], dtype: Any) -> None:
        self.mesh = mesh
        self.buffers = dict(buffers)
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)

    @property
    def actors(self) -> list[int]:
        return sorted(self.buffers)

    @property
    def actor(self) -> int:
        """The (first) actor holding this array."""
        return self.actors[0]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def is_deleted(self) -> bool:
        return not self.buffers

    def to_numpy(self) -> np.ndarray:
        """Fetch the array to the controller (waits for the computation that produces it). The result is a
        read-only view of the received bytes (no copy); use `np.array(r)` for a writable copy."""
        if not self.buffers:
            raise ValueError("this RemoteArray was deleted; its data is gone")
        return self.mesh._get(self.actor, self.buffers[self.actor])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.to_numpy()
        return a.astype(dtype) if dtype is not None else a

    def delete(self) -> None:
        """Free the remote buffers now (waits for the actors to confirm)."""
        buffers, self.buffers = self.buffers, {}
        if buffers:
            self.mesh._delete_now(buffers)

    def __del__(self) -> None:
        buffers = getattr(self, "buffers", None)
        if buffers:
            try:
                self.mesh._release(buffers)
            except Exception:
                pass

    def __repr__(self) -> str:
        state = "deleted" if not self.buffers else f"on actor{'s' if len(self.buffers) > 1 else ''} {','.join(map(str, self.actors))}"
        return f"RemoteArray({self.dtype.name}{list(self.shape)}, {state})"
