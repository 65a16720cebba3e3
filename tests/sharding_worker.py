"""Sharding checks on simulated CPU devices, run in a subprocess by tests/test_sharding.py (the device count
must be set before jax is imported). Prints one JSON object on the last stdout line.

  python tests/sharding_worker.py forward FIXTURE MESH[+sp] ...   sharded vs single-device logits
  python tests/sharding_worker.py generate FIXTURE [*]MESH[+sp] ... sharded greedy tokens vs the fixture's
  python tests/sharding_worker.py bytes FIXTURE MESH ...           per-device parameter bytes vs the plan
  python tests/sharding_worker.py distributed FIXTURE MESH PORT PROCESS_ID NUM_PROCESSES
  python tests/sharding_worker.py pallas_on_cpu_mesh MESH           kernels='pallas' on CPU devices: by rule
  python tests/sharding_worker.py cuda_lowering MESH ...            Mosaic GPU kernels per lowered step
  python tests/sharding_worker.py fused_projection MESH[+sp] ...    fused q/k/v GEMM vs one GEMM per weight
  python tests/sharding_worker.py prepared_experts MESH ...         fp32 experts' kernel operands per device
  python tests/sharding_worker.py speculative [*]MESH[+sp] ...      MTP speculative decoding vs one device
  python tests/sharding_worker.py fp8 FIXTURE:[converted:]MESH ...     weights kept in fp8, sharded: HF logits

MESH is 'expert=4,tensor=2'; a '+sp' suffix uses the sequence-parallel rules (RULES_SP). For generate, a '*'
prefix also runs generate_stream, a Conversation and the Engine on that mesh (host logic over the same sharded
steps; their own compiles cost about half of a mesh's time, so the test runs them on two plans, not all five); for
speculative, the stream (the same start and round functions as generate_speculative's one program, in calls of
2 rounds: host logic and two more compiles per mesh, so the test streams on two of its four plans).
Environment: M3JAX_TEST_DEVICES (default 8) local CPU devices.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                           + os.environ.get("M3JAX_TEST_DEVICES", "8"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def _mesh_and_rules(arg: str):
  """'expert=4,tensor=2[+sp]' -> (m3jax.sharding.make_mesh's mesh, rules). A 'bare:' prefix builds the mesh with
  jax.make_mesh instead: only the named axes (the others are missing) and jax's default axis types."""
  from m3jax import sharding  # pylint: disable=g-import-not-at-top

  sp = arg.endswith("+sp")
  spec = arg.removesuffix("+sp")
  if spec.startswith("bare:"):
    sizes = {name: int(size) for name, size in (part.split("=") for part in spec.removeprefix("bare:").split(","))}
    mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes))
  else:
    mesh = sharding.make_mesh(spec)
  return mesh, (sharding.RULES_SP if sp else sharding.RULES)


def _load(fixture: str, mesh_arg: str | None):
  import m3jax  # pylint: disable=g-import-not-at-top

  path = FIXTURES / fixture / "checkpoint"
  if mesh_arg is None:
    return m3jax.load(path, kernels="reference")
  mesh, rules = _mesh_and_rules(mesh_arg)
  return m3jax.load(path, kernels="reference", mesh=mesh, axis_rules=rules)


