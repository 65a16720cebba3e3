"""Mesh, logical-axis rules and sharding helpers: the one place where logical axis names meet mesh axes.

Mesh: three named axes ``("data", "expert", "tensor")`` (any may be 1), built by ``make_mesh``; a mesh of
your own (``jax.make_mesh((8,), ("tensor",))``) may lack some of them: a missing axis counts as size 1.
  * data: the batch (data parallelism); weights are replicated over it.
  * expert: routed experts (expert parallelism, split over ``expert x tensor``); outside the MoE it
    carries the batch when the batch divides (DP attention), and query tokens under RULES_SP.
  * tensor: attention / indexer heads, dense and shared MLP width, vocabulary (tensor parallelism).
    More ranks than KV heads replicate the KV (and index) heads, as vLLM does (M3_SPEC §9).
There is no separate sequence axis: full M3 needs every device for its weights, so a sequence axis would
only replicate them. Sequence parallelism (RULES_SP) shards tokens over the expert / tensor axes instead.

Axis types are ``Auto`` (compiler-propagated), not jax 0.11's default ``Explicit``: under Explicit the
embedding gather, einsums contracting a sharded axis (o_proj, down projections) and ``ragged_dot`` all raise
until each call gets an ``out_sharding``, i.e. PartitionSpecs inside the layers. With Auto the layers only name
logical axes (``constrain``), and the heavy ops run under ``shard_map`` (m3jax/parallel), where sharding is
explicit per device anyway.

Parameters carry logical names as ``nnx.Param(..., out_sharding=names)`` metadata (m3jax/logical_axes.py);
caches carry ``LayerCache.LOGICAL_AXES``. A model knows its plan (``model.sharding_plan``): ``m3jax.load(path,
mesh=mesh)`` or ``shard_model(model, mesh)`` set it, and ``forward`` / ``init_caches`` activate it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from m3jax import logical_axes as ax

MESH_AXES = ("data", "expert", "tensor")
AxisTarget = str | tuple[str, ...] | None
Rules = tuple[tuple[str, AxisTarget], ...]

_VISION_NAMES = ("vision_embed", "vision_heads", "vision_head_dim", "vision_mlp", "vision_patch", "vision_norm")

# One rule per logical name (weights, cache, activations). A mesh axis shards at most one dimension of an
# array; for activations and caches, mesh axes that do not divide a dimension are dropped (odd batches).
RULES: Rules = (
    # weights
    (ax.VOCAB, "tensor"),
    (ax.EMBED, None),
    (ax.Q_HEADS, "tensor"),
    (ax.KV_HEADS, None),  # 4 KV heads: replicated weights; activations repeated up to the tensor axis
    (ax.HEAD_DIM, None),
    (ax.MLP, "tensor"),
    (ax.EXPERTS, ("expert", "tensor")),  # whole experts per device: no gate/up split of the 2I columns
    (ax.EXPERT_MLP, None),
    (ax.IDX_HEADS, None),  # as KV_HEADS (index head i serves KV group i)
    (ax.IDX_DIM, None),
    (ax.NORM, None),
    *((name, None) for name in _VISION_NAMES),  # vision tower: replicated (small)
    # caches
    (ax.CACHE_BATCH, ("data", "expert")),
    (ax.CACHE_SEQ, None),
    (ax.CACHE_HEADS, "tensor"),
    (ax.CACHE_DIM, None),
    # activations
    (ax.ACT_BATCH, ("data", "expert")),
    (ax.ACT_VISION_SEGMENTS, ("data", "expert", "tensor")),  # vision tower: data parallel over images
    (ax.ACT_SEQ, None),
    (ax.ACT_Q_SEQ, None),
    (ax.ACT_HEADS, "tensor"),
    (ax.ACT_EMBED, None),
    (ax.ACT_VOCAB, "tensor"),
)


def replace_rules(rules: Rules, **changes: AxisTarget) -> Rules:
  """``rules`` with the targets of the named logical axes replaced (keyword = logical name)."""
  unknown = set(changes) - {name for name, _ in rules}
  if unknown:
    raise ValueError(f"no rule for logical axes {sorted(unknown)}")
  return tuple((name, changes.get(name, target)) for name, target in rules)


# Sequence parallelism for long prefill: the residual stream is token-sharded over expert x tensor between
# layers; attention / indexer queries are token-sharded over `expert` (heads over `tensor`) and read the whole
# cached sequence. Decode (one token) falls back to RULES' layout automatically (1 does not divide).
RULES_SP: Rules = replace_rules(RULES, **{ax.ACT_SEQ: ("expert", "tensor"), ax.ACT_Q_SEQ: "expert"})


class MeshError(ValueError):
  """A mesh that cannot shard the model (lists every dimension that does not divide)."""


# ----------------------------------------------------------------------------------------------- meshes


def parse_mesh(text: str | Mapping[str, int] | None) -> dict[str, int]:
  """'data=1,expert=4,tensor=2' (or a mapping) -> {axis: size} over MESH_AXES (missing axes are 1)."""
  if text is None:
    items: dict[str, int] = {}
  elif isinstance(text, Mapping):
    items = {str(k): int(v) for k, v in text.items()}
  else:
    items = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
      name, sep, value = part.partition("=")
      if not sep or not value.strip().lstrip("-").isdigit():
        raise ValueError(f"mesh {text!r}: expected comma-separated axis=size over {MESH_AXES}, got {part!r}")
      items[name.strip()] = int(value)
  unknown = set(items) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"mesh {text!r}: unknown axes {sorted(unknown)}; the axes are {MESH_AXES}")
  if any(v < 1 for v in items.values()):
    raise ValueError(f"mesh {text!r}: axis sizes must be >= 1")
  return {name: items.get(name, 1) for name in MESH_AXES}


def format_mesh(sizes: Mapping[str, int]) -> str:
  return ",".join(f"{name}={sizes.get(name, 1)}" for name in MESH_AXES)


def make_mesh(shape: str | Mapping[str, int] | None = None, *, devices: Sequence[Any] | None = None) -> Mesh:
  """A ("data", "expert", "tensor") mesh with Auto axis types (see the module docstring for why).

  Args:
    shape: 'data=1,expert=4,tensor=2' or {'expert': 4, 'tensor': 2}; missing axes are 1; None puts every
      device on `tensor`.
    devices: devices to use (default: all of ``jax.devices()``, every process's under jax.distributed; a
      single-process run may use the first N).
  """
  all_devices = list(jax.devices() if devices is None else devices)
  sizes = parse_mesh(shape) if shape is not None else parse_mesh({"tensor": len(all_devices)})
  n = math.prod(sizes.values())
  if n > len(all_devices) or (n < len(all_devices) and devices is None and jax.process_count() > 1):
    raise MeshError(f"mesh {format_mesh(sizes)} needs {n} devices; {len(all_devices)} available "
                    f"({jax.process_count()} process(es))")
  auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=auto,
                       devices=all_devices[:n])


def mesh_sizes(mesh: Mesh | Mapping[str, int]) -> dict[str, int]:
  """{axis: size} over MESH_AXES (an axis the mesh lacks is 1), then any other axes of a Mesh."""
  if not isinstance(mesh, Mesh):
    return parse_mesh(mesh)
  return {**{name: 1 for name in MESH_AXES}, **dict(mesh.shape)}


def auto_axes(mesh: Mesh) -> Mesh:
  """``mesh`` with every axis of type Auto (same devices and names); itself when it already is. jax.make_mesh's
  default is Explicit, under which the model's ops raise (see the module docstring)."""
  auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
  if tuple(mesh.axis_types) == auto:
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


