"""Loading straight into sharded arrays on 4 host devices (a subprocess: XLA_FLAGS must be set before jax is
imported). Checks every restored parameter's sharding and values, for a converted (Orbax) checkpoint and for a
safetensors source, with shardings given as a mesh + logical-axis rules, a callable and a pytree."""

import os
import subprocess
import sys

import pytest

from conftest import FIXTURES
from m3jax.checkpoint.convert import convert

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, REPO)
import jax, numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
import m3jax
from m3jax.checkpoint import loader
from m3jax.checkpoint.sharding import logical_to_mesh

assert len(jax.devices()) == 4
mesh = jax.make_mesh((2, 2), ("expert", "tensor"))
RULES = (("experts", "expert"), ("vocab", "tensor"), ("q_heads", "tensor"), ("mlp", "tensor"),
         ("expert_mlp", "tensor"), ("embed", None), ("kv_heads", "tensor"))

def get(tree, path):
  node = tree
  for k in path:
    node = node[k]
  return node.get_value() if hasattr(node, "get_value") else node

def flat_params(model):
  return {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}

reference = {p: np.asarray(a) for p, a in flat_params(m3jax.load(DST)).items()}
abstract = {p: v for p, v in nnx.to_flat_state(nnx.state(m3jax.load(DST), nnx.Param))}

def check(model, expected_sharding):
  params = flat_params(model)
  assert params.keys() == reference.keys()
  n_sharded = 0
  for path, arr in params.items():
    want = expected_sharding(path)
    assert arr.sharding.is_equivalent_to(want, arr.ndim), (path, arr.sharding, want)
    np.testing.assert_array_equal(np.asarray(arr), reference[path], err_msg=str(path))
    n_sharded += len(arr.sharding.device_set) == 4 and not arr.sharding.is_fully_replicated
  return n_sharded

def by_rules(path):
  names = abstract[path].get_metadata()["out_sharding"]
  return NamedSharding(mesh, logical_to_mesh(names, mesh, RULES))

# 1. mesh + logical-axis rules, converted (Orbax) checkpoint and safetensors source.
for path in (DST, SRC):
  n = check(loader.load(path, mesh=mesh, axis_rules=RULES), by_rules)
  assert n >= 10, n
w = loader.load(DST, mesh=mesh, axis_rules=RULES).layers[1].mlp.w_gate_up[...]
assert w.sharding.spec == P("expert", None, "tensor") and w.addressable_shards[0].data.shape == (2, 48, 32)

# 2. a callable: experts over all 4 devices, everything else replicated.
four = jax.make_mesh((4,), ("x",))
def fn(path, var):
  return NamedSharding(four, P("x") if path[-1] in ("w_gate_up", "w_down") else P())
expected = lambda path: fn(path, None)
check(m3jax.load(DST, shardings=fn), expected)

# 3. a pytree of shardings keyed like the parameter state (nested dicts; layers by int index): vocab-sharded
# embedding and LM head, the rest replicated.
tree = {}
for path in reference:
  node = tree
  for k in path[:-1]:
    node = node.setdefault(k, {})
  vocab_axis = {("embed",): P("x"), ("lm_head",): P(None, "x")}
  node[path[-1]] = NamedSharding(four, vocab_axis.get(path, P()))
n = check(m3jax.load(DST, shardings=tree), lambda path: get(tree, path))
assert n == 2, n
print("SHARDING-OK")
"""

@pytest.mark.quick
def test_restore_into_requested_shardings(tmp_path):
  src = FIXTURES / "flat_b16" / "checkpoint"
  dst = tmp_path / "dst"
  convert(src, dst, progress=False)
  code = f"REPO = {REPO!r}\nDST = {str(dst)!r}\nSRC = {str(src)!r}\n" + SCRIPT
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0 and "SHARDING-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