def _rel(got: np.ndarray, want: np.ndarray) -> float:
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def forward(fixture: str, *meshes: str) -> dict:
  from m3jax.scoring import token_logprobs  # pylint: disable=g-import-not-at-top

  ids = np.load(FIXTURES / fixture / "reference.npz")["input_ids"]
  single = _load(fixture, None)
  want = np.asarray(single(ids))
  want_lp = token_logprobs(single, ids).logprobs
  out = {}
  for mesh in meshes:
    start = time.perf_counter()
    model = _load(fixture, mesh)
    got = np.asarray(model(ids))
    out[mesh] = {"rel_err": _rel(got, want)}
    if not mesh.startswith("bare:"):
      # Scoring in chunks of 64 under the plan (a lax.scan with the caches in its carry) against one shot
      # unsharded. (A 'bare:' mesh lays out the same arrays as make_mesh's mesh of those sizes: its forward and
      # shard_model below are what is new, not another compile of the scoring program.)
      got_lp = token_logprobs(model, ids, prefill_chunk=64).logprobs
      out[mesh]["logprob_err"] = float(np.abs(got_lp - want_lp).max())
    else:  # a mesh lacking axes also lays out an in-memory model (shard_model)
      from m3jax import sharding  # pylint: disable=g-import-not-at-top

      bare_mesh, rules = _mesh_and_rules(mesh)
      moved = sharding.shard_model(_load(fixture, None), bare_mesh, rules)
      out[mesh].update(shard_model_rel_err=_rel(np.asarray(moved(ids)), want),
                       mesh_axes=list(bare_mesh.axis_names), plan_sizes=moved.sharding_plan.sizes,
                       embed_spec=str(model.embed[...].sharding.spec))
    out[mesh]["seconds"] = time.perf_counter() - start
  return out