# ------------------------------------------------------------------------------------------------- plans


def _targets(rules: Rules) -> dict[str, tuple[str, ...]]:
  out: dict[str, tuple[str, ...]] = {}
  for name, target in rules:
    if name in out:
      raise ValueError(f"logical axis {name!r} has two rules; keep one rule per name")
    out[name] = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
  return out


def logical_spec(names: Sequence[str | None], sizes: Mapping[str, int], rules: Rules,
                 shape: Sequence[int] | None = None) -> PartitionSpec:
  """Logical names -> PartitionSpec over a mesh with axis ``sizes``.

  Strict (``shape`` None, parameters): the rule's axes as given, unless one is already used by an earlier
  dimension (then the dimension is replicated, as checkpoint.sharding.logical_to_mesh does). With ``shape``
  (activations, caches): unused axes that divide the dimension are kept, in order. Size-1 axes are dropped.
  """
  targets = _targets(rules)
  used: set[str] = set()
  spec: list[AxisTarget] = []
  for i, name in enumerate(names):
    axes = targets.get(name, ()) if name is not None else ()
    for a in axes:
      if a not in sizes:
        raise ValueError(f"rule {name!r} -> {axes} names mesh axis {a!r}; the mesh has {tuple(sizes)}")
    if shape is None:
      axes = () if any(a in used for a in axes) else axes
    else:
      kept, prod = [], 1
      for a in axes:
        if a not in used and shape[i] % (prod * sizes[a]) == 0:
          kept.append(a)
          prod *= sizes[a]
      axes = tuple(kept)
    axes = tuple(a for a in axes if sizes[a] > 1)
    used.update(axes)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*spec)


