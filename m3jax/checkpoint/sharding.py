"""Target shardings for loading: per-parameter ``jax.sharding.Sharding`` from what the caller passes to
``m3jax.load``.

Accepted forms:
  * ``shardings=`` a single Sharding (every parameter), a callable ``(param_path, abstract_var) -> Sharding | None``,
    or a pytree keyed like the model's parameter state (an ``nnx.State`` such as ``nnx.get_named_sharding(state,
    mesh)``, or nested dicts / lists with the same keys) whose leaves are Shardings;
  * ``mesh=`` plus ``axis_rules=`` ((logical_name, mesh_axis | tuple | None), ...): each parameter's logical axis
    names (``nnx.Param(..., out_sharding=names)``, see m3jax/logical_axes.py) are mapped to mesh axes. Without
    rules, a logical name that is also a mesh axis name maps to itself and every other name is replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from m3jax.sharding import fit_spec, is_scales

ParamPath = tuple[Any, ...]
AxisRules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def resolve(flat: Sequence[tuple[ParamPath, Any]], *, shardings: Any = None, mesh: jax.sharding.Mesh | None = None,
            axis_rules: AxisRules | None = None) -> dict[ParamPath, jax.sharding.Sharding] | None:
  """Param path -> Sharding for every parameter in ``flat`` ((path, abstract variable) pairs); None when the
  caller asked for nothing (default device placement)."""
  if shardings is not None and mesh is not None:
    raise ValueError("pass either shardings= or mesh= (+ axis_rules=), not both")
  if shardings is None and mesh is None:
    if axis_rules is not None:
      raise ValueError("axis_rules= needs a mesh=")
    return None
  out: dict[ParamPath, jax.sharding.Sharding] = {}
  for path, var in flat:
    if mesh is not None:
      spec = logical_to_mesh(_logical_axes(var), mesh, axis_rules)
      if is_scales(var):  # fp8 scales: dims a mesh axis does not divide stay replicated
        spec = fit_spec(spec, var.shape, dict(mesh.shape))
      sharding = NamedSharding(mesh, spec)
    elif isinstance(shardings, jax.sharding.Sharding):
      sharding = shardings
    elif callable(shardings) and not isinstance(shardings, (Mapping, nnx.State)):
      sharding = shardings(path, var)
    else:
      sharding = _lookup(shardings, path)
    if sharding is None:
      continue
    if not isinstance(sharding, jax.sharding.Sharding):
      raise ValueError(f"sharding for parameter {_name(path)} is {type(sharding).__name__}, not a jax Sharding")
    _check_divisible(path, var.shape, sharding)
    out[path] = sharding
  return out


def logical_to_mesh(axes: Sequence[str | None], mesh: jax.sharding.Mesh,
                    axis_rules: AxisRules | None) -> PartitionSpec:
  """Logical axis names -> PartitionSpec over ``mesh`` (first matching rule wins; a mesh axis is used once)."""
  rules = list(axis_rules) if axis_rules is not None else [(n, n) for n in mesh.axis_names]
  used: set[str] = set()
  spec = []
  for name in axes:
    target = None
    for logical, mesh_axes in rules:
      if logical == name:
        target = mesh_axes
        break
    names = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
    unknown = [n for n in names if n not in mesh.axis_names]
    if unknown:
      raise ValueError(f"axis rule {name!r} -> {target!r} names mesh axes {unknown} not in {mesh.axis_names}")
    if any(n in used for n in names):
      names = ()  # a mesh axis can shard only one dimension of an array
    used.update(names)
    spec.append(None if not names else (names[0] if len(names) == 1 else names))
  return PartitionSpec(*spec)


def _logical_axes(var: Any) -> tuple[str | None, ...]:
  axes = var.get_metadata().get("out_sharding") if hasattr(var, "get_metadata") else None
  return tuple(axes) if axes is not None else (None,) * len(var.shape)


def _lookup(tree: Any, path: ParamPath) -> Any:
  node = tree
  for key in path:
    try:
      node = node[key]
    except (KeyError, IndexError, TypeError):
      try:
        node = node[str(key)]
      except (KeyError, IndexError, TypeError):
        raise ValueError(f"shardings= has no entry for parameter {_name(path)}") from None
  if isinstance(node, nnx.Variable):
    node = node.get_value()
  return node


def _check_divisible(path: ParamPath, shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> None:
  try:
    sharding.shard_shape(tuple(shape))
  except ValueError as e:
    raise ValueError(f"sharding {sharding} does not fit parameter {_name(path)} of shape {list(shape)}: {e}") from None


def _name(path: ParamPath) -> str:
  return "/".join(map(str, path))


def placement_fn(table: dict[ParamPath, jax.sharding.Sharding] | None) -> Callable[[ParamPath], Any]:
  """path -> Sharding or None (default placement)."""
  return (lambda path: None) if table is None else table.get