def vision(*meshes: str) -> dict:
  """VL fixture (3 images + a video): multimodal logits on a mesh vs one device."""
  import m3jax  # pylint: disable=g-import-not-at-top

  ref = np.load(FIXTURES / "vl_tiny" / "reference.npz")
  pixels = {k: ref[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
  path = FIXTURES / "vl_tiny" / "checkpoint"
  want = np.asarray(m3jax.load(path, kernels="reference")(ref["input_ids"], **pixels))
  out = {}
  for mesh in meshes:
    m, rules = _mesh_and_rules(mesh)
    model = m3jax.load(path, kernels="reference", mesh=m, axis_rules=rules)
    out[mesh] = {"rel_err": _rel(np.asarray(model(ref["input_ids"], **pixels)), want)}
  return out


def _prompts(fixture: str):
  ref = np.load(FIXTURES / fixture / "reference.npz")
  return [ref["input_ids"][b, : ref["gen_prompt_lens"][b]].tolist() for b in range(2)], ref["gen_tokens"]


def generate(fixture: str, *meshes: str) -> dict:
  from m3jax.conversation import Conversation  # pylint: disable=g-import-not-at-top
  from m3jax.engine import Engine  # pylint: disable=g-import-not-at-top
  from m3jax.generate import generate as gen, generate_stream  # pylint: disable=g-import-not-at-top

  prompts, want = _prompts(fixture)
  # Four rows (each prompt twice) so a batch can split over data x expert; each row must match its prompt.
  prompts, want = prompts + prompts[::-1], np.concatenate([want, want[::-1]])
  # The conversation's turn 2 (turn 1's prompt and reply, then 20 more ids) on one device: what every plan that
  # runs the Conversation must give.
  prompt2 = prompts[0] + want[0].tolist() + prompts[1][:20]
  want_turn2 = (gen(_load(fixture, None), [prompt2], max_new_tokens=8, eos_token_ids=()).tokens[0]
                if any(spec.startswith("*") for spec in meshes) else None)  # only the Conversation path reads it
  out = {}
  for spec in meshes:
    mesh, every_path = spec.removeprefix("*"), spec.startswith("*")
    start = time.perf_counter()
    model = _load(fixture, mesh)
    tokens = gen(model, prompts, max_new_tokens=want.shape[1], eos_token_ids=()).tokens
    # Chunked prefill: a lax.scan over 64-token chunks of the (sequence-parallel) prompt, caches in its carry.
    chunked = gen(model, prompts, max_new_tokens=want.shape[1], eos_token_ids=(), prefill_chunk=64).tokens
    caches = model.init_caches(len(prompts), 256)
    out[mesh] = {"equal": bool((tokens == want).all()), "mismatches": int((tokens != want).sum()),
                 "chunked_equal": bool((chunked == want).all()),
                 "cache_k": [list(caches[0].k.shape), str(caches[0].k.sharding.spec)]}
    if every_path:
      # generate_stream: a Decoder's pre-fused projection weights (sharded per device) passed into its steps
      # (generate's loop runs the same decode step on the same prepared weights, inside one program).
      streamed = np.stack(list(generate_stream(model, prompts, max_new_tokens=want.shape[1], eos_token_ids=(),
                                               steps_per_call=3)), axis=1)
      out[mesh]["stream_equal"] = bool((streamed == want).all())
      # A Conversation (batch 1): turn 2 continues turn 1's caches and must reply as one device's generate on the
      # whole text.
      conv = Conversation(model, max_length=512, eos_token_ids=(), steps_per_call=3)
      turn1 = np.concatenate(list(conv.reply(prompts[0], max_new_tokens=want.shape[1])))
      turn2 = np.concatenate(list(conv.reply(prompt2, max_new_tokens=8)))
      out[mesh]["conversation_equal"] = bool(
          np.array_equal(turn1, want[0]) and conv.last_turn.reused == len(prompts[0]) + len(turn1)
          and np.array_equal(turn2, want_turn2))
      # Continuous batching: 2 slots (one per data rank at data=2) refilled with the 4 requests.
      engine = Engine(model, slots=2, max_length=384, eos_token_ids=(), steps_per_call=3)
      for i, p in enumerate(prompts):
        engine.submit(p, max_new_tokens=want.shape[1], request_id=i)
      served = {c.request_id: c.tokens for c in engine.run()}
      out[mesh]["engine_equal"] = all(np.array_equal(served[i], want[i]) for i in range(len(prompts)))
    out[mesh]["seconds"] = time.perf_counter() - start
  return out


def param_bytes(fixture: str, *meshes: str) -> dict:
  from m3jax import sharding  # pylint: disable=g-import-not-at-top
  from m3jax.parallel.memory import plan_memory  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  out = {}
  for mesh_arg in meshes:
    model = _load(fixture, mesh_arg)
    state = nnx.state(model)
    per_device = sharding.per_device_bytes(state)
    experts = sharding.per_device_bytes([l.mlp.w_gate_up.get_value() for l in model.layers if hasattr(l.mlp, "router")])
    plan = plan_memory(model.config, mesh_arg, batch=1, context=128, dtype=model.dtype)
    out[mesh_arg] = {"per_device": sorted(set(per_device.values())),
                     "plan": plan.weights_per_device, "plan_experts": plan.weights.get("routed experts", 0),
                     "total": sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state)),
                     "expert_gate_up_per_device": sorted(set(experts.values())),
                     "expert_gate_up_total": sum(int(np.prod(l.mlp.w_gate_up.shape)) * 4
                                                 for l in model.layers if hasattr(l.mlp, "router")),
                     **_fit_check(fixture, mesh_arg, model)}
  return out


def _fit_check(fixture: str, mesh_arg: str, model) -> dict:
  """The loader's up-front weight count per device (m3jax.checkpoint.fit) for this mesh, and whether a load is
  refused when each device reports one byte less than that."""
  from m3jax.checkpoint import fit, loader  # pylint: disable=g-import-not-at-top
  from m3jax.checkpoint import sharding as ckpt_sharding  # pylint: disable=g-import-not-at-top
  from m3jax.checkpoint.safetensors_dir import CheckpointError  # pylint: disable=g-import-not-at-top

  mesh, rules = _mesh_and_rules(mesh_arg)
  _, flat = loader.abstract_model(model.config, model.dtype, "reference")
  predicted = fit.weights_per_device(flat, ckpt_sharding.placement_fn(ckpt_sharding.resolve(flat, mesh=mesh,
                                                                                           axis_rules=rules)))
  need = max(predicted.values())
  real_limit, refused = fit.device_limit, ""
  try:
    fit.device_limit = lambda device: need - 1
    try:
      _load(fixture, mesh_arg)
    except CheckpointError as e:
      refused = str(e)
    fit.device_limit = lambda device: need
    _load(fixture, mesh_arg)  # exactly enough: loads
  finally:
    fit.device_limit = real_limit
  return {"fit_predicted": sorted(set(predicted.values())), "fit_devices": len(predicted), "fit_refused": refused}


