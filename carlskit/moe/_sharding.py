"""GShard's sharding annotations (Lepikhin et al. 2020, section 3.2) on ``jax.sharding``.

``replicate``, ``split`` and ``shard`` annotate a tensor inside a jitted program with
``jax.lax.with_sharding_constraint``; XLA's SPMD partitioner then inserts the collectives
(all-to-all for the MoE dispatch). Without a mesh (argument or ``jax.set_mesh`` context) they
return the tensor unchanged, so the same program runs on one device.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from carlskit._checks import positive_int

DATA_AXIS = "data"
EXPERT_AXIS = "expert"
AxisName = str | tuple[str, ...] | None


def make_mesh(data: int = 1, expert: int | None = None, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``Mesh`` with axes ("data", "expert") of shape (data, expert) over the given devices.

    ``expert`` defaults to ``len(devices) // data``. Axes are ``AxisType.Auto`` so the SPMD
    partitioner propagates the annotations.
    """
    devices = list(jax.devices() if devices is None else devices)
    data = positive_int(data, "data")
    expert = len(devices) // data if expert is None else positive_int(expert, "expert")
    if expert < 1 or data * expert > len(devices):
        raise ValueError(
            f"mesh shape (data={data}, expert={expert}) needs data * expert <= {len(devices)} devices "
            f"and expert >= 1"
        )
    return jax.make_mesh(
        (data, expert), (DATA_AXIS, EXPERT_AXIS), axis_types=(AxisType.Auto,) * 2,
        devices=devices[: data * expert],
    )


def auto_axes(mesh: Mesh) -> Mesh:
    """The same mesh with every axis ``AxisType.Auto`` (``jax.make_mesh`` defaults to Explicit)."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _current_mesh(mesh: Mesh | None) -> Mesh | None:
    if mesh is not None:
        return mesh
    abstract = jax.sharding.get_abstract_mesh()
    return None if abstract.empty else abstract


def _constrain(x: jax.Array, spec: PartitionSpec, mesh: Mesh | None) -> jax.Array:
    mesh = _current_mesh(mesh)
    if mesh is None or mesh.size == 1:
        return x
    if isinstance(mesh, Mesh):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    return jax.lax.with_sharding_constraint(x, spec)


def replicate(x: jax.Array, *, mesh: Mesh | None = None) -> jax.Array:
    """GShard ``replicate(tensor)``: every device holds the whole tensor."""
    return _constrain(x, PartitionSpec(), mesh)


def split(
    x: jax.Array,
    dim: int | Sequence[int],
    axis: AxisName | Sequence[AxisName],
    *,
    mesh: Mesh | None = None,
) -> jax.Array:
    """GShard ``split(tensor, split_dimension, num_partitions)``: dimension ``dim`` is split over
    mesh axis ``axis`` (a name, or a tuple of names for their product); other dims replicated.
    ``dim`` and ``axis`` may be sequences of equal length to split several dims at once.
    """
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    axes = (axis,) if isinstance(dim, int) else tuple(axis)  # type: ignore[arg-type]
    if len(dims) != len(axes):
        raise ValueError(f"dim and axis must have the same length, got {dims} and {axes}")
    spec: list[AxisName] = [None] * x.ndim
    for d, a in zip(dims, axes):
        if not -x.ndim <= d < x.ndim:
            raise ValueError(f"dim {d} out of range for a tensor of rank {x.ndim}")
        spec[d] = a
    return _constrain(x, PartitionSpec(*spec), mesh)


def shard(x: jax.Array, device_assignment: np.ndarray) -> jax.Array:
    """GShard ``shard(tensor, device_assignment)``: tile ``x`` over the devices in the array
    ``device_assignment`` (rank = ``x.ndim``; entry ``[i, j, ...]`` = the device, or its id,
    holding tile ``(i, j, ...)``)."""
    assignment = np.asarray(device_assignment, dtype=object)
    if assignment.ndim != x.ndim:
        raise ValueError(
            f"device_assignment must have rank {x.ndim} (one tile count per dim), got shape {assignment.shape}"
        )
    by_id = {d.id: d for d in jax.devices()}
    devices = np.vectorize(lambda d: by_id[d] if isinstance(d, (int, np.integer)) else d, otypes=[object])(assignment)
    names = tuple(f"tile_{i}" for i in range(x.ndim))
    mesh = Mesh(devices, names, axis_types=(AxisType.Auto,) * x.ndim)
    spec = PartitionSpec(*(name if n > 1 else None for name, n in zip(names, assignment.shape)))
    return _constrain(x, spec, mesh)
