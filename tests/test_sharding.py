"""Sharding: rules cover every leaf, mesh errors, memory plan; on 8 simulated CPU devices (subprocesses, see
tests/sharding_worker.py) sharded forward / greedy generation equal the single-device results, per-device
bytes match the plan, and two jax.distributed processes reproduce the single-process logits."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec as P

import m3jax
from conftest import FIXTURES
from m3jax import cli
from m3jax import logical_axes as ax
from m3jax import sharding
from m3jax.cache import LayerCache
from m3jax.checkpoint.sharding import logical_to_mesh
from m3jax.parallel.memory import FP8_BYTES, plan_memory

WORKER = pathlib.Path(__file__).parent / "sharding_worker.py"
REPO = pathlib.Path(__file__).parent.parent
MESHES = ["tensor=8", "expert=8", "data=2,tensor=4", "expert=4,tensor=2", "expert=4,tensor=2+sp"]


def run_worker(*args: str, devices: int = 8, timeout: int = 600) -> dict:
  env = {**os.environ, "PYTHONPATH": str(REPO), "M3JAX_TEST_DEVICES": str(devices)}
  proc = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, env=env,
                        timeout=timeout, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------ in-process (1 device)


def _abstract(cfg):
  model = nnx.eval_shape(lambda: m3jax.M3ForCausalLM(cfg, dtype=jnp.float32, with_vision=cfg.vision is not None))
  return list(nnx.to_flat_state(nnx.state(model)))


@pytest.mark.quick
def test_every_parameter_and_cache_leaf_has_a_rule():
  ruled = {name for name, _ in sharding.RULES}
  flat = _abstract(m3jax.tiny(vision=True))
  for path, var in flat:
    names = sharding.logical_axes_of(var)
    missing = [n for n in names if n is not None and n not in ruled]
    assert not missing, f"{'/'.join(map(str, path))}: logical names {missing} have no rule"
  for names in LayerCache.LOGICAL_AXES.values():
    assert set(names) <= ruled
  activations = {getattr(ax, n) for n in dir(ax) if n.startswith("ACT_")}
  assert activations <= ruled and activations <= {name for name, _ in sharding.RULES_SP}


@pytest.mark.parametrize("mesh", ["tensor=8", "expert=8", "data=2,tensor=4", "expert=4,tensor=2", "data=2,expert=2"])
@pytest.mark.quick
def test_parameter_specs_agree_with_the_checkpoint_loader(mesh):
  """m3jax.load(mesh=) hands RULES to checkpoint/sharding.py; shard_model uses logical_spec: same layout."""
  sizes = sharding.parse_mesh(mesh)
  abstract = AbstractMesh(tuple(sizes.values()), tuple(sizes))
  for path, var in _abstract(m3jax.tiny()):
    names = sharding.logical_axes_of(var)
    ours = sharding.logical_spec(names, sizes, sharding.RULES)
    theirs = logical_to_mesh(names, abstract, sharding.RULES)
    drop1 = [tuple(a for a in sharding.spec_axes(e) if sizes[a] > 1) for e in theirs]
    assert [sharding.spec_axes(e) for e in ours] == drop1, path


@pytest.mark.quick
def test_spec_drops_axes_that_do_not_divide_activations():
  sizes = sharding.parse_mesh("data=2,expert=4,tensor=2")
  names = (ax.ACT_BATCH, ax.ACT_SEQ, ax.ACT_EMBED)
  assert sharding.logical_spec(names, sizes, sharding.RULES, (8, 512, 64)) == P(("data", "expert"), None, None)
  assert sharding.logical_spec(names, sizes, sharding.RULES, (2, 512, 64)) == P("data", None, None)
  assert sharding.logical_spec(names, sizes, sharding.RULES_SP, (2, 512, 64)) == P("data", ("expert", "tensor"), None)
  assert sharding.logical_spec(names, sizes, sharding.RULES_SP, (8, 1, 64)) == P(("data", "expert"), None, None)
  assert sharding.logical_spec((ax.EXPERTS, ax.EMBED, ax.EXPERT_MLP), sizes, sharding.RULES) == P(
      ("expert", "tensor"), None, None)


@pytest.mark.quick
def test_mesh_parsing_and_clear_errors():
  assert sharding.parse_mesh("expert=4,tensor=2") == {"data": 1, "expert": 4, "tensor": 2}
  with pytest.raises(ValueError, match="unknown axes"):
    sharding.parse_mesh("model=2")
  with pytest.raises(ValueError, match="axis=size"):
    sharding.parse_mesh("tensor")
  with pytest.raises(sharding.MeshError, match="needs 8 devices"):
    sharding.make_mesh("tensor=8")  # this process has one CPU device
  flat_b16 = m3jax.M3Config.from_file(FIXTURES / "flat_b16" / "checkpoint")  # 4 heads, 2 KV heads, 4 experts
  with pytest.raises(sharding.MeshError, match=r"routed experts .* = 4 is not divisible by expert = 8"):
    sharding.check_config(flat_b16, "expert=8")
  with pytest.raises(sharding.MeshError, match=r"attention heads = 4 is not divisible by tensor = 8"):
    sharding.check_config(flat_b16, "tensor=8")
  with pytest.raises(sharding.MeshError, match=r"KV heads = 2 and tensor = 3"):
    sharding.check_config(m3jax.tiny(), "tensor=3")
  sharding.check_config(flat_b16, "data=2,tensor=4")  # 2 KV heads on 4 ranks: replicated twice


def test_memory_plan_full_m3():
  cfg = m3jax.m3_full()
  one = plan_memory(cfg, "data=1", batch=1, context=4096)
  experts = one.weights["routed experts"]
  assert experts > 0.95 * 2 * 412e9  # bf16 routed experts ~ 824 GB
  for mesh in ("tensor=8", "expert=8", "expert=4,tensor=2"):
    plan = plan_memory(cfg, mesh, batch=8, context=65536)
    assert plan.weights["routed experts"] == experts // 8
    assert plan.weights_per_device < 141e9, plan.lines()  # the bf16 weights fit on 8 H200s (141 GB each)
  assert plan_memory(cfg, "tensor=8", batch=8, context=32768).total_per_device < 125e9  # + room for activations
  tp8 = plan_memory(cfg, "tensor=8", batch=1, context=1024)
  assert tp8.kv_heads_stored == 8 and tp8.cache["kv"] == 2 * 60 * 1024 * 1 * 128 * 2  # one KV head per device
  # the fused projections a decode loop holds: the device's 8 query heads + all 4 KV heads' k and v (replicated) per
  # layer, + the 4 index query heads and the index key on the 57 sparse layers; bf16, hidden 6144
  t = cfg.text
  qkv = (t.num_heads // 8 + 2 * t.num_kv_heads) * t.head_dim
  index = (t.index_num_heads + 1) * t.index_head_dim
  assert tp8.fused_projections == t.hidden_size * 2 * (t.num_layers * qkv + t.num_sparse_layers * index)
  assert any(line.startswith("  decode-loop workspace") for line in tp8.lines())
  assert tp8.split_experts == 0 and tp8.decode_workspace == tp8.fused_projections  # bf16: experts used as they are
  # fp32 weights: the loop also holds the experts' bf16 [hi; lo; hi] split for the MoE kernels (6 bytes per 4);
  # the shared expert only on one device (it runs outside the kernels under expert parallelism).
  tiny = m3jax.tiny()
  one32 = plan_memory(tiny, "data=1", batch=1, context=256, dtype=jnp.float32)
  assert one32.split_experts == int(1.5 * (one32.weights["routed experts"] + one32.weights["shared experts"]))
  ep32 = plan_memory(tiny, "expert=2", batch=1, context=256, dtype=jnp.float32)
  assert ep32.split_experts == int(1.5 * ep32.weights["routed experts"]) > 0
  assert "fp32 experts' bf16 split" in " ".join(ep32.lines())
  fp8 = plan_memory(cfg, "tensor=4", batch=4, context=65536, expert_bytes=FP8_BYTES)
  assert fp8.weights["routed experts"] == pytest.approx(experts / 2 * FP8_BYTES / 4, rel=1e-6)
  assert fp8.total_per_device < 141e9, fp8.lines()
  # The MTP module (speculative decoding): one sparse MoE layer's weights and cache more; its experts split too.
  mtp = plan_memory(cfg, "tensor=8", batch=8, context=32768, with_mtp=True)
  base = plan_memory(cfg, "tensor=8", batch=8, context=32768)
  moe_layers = t.num_layers - 3
  layer = ((base.weights["routed experts"] + base.weights["shared experts"] + base.weights["router"]) / moe_layers
           + base.weights["attention"] / t.num_layers + base.weights["indexer"] / t.num_sparse_layers)
  eh_proj = 2 * t.hidden_size * t.hidden_size * 2  # replicated
  assert mtp.weights["MTP module"] == pytest.approx(layer + eh_proj, rel=1e-3), (mtp.weights, layer + eh_proj)
  assert mtp.weights_per_device - base.weights_per_device == mtp.weights["MTP module"]
  assert mtp.cache["MTP cache"] == base.cache["kv"] // t.num_layers + base.cache["index keys"] // t.num_sparse_layers
  mtp32 = plan_memory(m3jax.tiny(mtp=True), "expert=2", batch=1, context=256, dtype=jnp.float32, with_mtp=True)
  assert mtp32.split_experts == int(1.5 * ep32.weights["routed experts"] * 3 / 2)  # 2 MoE layers + the MTP's


@pytest.mark.quick
def test_memory_plan_that_cannot_fit_fails_naming_the_sizes():
  # One GPU's eighth of full M3 (as bench_full.py --one-shard 8 builds it) is ~113 GB: fits an H200, not an H100.
  plan = plan_memory(m3jax.m3_full(), "tensor=8", batch=4, context=33792)
  assert 100e9 < plan.total_per_device < 141e9
  plan.check_fits(141 * 10**9)
  plan.check_fits(None)  # a backend that does not report its memory (CPU): nothing to check
  with pytest.raises(MemoryError, match=r"60 layers on H100 needs 1\d\d\.\d+ GB per device .* a device has 80"):
    plan.check_fits(80 * 10**9, "60 layers on H100")


def test_inspect_mesh_option(capsys):
  ckpt = str(FIXTURES / "legacy_b128" / "checkpoint")
  assert cli.main(["inspect", ckpt, "--mesh", "expert=4,tensor=2", "--batch", "2", "--context", "1024"]) == 0
  out = capsys.readouterr().out
  assert "per-device plan for mesh data=1,expert=4,tensor=2 (8 devices)" in out and "cache / kv" in out
  assert cli.main(["inspect", str(FIXTURES / "flat_b16" / "checkpoint"), "--mesh", "expert=8"]) == 2
  assert "routed experts" in capsys.readouterr().err


def test_generate_mesh_option_needs_the_devices(capsys):
  ckpt = str(FIXTURES / "legacy_b128" / "checkpoint")
  assert cli.main(["generate", ckpt, "--prompt-ids", "1,2,3", "--mesh", "tensor=8"]) == 2
  assert "needs 8 devices" in capsys.readouterr().err


def test_trivial_mesh_is_the_unsharded_model():
  model = m3jax.load(FIXTURES / "flat_b16" / "checkpoint", kernels="reference")
  ids = jnp.asarray(jax.random.randint(jax.random.key(0), (2, 40), 0, 256), jnp.int32)
  want = model(ids)
  sharded = sharding.shard_model(model, sharding.make_mesh("data=1"))
  assert sharded.sharding_plan.is_trivial
  assert float(jnp.max(jnp.abs(sharded(ids) - want))) == 0.0


# ----------------------------------------------------------------------- 8 simulated devices (subprocess)


@pytest.mark.parametrize("fixture, meshes", [
    ("legacy_b128", MESHES),
    ("flat_local2_b128", ["tensor=8", "data=2,expert=2,tensor=2+sp", "bare:tensor=8", "bare:data=2,tensor=4"]),
    ("flat_b16", ["data=2,tensor=4"]),
])
@pytest.mark.slow
def test_sharded_forward_matches_single_device(fixture, meshes):
  """'bare:' meshes are jax.make_mesh's own (Explicit axis types), lacking some of data / expert / tensor: the
  missing axes count as size 1, for m3jax.load(mesh=) and shard_model alike."""
  result = run_worker("forward", fixture, *meshes)
  for mesh in meshes:
    assert result[mesh]["rel_err"] <= 1e-5, (mesh, result[mesh])
    if not mesh.startswith("bare:"):
      assert result[mesh]["logprob_err"] <= 1e-4, (mesh, result[mesh])
    else:
      assert result[mesh]["shard_model_rel_err"] <= 1e-5, (mesh, result[mesh])
      assert result[mesh]["plan_sizes"]["expert"] == 1, (mesh, result[mesh])
  if fixture == "flat_local2_b128":
    assert result["bare:tensor=8"]["mesh_axes"] == ["tensor"]
    assert result["bare:tensor=8"]["embed_spec"] == "P('tensor', None)"  # vocab over tensor
    assert result["bare:data=2,tensor=4"]["plan_sizes"] == {"data": 2, "expert": 1, "tensor": 4}


def test_fp8_weights_load_into_their_shards():
  """Weights kept in fp8 (#47) on tensor=8 and expert=4 x tensor=2: restored straight into their shards from the
  safetensors fixture and from a convert --keep-quantized copy; logits vs HF's."""
  specs = ["mxfp8_b128:tensor=8", "mxfp8_b128:converted:expert=4,tensor=2", "fp8block_b128:tensor=8"]
  result = run_worker("fp8", *specs)
  for spec in specs:
    r = result[spec]
    assert r["rel_err"] <= 1e-5 and r["laid_out"] and r["values_dtype"] == "float8_e4m3fn", (spec, r)
    want = "P('tensor',)" if spec.endswith(":tensor=8") else "P(('expert', 'tensor'),)"
    assert r["experts_spec"] == [want, want], (spec, r)  # whole experts per device, values and scales alike
    assert r["max_device_fp8_bytes"] < r["fp8_bytes"] / 2, (spec, r)  # split, not replicated


def test_vision_tower_data_parallel_over_images_matches():
  result = run_worker("vision", "data=2,tensor=4", "data=4,expert=2")
  for mesh, r in result.items():
    assert r["rel_err"] <= 1e-5, (mesh, r)


# Plans that also run generate_stream, a Conversation and the Engine: data x tensor (the engine's slots over data
# ranks) and the sequence-parallel plan. All three are host logic over the sharded prefill and decode step that
# every plan runs through generate (one program: the decode loop on weights prepared once) and chunked prefill;
# their own compiles cost about half of a plan's time.
EVERY_PATH_MESHES = ("data=2,tensor=4", "expert=4,tensor=2+sp")


# expert=4,tensor=2 without +sp is left out: its decode steps are the +sp plan's (one token does not divide, so
# RULES_SP falls back to RULES' layout), and its prefill, one-shot and chunked, is test_sharded_forward's.
GENERATE_MESHES = [m for m in MESHES if m != "expert=4,tensor=2"]


@pytest.mark.slow
@pytest.mark.parametrize("meshes", [GENERATE_MESHES[:3], GENERATE_MESHES[3:]])
def test_sharded_greedy_generation_matches(meshes):
  result = run_worker("generate", "legacy_b128", *(f"*{m}" if m in EVERY_PATH_MESHES else m for m in meshes))
  for mesh in meshes:
    paths = ("equal", "chunked_equal") + (
        ("stream_equal", "conversation_equal", "engine_equal") if mesh in EVERY_PATH_MESHES else ())
    assert all(result[mesh][k] for k in paths), (mesh, result[mesh])
    assert ("stream_equal" in result[mesh]) == ("engine_equal" in result[mesh]) == (mesh in EVERY_PATH_MESHES), (
        result[mesh])
  if "tensor=8" in meshes:  # 2 KV heads over 8 ranks: replicated 4x, one head per device
    assert result["tensor=8"]["cache_k"] == [[4, 256, 8, 32], "P(None, None, 'tensor', None)"]


def test_pallas_without_gpu_on_a_multi_device_mesh_takes_the_reference_by_rule():
  # The Mosaic GPU interpreter simulates one GPU per process; several CPU devices' kernels would trip it.
  result = run_worker("pallas_on_cpu_mesh", "data=2,expert=2", devices=4)
  assert result["max_abs_diff"] == 0.0
  assert any("cannot run kernels on several devices" in m and "routed_experts" in m for m in result["messages"])


@pytest.mark.quick
def test_fused_projection_runs_per_device_or_falls_back():
  """q / k / v as one GEMM: per device under shard_map (query heads split, KV heads replicated), equal to one
  GEMM per weight; a rule that splits the hidden axis takes one GEMM per weight instead (no concatenation)."""
  meshes = ["tensor=8", "data=2,tensor=4", "expert=4,tensor=2+sp", "tensor=8+embed"]
  result = run_worker("fused_projection", *meshes)
  for mesh in meshes:
    assert result[mesh]["max_rel"] < 1e-5, (mesh, result[mesh])
    fused = not mesh.endswith("+embed")
    assert result[mesh]["shard_map"] == fused and result[mesh]["concatenate"] == fused, (mesh, result[mesh])
  assert result["tensor=8"]["q_sharding"] == "P(None, None, 'tensor')"


def test_fp32_expert_operands_are_prepared_per_device_in_the_expert_layout():
  """An fp32 decode loop's expert operands (bf16 hi / lo split, m3jax.parallel.moe.prepare_routed) are built per
  device, sharded like the experts, equal to the single-device split; on CPU meshes, where the kernels cannot
  run, prepare_experts builds nothing (by rule)."""
  meshes = ["expert=8", "tensor=8", "expert=4,tensor=2"]
  result = run_worker("prepared_experts", *meshes)
  for mesh in meshes:
    assert result[mesh]["equal"] and result[mesh]["shapes"] == [[8, 192, 96], [8, 144, 64]], (mesh, result[mesh])
    assert result[mesh]["devices_per_shard"] == 8 and not result[mesh]["prepared_on_cpu_mesh"], (mesh, result[mesh])
  assert result["expert=8"]["gate_up_spec"] == "P('expert', None, None)"
  assert result["expert=4,tensor=2"]["gate_up_spec"] == "P(('expert', 'tensor'), None, None)"


@pytest.mark.slow
def test_sharded_steps_lower_to_mosaic_gpu_kernels_on_every_mesh():
  """The 8-GPU programs (real M3 dims, 4 layers) lowered for CUDA on 8 CPU devices: in a decode step and a
  prefill every attention, indexer and MoE op runs its Mosaic GPU kernel inside shard_map on each mesh. The
  prefill (8 x 1000 tokens) is long enough for the warp-specialized sparse kernel, so its program also holds
  the KV-major one, which it runs instead on selections adjacent queries do not share (prefers_kv_major)."""
  result = run_worker("cuda_lowering", *MESHES)
  for mesh in MESHES:
    assert result[mesh]["decode"] == {"attention": 2, "indexer": 1, "moe": 2}, (mesh, result[mesh]["decode"])
    assert result[mesh]["prefill"] == {"attention": 2, "attention_kv_major": 1, "indexer": 1, "moe": 2}, (
        mesh, result[mesh]["prefill"])


def test_per_device_parameter_bytes_match_the_plan():
  meshes = ["tensor=8", "expert=8", "expert=4,tensor=2", "data=2,tensor=4"]
  result = run_worker("bytes", "legacy_b128", *meshes)
  for mesh in meshes:
    r = result[mesh]
    assert r["per_device"] == [r["plan"]], (mesh, r)  # every device holds what the plan says
    sizes = sharding.parse_mesh(mesh)  # experts split over expert x tensor, replicated over data
    assert r["expert_gate_up_per_device"] == [r["expert_gate_up_total"] // (sizes["expert"] * sizes["tensor"])]
    # the loader counts the same bytes before reading, and refuses a load that cannot fit, naming the sizes
    assert r["fit_predicted"] == r["per_device"] and r["fit_devices"] == 8, (mesh, r)
    assert "checkpoint: the weights alone need" in r["fit_refused"] and "but it has" in r["fit_refused"], r


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_reproduce_single_process_logits():
  port = str(_free_port())
  env = {**os.environ, "PYTHONPATH": str(REPO), "M3JAX_TEST_DEVICES": "2"}
  procs = [subprocess.Popen([sys.executable, str(WORKER), "distributed", "legacy_b128", "expert=2,tensor=2", port,
                             str(i), "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
           for i in range(2)]
  results = []
  for p in procs:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    results.append(json.loads(out.strip().splitlines()[-1]))
  assert sorted(r["process"] for r in results) == [0, 1]
  for r in results:
    assert r["processes"] == 2 and r["devices"] == 4
    assert r["rel_err"] <= 1e-5 and r["tokens_equal"], r


@pytest.mark.slow
def test_sharded_speculative_decoding_matches_one_device():
  """MTP weights restored into their shards (the module's layer split like a decoder layer) and speculative
  decoding (one program) under tensor, expert, data x tensor and sequence-parallel plans: same tokens, drafts
  and acceptance. Streamed too on the data x tensor and sequence-parallel plans (the stream runs the one
  program's start and round functions in calls of 2 rounds: host logic over the same sharded code, as
  EVERY_PATH_MESHES for generate)."""
  meshes = ["tensor=8", "expert=8", "data=2,tensor=4", "expert=4,tensor=2+sp"]
  result = run_worker("speculative", *(f"*{m}" if m in EVERY_PATH_MESHES else m for m in meshes))
  assert 0.2 < result["acceptance"] < 0.95, result["acceptance"]
  for mesh in meshes:
    paths = ("tokens_equal", "drafts_equal") + (("stream_equal",) if mesh in EVERY_PATH_MESHES else ())
    assert all(result[mesh][k] for k in paths), (mesh, result[mesh])
    assert ("stream_equal" in result[mesh]) == (mesh in EVERY_PATH_MESHES), result[mesh]
  assert "tensor" in result["tensor=8"]["mtp_q_proj_spec"], result["tensor=8"]