def distributed(fixture: str, mesh_arg: str, port: str, process_id: str, num_processes: str) -> dict:
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=int(num_processes),
                             process_id=int(process_id))
  from m3jax.generate import generate as gen  # pylint: disable=g-import-not-at-top

  ids = np.load(FIXTURES / fixture / "reference.npz")["input_ids"][:, :256]
  local = jax.local_devices()[0]
  with jax.default_device(local):
    want = np.asarray(_load(fixture, None)(ids))
  model = _load(fixture, mesh_arg)
  got = np.asarray(multihost_utils.process_allgather(model(ids), tiled=True))
  prompts, want_tokens = _prompts(fixture)
  tokens = gen(model, prompts, max_new_tokens=8, eos_token_ids=()).tokens
  return {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
          "rel_err": _rel(got, want), "tokens_equal": bool((tokens == want_tokens[:, :8]).all())}


def pallas_on_cpu_mesh(mesh_arg: str) -> dict:
  """kernels='pallas' without a GPU under a multi-device plan: the expert-parallel MoE block at dims the
  kernel tiles must take the reference by rule (the GPU interpreter cannot run several devices' kernels)."""
  import logging  # pylint: disable=g-import-not-at-top

  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from m3jax import sharding  # pylint: disable=g-import-not-at-top
  from m3jax.parallel import moe as parallel_moe  # pylint: disable=g-import-not-at-top

  messages: list[str] = []

  class Collect(logging.Handler):
    def emit(self, record):
      messages.append(record.getMessage())

  logging.getLogger("m3jax.ops").addHandler(Collect())
  h, i, e = 256, 128, 8
  keys = jax.random.split(jax.random.key(0), 7)
  nrm = lambda key, shape, sc: (jax.random.normal(key, shape, jnp.float32) * sc)
  x = nrm(keys[0], (4, 10, h), 1.0).astype(jnp.bfloat16)
  ws = (nrm(keys[1], (h, e), h ** -0.5), nrm(keys[2], (e,), 0.1),
        *(nrm(kk, shape, 0.05).astype(jnp.bfloat16) for kk, shape in
          zip(keys[3:], [(e, h, 2 * i), (e, i, h), (h, 2 * i), (i, h)])))
  kw = dict(top_k=2, routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0)
  mesh, rules = _mesh_and_rules(mesh_arg)
  plan = sharding.ShardingPlan(mesh, rules)
  out = {}
  with sharding.use_plan(plan):
    for kernels in ("pallas", "reference"):
      fn = jax.jit(lambda x, *w, kernels=kernels: parallel_moe.moe_block(plan, x, *w, **kw, kernels=kernels))
      out[kernels] = np.asarray(fn(x, *ws).astype(jnp.float32))
  return {"max_abs_diff": float(np.abs(out["pallas"] - out["reference"]).max()), "messages": messages}