def spec_axes(entry: AxisTarget) -> tuple[str, ...]:
  """One PartitionSpec entry -> the tuple of mesh axes it names."""
  return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
  """A mesh and the rules mapping logical names onto it (hashable: a static attribute of the model).

  The mesh is kept with Auto axis types (``auto_axes``); axes of MESH_AXES it lacks count as size 1, so the
  rules' targets on them are dropped (a ``("tensor",)`` mesh is tensor parallelism only).
  """

  mesh: Mesh
  rules: Rules = RULES

  def __post_init__(self) -> None:
    object.__setattr__(self, "mesh", auto_axes(self.mesh))

  @property
  def sizes(self) -> dict[str, int]:
    return mesh_sizes(self.mesh)

  @property
  def is_trivial(self) -> bool:
    """One device: nothing to split (shard_map wrappers are skipped; constraints remain)."""
    return self.mesh.size == 1

  def spec(self, names: Sequence[str | None], shape: Sequence[int] | None = None) -> PartitionSpec:
    return logical_spec(names, self.sizes, self.rules, shape)

  def sharding(self, names: Sequence[str | None], shape: Sequence[int] | None = None) -> NamedSharding:
    return NamedSharding(self.mesh, self.spec(names, shape))

  def axis_product(self, name: str) -> int:
    """Product of the (rule) mesh axis sizes of one logical name."""
    return math.prod(self.sizes[a] for a in _targets(self.rules).get(name, ()))


_PLAN: contextvars.ContextVar[ShardingPlan | None] = contextvars.ContextVar("m3jax_sharding_plan", default=None)


@contextlib.contextmanager
def use_plan(plan: ShardingPlan | None) -> Iterator[None]:
  """Activates ``plan`` for ``constrain`` and the sharded ops (None keeps the current one)."""
  if plan is None:
    yield
    return
  token = _PLAN.set(plan)
  try:
    yield
  finally:
    _PLAN.reset(token)


def current_plan() -> ShardingPlan | None:
  return _PLAN.get()


def uses_model_plan(method: Callable[..., Any]) -> Callable[..., Any]:
  """Decorator for model methods: runs them under ``self.sharding_plan`` (if any)."""

  @functools.wraps(method)
  def wrapper(self, *args, **kwargs):
    with use_plan(getattr(self, "sharding_plan", None)):
      return method(self, *args, **kwargs)

  return wrapper


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Sharding constraint from logical names under the active plan (identity without one).

  Mesh axes that do not divide a dimension are dropped, so odd batch / sequence sizes stay legal.
  """
  plan = current_plan()
  if plan is None:
    return x
  if len(names) != x.ndim:
    raise ValueError(f"{len(names)} logical names {tuple(names)} for an array of shape {x.shape}")
  return jax.lax.with_sharding_constraint(x, plan.sharding(names, x.shape))


def replicated(x: jax.Array, plan: ShardingPlan | None = None) -> jax.Array:
  """Constrains ``x`` to be replicated on every device of ``plan`` (default: the active one; identity without
  one); used for small outputs that every process reads (tokens) under jax.distributed."""
  plan = plan or current_plan()
  if plan is None:
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(plan.mesh, PartitionSpec()))


def head_replication(num_heads: int) -> int:
  """How many times each KV / index head is repeated under the active plan: tensor // heads when the head
  axis has more ranks than heads (vLLM's KV replication), else 1."""
  plan = current_plan()
  n = 1 if plan is None else plan.axis_product(ax.ACT_HEADS)
  return n // num_heads if n > num_heads else 1


# ------------------------------------------------------------------------------------------- validation


def check_config(config: Any, mesh: Mesh | Mapping[str, int] | str, rules: Rules = RULES) -> None:
  """Raises MeshError naming every model dimension the mesh cannot divide (text backbone)."""
  sizes = mesh_sizes(mesh) if not isinstance(mesh, str) else parse_mesh(mesh)
  t = config.text if hasattr(config, "text") else config
  targets = _targets(rules)
  for name, axes in targets.items():
    for a in axes:
      if a not in sizes:
        raise MeshError(f"rule {name!r} -> {axes} names mesh axis {a!r}; the mesh has {tuple(sizes)}")

  def n(name: str) -> tuple[int, str]:
    axes = [a for a in targets.get(name, ()) if sizes[a] > 1]
    return math.prod(sizes[a] for a in axes), " x ".join(axes) or "no axis"

  errors: list[str] = []

  def need(value: int, name: str, what: str) -> None:
    k, label = n(name)
    if value % k:
      errors.append(f"{what} = {value} is not divisible by {label} = {k}")

  need(t.num_heads, ax.Q_HEADS, "attention heads")
  need(t.num_experts, ax.EXPERTS, "routed experts (split over expert x tensor)")
  need(t.vocab_size, ax.VOCAB, "vocab size")
  if "dense" in t.mlp_types:
    need(t.dense_intermediate_size, ax.MLP, "dense MLP width")
  if "moe" in t.mlp_types:
    need(t.shared_intermediate_size, ax.MLP, "shared-expert width")
  k, label = n(ax.ACT_HEADS)
  heads = [("KV heads", t.num_kv_heads)]
  if t.num_sparse_layers:
    heads.append(("index heads", t.index_num_heads))
    if k > 1 and t.index_num_heads != t.num_kv_heads:
      errors.append(f"head-sharded sparse attention needs index heads == KV heads, got {t.index_num_heads} "
                    f"and {t.num_kv_heads}")
  for what, h in heads:
    if (k > h and k % h) or (k <= h and h % k):
      errors.append(f"{what} = {h} and {label} = {k}: one must divide the other (more ranks than heads "
                    "replicate each head tensor / heads times)")
    elif k > h and t.num_heads % k:
      errors.append(f"attention heads = {t.num_heads} cannot be grouped over {label} = {k}")
  if errors:
    raise MeshError(f"mesh {format_mesh(sizes)} cannot shard this model:\n  - " + "\n  - ".join(errors))


# ------------------------------------------------------------------------------------ parameters / models


# nnx metadata flag of the scales of a weight kept in fp8 (m3jax.layers.quantized): they carry their weight's
# logical names, but a dimension that a mesh axis does not divide (a 128-row block grid of a small weight) stays
# replicated instead of failing (``param_spec``).
SCALES_METADATA = "quantization_scales"


def is_scales(var: Any) -> bool:
  """Whether an nnx variable (or abstract one) holds the scales of an fp8 weight."""
  return bool(var.get_metadata().get(SCALES_METADATA)) if hasattr(var, "get_metadata") else False


def fit_spec(spec: PartitionSpec, shape: Sequence[int], sizes: Mapping[str, int]) -> PartitionSpec:
  """``spec`` with each dimension's mesh axes kept, in order, while their product divides the dimension."""
  out: list[AxisTarget] = []
  for i, entry in enumerate(spec):
    kept, prod = [], 1
    for a in spec_axes(entry):
      if shape[i] % (prod * sizes[a]) == 0:
        kept.append(a)
        prod *= sizes[a]
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*out)


