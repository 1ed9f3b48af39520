"""An actor's own device mesh, and arrays laid out over it (SPMD inside an actor).

The controller names the mesh shape and axis names (the same on every actor); a layout is a PartitionSpec
over those names, travelling as a list (mpmd/runtime/sharding.py). Host arrays are placed shard by shard (never
gathered on one device); a sharded value crosses to another actor as its distinct shards, device k to device
k, and is rebuilt there with the same layout.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from transport.protocol import ALLOWED_DTYPES, PACKED_DTYPES


def build_mesh(devices: list[Any], shape: list[int], names: list[str]) -> Mesh:
    """`shape` devices named `names` over this actor's devices (jax.jit-style automatic axes)."""
    need = math.prod(shape)
    if need != len(devices):
        raise ValueError(f"this actor has {len(devices)} devices but mesh_shape {tuple(shape)} needs {need}; start it with as many "
                         "(--cpu-devices N, or --devices) or ask for a mesh of its size")
    return Mesh(np.array(devices).reshape(shape), tuple(names), axis_types=(AxisType.Auto,) * len(shape))


def spec_from_wire(wire: Any) -> PartitionSpec | None:
    if wire is None:
        return None
    if not isinstance(wire, list) or not all(e is None or isinstance(e, str) or
                                             (isinstance(e, list) and all(isinstance(n, str) for n in e)) for e in wire):
        raise ValueError(f"a layout must be a list of None, axis names or lists of axis names, got {wire!r:.80}")
    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in wire))


def spec_to_wire(spec: PartitionSpec | None) -> list[Any] | None:
    if spec is None:
        return None
    return [e if e is None or isinstance(e, str) else list(e) for e in spec]


def sharding_of(mesh: Mesh | None, spec: PartitionSpec | None, device: Any) -> Any:
    """The jax sharding for `spec` on this actor (its single device when it has no mesh)."""
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(device)
    return NamedSharding(mesh, spec if spec is not None else PartitionSpec())


def spec_of(value: Any) -> list[Any] | None:
    """The wire layout of a value held here (None for a single-device or host array)."""
    s = getattr(value, "sharding", None)
    if isinstance(s, NamedSharding):
        return spec_to_wire(s.spec)
    return None


# 4- and 2-bit dtypes: one byte per element in numpy, packed on the device. jax.device_put of such a numpy array
# left it unpacked, and an executable refused it ("compiled for input layouts that disagree"; a probe).
SUB_BYTE = frozenset(ALLOWED_DTYPES[n] for n in PACKED_DTYPES)


def to_device(host: Any, device: Any) -> Any:
    """`host` (a numpy array; anything else passes through device_put) on `device`, laid out as executables take it."""
    if isinstance(host, np.ndarray) and host.dtype in SUB_BYTE:
        with jax.default_device(device):
            return jnp.array(host)
    return jax.device_put(host, device, may_alias=False)


def to_device_all(hosts: list[Any], device: Any) -> list[Any]:
    """`to_device` of each of `hosts`, the plain numpy arrays among them in one `device_put` (16,384 empty constants of
    a Program: 8.8 s one call each, 3.2 s in one)."""
    plain = [i for i, h in enumerate(hosts) if isinstance(h, np.ndarray) and h.dtype not in SUB_BYTE]
    placed = dict(zip(plain, jax.device_put([hosts[i] for i in plain], device, may_alias=False)))
    return [placed[i] if i in placed else to_device(h, device) for i, h in enumerate(hosts)]


def put(host: np.ndarray, mesh: Mesh | None, spec: PartitionSpec | None, device: Any) -> jax.Array:
    """A host array on this actor's devices, each device given only its own shard."""
    if mesh is None:
        return to_device(host, device)
    if host.dtype in SUB_BYTE:
        raise ValueError(f"{host.dtype.name} arrays on actors with several devices are not supported: JAX lays them out "
                         "unpacked where the executables take them packed; cast to int8 (or uint8) before the step and back "
                         "inside it")
    sharding = sharding_of(mesh, spec, device)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: np.require(np.asarray(host[idx]), requirements="C"))


def shards_at(value: jax.Array, positions: list[int]) -> list[tuple[int, np.ndarray]]:
    """(position, host copy of the shard on the mesh's device at that position) for each position."""
    devices = list(value.sharding.mesh.devices.flat)
    by_device = {sh.device: sh for sh in value.addressable_shards}
    return [(pos, np.asarray(by_device[devices[pos]].data)) for pos in positions]


def distinct_shards(value: jax.Array) -> list[tuple[int, np.ndarray]]:
    """(position in the mesh's device order, host copy of the shard) for every distinct shard of `value`
    (a replicated axis holds copies: only the first is sent)."""
    mesh = value.sharding.mesh
    order = {d: i for i, d in enumerate(mesh.devices.flat)}
    out = []
    for sh in value.addressable_shards:
        if sh.replica_id == 0:
            out.append((order[sh.device], np.asarray(sh.data)))
    return sorted(out, key=lambda x: x[0])


def assemble(shape: tuple[int, ...], mesh: Mesh, spec: PartitionSpec, shards: dict[int, np.ndarray]) -> jax.Array:
    """Rebuild a value of layout `spec` from its distinct shards (keyed by device position), placing each
    shard on every device of this actor's mesh that holds that slice."""
    sharding = NamedSharding(mesh, spec)
    devices = list(mesh.devices.flat)
    index_of = sharding.addressable_devices_indices_map(shape)
    by_slice: dict[Any, np.ndarray] = {}
    for pos, data in shards.items():
        by_slice[_key(index_of[devices[pos]], shape)] = data
    arrays = [to_device(by_slice[_key(index_of[d], shape)], d) for d in devices]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def distinct_positions(shape: tuple[int, ...], mesh: Mesh, spec: PartitionSpec) -> list[int]:
    """The device positions whose shards a receiver of layout `spec` waits for (one per distinct slice)."""
    sharding = NamedSharding(mesh, spec)
    index_of = sharding.addressable_devices_indices_map(shape)
    seen: set[Any] = set()
    out = []
    for pos, d in enumerate(mesh.devices.flat):
        k = _key(index_of[d], shape)
        if k not in seen:
            seen.add(k)
            out.append(pos)
    return out


def per_device_bytes(values: list[Any], mesh: Mesh | None, device: Any) -> list[int]:
    """Bytes each device of this actor holds for `values` (shards of sharded arrays count once per device)."""
    devices = list(mesh.devices.flat) if mesh is not None else [device]
    pos = {d: i for i, d in enumerate(devices)}
    out = [0] * len(devices)
    for v in values:
        shards = getattr(v, "addressable_shards", None)
        if shards is None:
            out[0] += int(getattr(v, "nbytes", 0))
            continue
        for sh in shards:
            if sh.device in pos:
                out[pos[sh.device]] += int(sh.data.nbytes)
    return out