def cuda_lowering(*mesh_args: str) -> dict:
  """Per mesh: the Mosaic GPU kernels (by kind) of a decode step and a prefill of a real-dims M3 (1 dense + 3
  sparse MoE layers, parameters and caches as sharded abstract arrays) with kernels='pallas', lowered for CUDA
  as on 8 GPUs: each op runs its kernel inside shard_map at per-device shapes, none falls back."""
  import dataclasses  # pylint: disable=g-import-not-at-top

  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  sys.path.insert(0, str(pathlib.Path(__file__).parent / "kernels"))
  from kernel_modes import lowered_step_kernels  # pylint: disable=g-import-not-at-top
  from m3jax import sharding  # pylint: disable=g-import-not-at-top
  from m3jax.config import M3Config, m3_full  # pylint: disable=g-import-not-at-top
  from m3jax.model import M3ForCausalLM  # pylint: disable=g-import-not-at-top
  from m3jax.ops import dispatch  # pylint: disable=g-import-not-at-top

  dispatch._on_gpu = lambda: True  # compiled kernels, as on GPUs (this process only lowers, never runs them)
  cfg = M3Config(text=dataclasses.replace(m3_full().text, num_layers=4, attention_types=("full",) + ("sparse",) * 3,
                                          mlp_types=("dense",) + ("moe",) * 3))
  out = {}
  for mesh_arg in mesh_args:
    mesh, rules = _mesh_and_rules(mesh_arg)
    plan = sharding.ShardingPlan(mesh, rules)
    model = nnx.eval_shape(lambda: M3ForCausalLM(cfg, dtype=jnp.bfloat16, kernels="pallas"))
    for _, var in nnx.to_flat_state(nnx.state(model)):
      var.set_value(jax.ShapeDtypeStruct(var.shape, var.dtype,
                                         sharding=plan.sharding(sharding.logical_axes_of(var), var.shape)))
    model.sharding_plan = plan
    steps = lowered_step_kernels(model, decode_batch=8, prefill_batch=8)
    out[mesh_arg] = {step: dict(kinds) for step, kinds in steps.items()}
  return out