def param_spec(var: Any, plan: ShardingPlan) -> PartitionSpec:
  """The PartitionSpec of a parameter under ``plan`` (strict rules; fp8 scales fitted, see SCALES_METADATA)."""
  spec = plan.spec(logical_axes_of(var))
  return fit_spec(spec, var.shape, plan.sizes) if is_scales(var) else spec


def logical_axes_of(var: Any) -> tuple[str | None, ...]:
  """The logical names of a parameter (nnx.Param ``out_sharding`` metadata); None-filled if missing."""
  names = var.get_metadata().get("out_sharding") if hasattr(var, "get_metadata") else None
  return tuple(names) if names is not None else (None,) * len(var.shape)


def param_shardings(model: Any, plan: ShardingPlan) -> dict[tuple[Any, ...], NamedSharding]:
  """Param path -> NamedSharding for every variable of ``model`` (an nnx module or abstract module)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  return {path: NamedSharding(plan.mesh, param_spec(var, plan))
          for path, var in nnx.to_flat_state(nnx.state(model))}


def shard_model(model: Any, mesh: Mesh, rules: Rules = RULES) -> Any:
  """Lays an in-memory model's parameters out on ``mesh`` (device_put per parameter) and attaches the plan.

  For checkpoints use ``m3jax.load(path, mesh=mesh)``, which restores straight into sharded arrays. ``mesh``
  may lack some of MESH_AXES (size 1).
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  plan = ShardingPlan(mesh, tuple(rules))
  check_config(model.config, plan.mesh, plan.rules)
  state = nnx.state(model)
  flat = nnx.to_flat_state(state)
  for _, var in flat:
    var.set_value(jax.device_put(var.get_value(), NamedSharding(plan.mesh, param_spec(var, plan))))
  nnx.update(model, nnx.from_flat_state(flat))
  model.sharding_plan = plan
  return model


def put_replicated(x: Any, plan: ShardingPlan | None) -> jax.Array:
  """A host value (identical on every process) -> a jax.Array replicated over the plan's mesh (or the
  default device without a plan); makes inputs global under jax.distributed."""
  if plan is None:
    return jax.numpy.asarray(x)
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # typed PRNG key
    return jax.random.wrap_key_data(put_replicated(np.asarray(jax.random.key_data(x)), plan),
                                    impl=jax.random.key_impl(x))
  return jax.device_put(np.asarray(x), NamedSharding(plan.mesh, PartitionSpec()))


def per_device_bytes(tree: Any) -> dict[int, int]:
  """device id -> bytes held by the addressable shards of every jax.Array leaf of ``tree``."""
  out: dict[int, int] = {}
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      for shard in leaf.addressable_shards:
        out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
  return out