def fused_projection(*mesh_args: str) -> dict:
  """m3jax.parallel.projection.fused_projection under each plan (MESH+embed: a rule that splits the hidden axis,
  which must fall back to one GEMM per weight) against per-weight projections on one device."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from m3jax import logical_axes as ax  # pylint: disable=g-import-not-at-top
  from m3jax import sharding  # pylint: disable=g-import-not-at-top
  from m3jax.layers.params import project  # pylint: disable=g-import-not-at-top
  from m3jax.parallel.projection import fused_projection as fused  # pylint: disable=g-import-not-at-top

  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (4, 16, 64), jnp.float32)
  weights = [jax.random.normal(k, (64, n, 32), jnp.float32) for k, n in zip(keys[1:], (8, 2, 1))]
  axes = [(ax.EMBED, ax.Q_HEADS, ax.HEAD_DIM), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM), (ax.EMBED, None, ax.IDX_DIM)]
  want = [np.asarray(project("bsh,hnd->bsnd", x, w)) for w in weights]
  out = {}
  for arg in mesh_args:
    split_embed = arg.endswith("+embed")
    mesh, rules = _mesh_and_rules(arg.removesuffix("+embed"))
    if split_embed:
      rules = sharding.replace_rules(rules, **{ax.EMBED: "tensor", ax.ACT_EMBED: "tensor"})
    plan = sharding.ShardingPlan(mesh, rules)
    xs = jax.device_put(x, plan.sharding((ax.ACT_BATCH, ax.ACT_Q_SEQ, ax.ACT_EMBED), x.shape))
    ws = [jax.device_put(w, plan.sharding(names, w.shape)) for w, names in zip(weights, axes)]
    with sharding.use_plan(plan):
      got = jax.jit(lambda x, ws: fused(x, ws, axes))(xs, ws)
      jaxpr = str(jax.make_jaxpr(lambda x, ws: fused(x, ws, axes))(xs, ws))
    out[arg] = {"max_rel": max(_rel(np.asarray(g), w) for g, w in zip(got, want)),
                "shard_map": "shard_map" in jaxpr, "concatenate": "concatenate" in jaxpr,
                "q_sharding": str(got[0].sharding.spec)}
  return out


def prepared_experts(*mesh_args: str) -> dict:
  """m3jax.parallel.moe.prepare_routed (fp32 experts' kernel operands, built per device) under each plan against
  pallas_kernels.moe.prepare_expert_weights on one device; and m3jax.ops.moe.prepare_experts' rule on CPU meshes
  (the interpreter cannot run kernels there, so nothing is prepared)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from m3jax import logical_axes as ax  # pylint: disable=g-import-not-at-top
  from m3jax import sharding  # pylint: disable=g-import-not-at-top
  from m3jax.ops.moe import prepare_experts  # pylint: disable=g-import-not-at-top
  from m3jax.parallel.moe import prepare_routed  # pylint: disable=g-import-not-at-top
  from pallas_kernels.moe import prepare_expert_weights  # pylint: disable=g-import-not-at-top

  keys = jax.random.split(jax.random.key(0), 2)
  w_gu = jax.random.normal(keys[0], (8, 64, 96), jnp.float32)
  w_dn = jax.random.normal(keys[1], (8, 48, 64), jnp.float32)
  want = prepare_expert_weights(jnp.float32, w_gu, w_dn)
  out = {}
  for arg in mesh_args:
    mesh, rules = _mesh_and_rules(arg)
    plan = sharding.ShardingPlan(mesh, rules)
    gu = jax.device_put(w_gu, plan.sharding((ax.EXPERTS, ax.EMBED, ax.EXPERT_MLP), w_gu.shape))
    dn = jax.device_put(w_dn, plan.sharding((ax.EXPERTS, ax.EXPERT_MLP, ax.EMBED), w_dn.shape))
    with sharding.use_plan(plan):
      got = jax.jit(lambda a, b: prepare_routed(plan, a, b))(gu, dn)
      by_rule = prepare_experts(gu, dn, w_gu[0], w_dn[0], kernels="pallas")
    out[arg] = {"equal": bool(np.array_equal(np.asarray(got.gate_up, np.float32),
                                             np.asarray(want.gate_up, np.float32))
                              and np.array_equal(np.asarray(got.down, np.float32), np.asarray(want.down, np.float32))),
                "gate_up_spec": str(got.gate_up.sharding.spec), "shapes": [list(got.gate_up.shape),
                                                                            list(got.down.shape)],
                "devices_per_shard": len(got.gate_up.addressable_shards), "prepared_on_cpu_mesh": by_rule is not None}
  return out


def speculative(*mesh_args: str) -> dict:
  """The MTP module loaded sharded (with_mtp) and ``generate_speculative`` (and its stream) under each plan:
  tokens, drafts and acceptance counts against one device, with a drafter whose drafts are partly accepted (test_speculative)."""
  import tempfile  # pylint: disable=g-import-not-at-top
  import m3jax  # pylint: disable=g-import-not-at-top
  from m3jax.checkpoint.writer import write_checkpoint  # pylint: disable=g-import-not-at-top
  from m3jax.speculative import generate_speculative, generate_speculative_stream  # pylint: disable=g-import-not-at-top
  from test_speculative import PROMPTS, _drafting_model  # pylint: disable=g-import-not-at-top

  path = pathlib.Path(tempfile.mkdtemp()) / "ckpt"
  write_checkpoint(_drafting_model(0.1, mtp_layer_scale=0.5), path)
  prompts = PROMPTS + PROMPTS[:1]  # 4 rows: a batch that splits over data x expert

  def run(model):
    return generate_speculative(model, prompts, max_new_tokens=16, num_draft_tokens=2, eos_token_ids=())

  want = run(m3jax.load(path, kernels="reference", with_mtp=True))
  out = {"acceptance": want.acceptance_rate}
  for spec in mesh_args:
    arg, streams = spec.removeprefix("*"), spec.startswith("*")
    mesh, rules = _mesh_and_rules(arg)
    model = m3jax.load(path, kernels="reference", with_mtp=True, mesh=mesh, axis_rules=rules)
    got = run(model)
    out[arg] = {"tokens_equal": bool(np.array_equal(got.tokens, want.tokens)),
                "drafts_equal": bool(np.array_equal(got.drafts, want.drafts)
                                     and np.array_equal(got.accepted_drafts, want.accepted_drafts)),
                "eh_proj_spec": str(model.mtp[0].eh_proj[...].sharding.spec),
                "mtp_q_proj_spec": str(model.mtp[0].layer.attn.q_proj[...].sharding.spec)}
    if streams:  # the stream: the same _start and speculative_round as one program, split over calls
      chunks = list(generate_speculative_stream(model, prompts, max_new_tokens=16, num_draft_tokens=2,
                                                eos_token_ids=(), rounds_per_call=2))
      streamed = [np.concatenate([c[b] for c in chunks]) for b in range(len(prompts))]
      out[arg]["stream_equal"] = all(np.array_equal(s, want.tokens[b]) for b, s in enumerate(streamed))
  return out


def fp8(*specs: str) -> dict:
  """An fp8 fixture (tests/test_fp8_weights.py) loaded with keep_quantized=True straight into the shards of a mesh
  (from its safetensors, or with 'converted:' from an ``m3jax convert --keep-quantized`` copy): logits at the
  fixture's positions vs HF, and every fp8 values / scales array laid out as m3jax.sharding.param_spec says."""
  import tempfile  # pylint: disable=g-import-not-at-top

  import m3jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from m3jax import sharding  # pylint: disable=g-import-not-at-top
  from m3jax.checkpoint.convert import convert  # pylint: disable=g-import-not-at-top

  out, converted = {}, {}
  with tempfile.TemporaryDirectory() as tmp:
    for spec in specs:
      fixture, *via, mesh_arg = spec.split(":")
      path = FIXTURES / fixture / "checkpoint"
      if via == ["converted"]:
        if fixture not in converted:
          converted[fixture] = convert(path, pathlib.Path(tmp) / fixture, keep_quantized=True, progress=False).dst
        path = converted[fixture]
      ref = np.load(FIXTURES / fixture / "reference.npz")
      mesh, rules = _mesh_and_rules(mesh_arg)
      model = m3jax.load(path, kernels="reference", mesh=mesh, axis_rules=rules, keep_quantized=True)
      logits = np.asarray(model(ref["input_ids"]))[:, ref["logit_positions"]]
      plan = model.sharding_plan
      fp8_vars = [(p, v) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param)) if p[-1] in ("values", "scales")]
      laid_out = all(v.get_value().sharding.is_equivalent_to(
          jax.sharding.NamedSharding(plan.mesh, sharding.param_spec(v, plan)), v.get_value().ndim)
          for _, v in fp8_vars)
      experts = {p[-1]: v.get_value() for p, v in fp8_vars if p[:2] == ("layers", 1) and p[-2] == "w_gate_up"}
      held = sharding.per_device_bytes([v.get_value() for _, v in fp8_vars])
      out[spec] = {"rel_err": _rel(logits, ref["logits"]), "laid_out": laid_out, "fp8_leaves": len(fp8_vars),
                   "values_dtype": str(experts["values"].dtype),
                   "experts_spec": [str(experts[k].sharding.spec) for k in ("values", "scales")],
                   "max_device_fp8_bytes": max(held.values()),
                   "fp8_bytes": int(sum(v.get_value().nbytes for _, v in fp8_vars))}
  return out


def main(argv: list[str]) -> None:
  commands = {"forward": forward, "generate": generate, "bytes": param_bytes, "distributed": distributed,
              "vision": vision,
              "pallas_on_cpu_mesh": pallas_on_cpu_mesh, "cuda_lowering": cuda_lowering,
              "fused_projection": fused_projection, "prepared_experts": prepared_experts,
              "speculative": speculative, "fp8": fp8}
  result = commands[argv[0]](*argv[1:])
  print(json.dumps(result))


if __name__ == "__main__":
  main(sys.argv[1:])
