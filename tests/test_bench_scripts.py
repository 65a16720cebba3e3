"""The GPU benchmark scripts run end to end on the CPU in their small modes (tiny dims, kernels in the Mosaic GPU
interpreter), so a broken script is caught here and not after a device machine has started. Each test checks the
script's JSON: every measurement present and the built-in correctness checks within bf16 / fp32 tolerances."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = pathlib.Path(__file__).parent.parent
# Its sitecustomize gives the scripts' interpret mode the faster callbacks the in-process tests have (conftest).
INTERPRET_SITE = pathlib.Path(__file__).parent / "interpret_site"


def run_script(*args: str, env: dict | None = None, timeout: int = 600) -> str:
  full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(INTERPRET_SITE)]), "JAX_PLATFORMS": "cpu",
              **(env or {})}
  proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, env=full_env,
                        timeout=timeout, check=False)
  assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
  return proc.stdout


def test_scripts_run_with_the_faster_interpret_callbacks():
  """run_script's subprocesses get tests/fast_interpret_callbacks.py installed (tests/interpret_site)."""
  out = run_script("-c", "from jax._src import callback; print(callback.io_callback_impl.__module__)")
  want = "jax._src.callback" if os.environ.get("M3JAX_TEST_FAST_INTERPRET") == "0" else "fast_interpret_callbacks"
  assert out.strip().splitlines()[-1] == want, out


@pytest.mark.slow
def test_bench_generate_smoke(tmp_path):
  out = tmp_path / "gen.json"
  run_script("scripts/bench_generate.py", "--smoke", "--kernels", "reference,pallas", "--prefill-lengths", "64",
             "--decode-batches", "1", "--repeats", "1", "--check-length", "640", "--out", str(out))
  r = json.loads(out.read_text())
  assert "failures" not in r, r["failures"]
  for kernels in ("reference", "pallas"):
    run = r["runs"][kernels]
    assert run["prefill_64"]["ms"] > 0
    assert run["decode_b1"]["ms"] > 0 and run["decode_b1"]["pipelined_ms"] > 0
  check = r["logits_check_vs_reference"]["pallas"]
  assert check["all"]["tokens"] == 640  # two 512-token chunks through the caches
  assert check["same_choices"]["tokens"] + check["flipped"]["tokens"] == 640
  assert check["all"]["max"] <= 1e-4  # smoke dims run in fp32 (the kernels fall back by rule)


@pytest.mark.slow
def test_bench_moe_tiny(tmp_path):
  out = tmp_path / "moe.json"
  run_script("scripts/bench_moe.py", "--tiny", "--no-edge", "--fp32-check", "--decode", "1", "--prefill", "256",
             "--reps", "1", "--reference-max-t", "256", "--out", str(out))
  r = json.loads(out.read_text())
  for name, (rel, _) in r["edge"].items():
    assert name.startswith("fp32") and rel < 1e-4, (name, rel)
  decode, prefill = r["decode"][0], r["prefill"][0]
  assert decode["touched_experts"] == 4 and decode["check_rel_err,max_abs"][0] < 1e-2
  assert prefill["check_rel_err,max_abs"][0] < 1e-2
  for key in ("kernel_ms", "reference_ms", "gu_kernel_ms", "gu_ragged_dot_mgpu(128, 128, 64, 4, 8)_ms"):
    assert isinstance(prefill[key], float), (key, prefill[key])


@pytest.mark.slow
def test_bench_fp32_decode_smoke(tmp_path):
  out = tmp_path / "fp32.json"
  run_script("scripts/bench_fp32_decode.py", "--smoke", "--tokens", "3", "--out", str(out))
  r = json.loads(out.read_text())
  block, loop = r["block"][0], r["loop"]
  assert block["bit_equal"] and block["rel_l2_vs_reference"] < 1e-4 and block["touched_experts"] >= 2
  assert block["per_call_ms"] > 0 and block["prepared_ms"] > 0 and block["prepared_read_gb"] > 0
  assert loop["same_tokens"] and loop["per_step_ms"] > 0 and loop["prepared_ms"] > 0
  assert loop["prepared_expert_operands_gb"] == pytest.approx(1.5 * 4 * (8 * 3 + 3) * 256 * 128 / 1e9)


@pytest.mark.slow
def test_bench_moe_tiny_narrow_experts_and_decode_tiles(tmp_path):
  """--expert-width (a tensor-parallel slice) and --decode-tiles rows: each variant checked against the reference."""
  out = tmp_path / "moe.json"
  run_script("scripts/bench_moe.py", "--tiny", "--no-edge", "--decode", "2", "--prefill", "", "--reps", "1",
             "--expert-width", "64", "--decode-tiles", "64/128/3", "--out", str(out))
  r = json.loads(out.read_text())
  assert r["dims"]["I"] == r["dims"]["IS"] == 64
  heuristic, variant = r["decode"]
  assert heuristic["tiles"] == "heuristic" and variant["tiles"] == "bn64/128 st3"
  for row in (heuristic, variant):
    assert row["check_rel_err,max_abs"][0] < 1e-2 and isinstance(row["kernel_ms"], float), row


@pytest.mark.slow
def test_bench_attention_interpret(tmp_path):
  run_script("scripts/bench_attention.py", "--interpret", "--quick", "--sizes", "256", "--sections",
             "indexer,decode,kvmajor", "--decode", "1x256", "--out", str(tmp_path))
  rows = json.loads((tmp_path / "bench_attention.json").read_text())
  assert not [r for r in rows if "error" in r]
  indexer = [r for r in rows if r["section"] == "indexer_prefill" and r["variant"] != "xla_reference"]
  assert len(indexer) == 3 and all(r["set_match"] == 1.0 for r in indexer)
  (decode,) = [r for r in rows if r["section"] == "decode"]
  rel, finite = decode["rel_err"]
  assert finite and rel < 1e-2
  (floor,) = [r for r in rows if r["section"] == "kv_major_floor"]
  assert floor["partial_GB"] == round(256 * 4 * 16 * 16 * 128 * 2 / 1e9, 2) and floor["floor_ms"] > 0
  rel, finite = floor["rel_err"]
  assert finite and rel < 1e-2  # the merge is a real LSE-weighted sum of the written partials


@pytest.mark.slow
def test_bench_attention_on_saved_selections(tmp_path):
  """--selections: sparse prefill timed on selections saved by `m3jax forward --save-selections` (here a
  hand-made 136-token file: queries in block 1 select blocks 1 and 0, the others only block 0)."""
  import numpy as np

  s = 136
  ids = np.full((1, s, 4, 16), -1, np.int32)
  ids[0, :, :, 0] = np.arange(s)[:, None] // 128
  ids[0, 128:, :, 1] = 0
  np.savez(tmp_path / "sel.npz", positions=np.arange(s, dtype=np.int32)[None], layer_3=ids)
  run_script("scripts/bench_attention.py", "--interpret", "--sizes", "", "--sections", "", "--selections",
             str(tmp_path / "sel.npz"), "--out", str(tmp_path))
  rows = json.loads((tmp_path / "bench_attention.json").read_text())
  assert not [r for r in rows if "error" in r]
  (union,) = [r for r in rows if r["section"] == "sparse_union"]
  assert union["selection"] == "saved layer_3" and abs(union["mean_list_len_q4"] - 36 / 34) < 1e-6
  timed = [r for r in rows if r["section"] == "sparse_prefill" and r["variant"] != "xla_reference"]
  assert [r["variant"].split(",")[0] for r in timed] == ["Q=4 stages=1", "KV-major"]  # interpret: one-warpgroup
  for row in timed:  # the query-major default and the KV-major kernel, each against the XLA reference
    rel, finite = row["rel_err"]
    assert finite and rel < 1e-2, row
  np.savez(tmp_path / "bad.npz", layer_3=ids[:, :, :2])
  env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
  bad = subprocess.run([sys.executable, "scripts/bench_attention.py", "--interpret", "--sizes", "", "--sections", "",
                        "--selections", str(tmp_path / "bad.npz")], cwd=REPO, capture_output=True, text=True,
                       env=env, timeout=300, check=False)
  assert bad.returncode != 0 and "layer_3 has shape (1, 136, 2, 16)" in bad.stderr


def test_bench_sharding_smoke(tmp_path):
  out, moe = tmp_path / "trivial.json", tmp_path / "moe_cpu.json"
  run_script("scripts/bench_sharding.py", "trivial", "--smoke", "--repeats", "1", "--out", str(out))
  r = json.loads(out.read_text())
  assert set(r["results"]) == {"prefill_b1_s64_ms", "decode_b2_ctx64_ms"}
  assert r["decode_logits_max_abs_diff"] == 0.0  # a trivial mesh changes nothing
  run_script("scripts/bench_sharding.py", "moe-cpu", "--tokens", "64", "--repeats", "1", "--out", str(moe))
  r = json.loads(moe.read_text())
  assert r["cpu_devices"] == 8 and max(r["rel_err"].values()) < 1e-5


@pytest.mark.slow
def test_bench_full_smoke(tmp_path):
  """8 simulated devices, bf16, with the GPU script's cold-start options: the on-device loop only, the routing
  calibrated at the first concurrency (the second keeps its biases and has no measured-count roofline), the
  prefill after the decode rows."""
  out = tmp_path / "full.json"
  run_script("scripts/bench_full.py", "--smoke", "--mesh", "expert=4,tensor=2", "--decode-steps", "2",
             "--loop-fusion-ab", "--timing", "loop", "--balance-once", "--prefill-last", "--out", str(out),
             env={"XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"})
  r = json.loads(out.read_text())
  assert r["devices"] == 8 and {"prefill", "decode_c4", "decode_c64"} <= set(r) and r["copy_TBps"] > 0
  calls = r["decode_c4"]["looped_calls_ms"]  # the loop A/B: 3 interleaved calls of each variant
  assert len(calls["fused_once"]) == len(calls["fused_per_step"]) == 3 and min(calls["fused_per_step"]) > 0
  first, second = r["decode_c4"], r["decode_c64"]
  assert first["routing_balance"]["calibration_tokens"] == 64 and second["routing_balance"] is None
  assert "distinct_experts_mean" in first and "distinct_experts_mean" not in second
  for d in (first, second):
    assert "tpot_chained_ms" not in d and d["tpot_looped_ms"] > 0 and d["cache_bytes_per_device"] > 0
    assert d["roofline_ratio"] == pytest.approx(d["tpot_looped_ms"] / d["roofline_ms"])


@pytest.mark.quick
def test_bench_full_compiler_options_parse():
  parse = _load_script("bench_full").parse_compiler_options
  assert parse([]) is None
  assert parse(["a=0", "b=true", "c=FUSION,CUBLAS"]) == {"a": 0, "b": True, "c": "FUSION,CUBLAS"}
  with pytest.raises(ValueError, match="NAME=VALUE"):
    parse(["xla_gpu_dot_merger_threshold_mb"])


@pytest.mark.slow
def test_bench_full_one_shard_smoke(tmp_path):
  """One GPU's share of a 2-way split on one device: per-GPU figures count the 2 GPUs the shard stands for. MXFP8
  weights, in the expert layout of m3jax's meshes (4 of the 8 experts whole, routing over all 8)."""
  out = tmp_path / "shard.json"
  run_script("scripts/bench_full.py", "--smoke", "--one-shard", "2", "--decode-steps", "2", "--concurrency", "4",
             "--weights", "mxfp8", "--layout", "experts",
             "--dispatch-probe", "--compiler-option", "xla_gpu_dot_merger_threshold_mb=0", "--stream-prompt", "16",
             "--prefill-chunks", "32,16", "--out", str(out))
  r = json.loads(out.read_text())
  assert r["devices"] == 1 and r["gpus_represented"] == 2 and r["one_shard_of"] == 2
  assert (r["weights"], r["layout"]) == ("mxfp8", "experts") and r["decode_workspace_bytes"] > 0  # fused fp8 q/k/v
  assert r["step_compiler_options"] == {"xla_gpu_dot_merger_threshold_mb": 0}
  d = r["decode_c4"]
  assert d["tpot_chained_ms"] > 0 and d["tok_s_per_gpu"] == pytest.approx(4 / d["tpot_chained_ms"] * 1e3 / 2)
  assert d["tpot_looped_ms"] > 0
  one, four = d["generate_stream_1"], d["generate_stream_4"]  # --decode-steps 2: 4 calls of 1, 4 calls of 4
  assert (one["tokens"], four["tokens"], four["steps_per_call"], four["prompt_len"]) == (4, 16, 4, 16)
  assert one["tpot_ms"] > 0 and four["tpot_ms"] > 0 and four["call_ms_max"] > 0
  assert r["prefill"]["tok_s_per_gpu"] == pytest.approx(64 / r["prefill"]["ttft_ms"] * 1e3 / 2)
  rows = r["prefill_chunks"]  # the 64-token prompt in one shot, in 2 chunks of 32 and in 4 of 16
  assert [row["chunk"] for row in rows] == [None, 32, 16] and all(row["ms"] > 0 for row in rows)
  assert all(row["temp_bytes"] > 0 for row in rows) and rows[0]["logits_rel_err_vs_one_shot"] == 0.0
  assert all(row["logits_rel_err_vs_one_shot"] < 1e-5 for row in rows)
  # smoke model: 8 experts, top-2, 4 sequences -> each MoE layer touches 0..4 of device 0's experts 0-3
  assert 0 <= d["distinct_experts_mean"] <= 4 and d["routed_roofline_ms"] > 0
  assert d["routing_balance"]["calibration_tokens"] == 64 and d["routing_balance"]["imbalance_after"] >= 1.0
  assert set(d["dispatch_probe"]) == {"step, pytrees", "step, flat lists", "no-op, flat lists", "no-op, pytrees"}
  assert all(v["chained_ms"] > 0 and v["sync_ms"] > 0 for v in d["dispatch_probe"].values())


def test_shard_weight_bytes_of_both_layouts():
  """MXFP8 reads 1 + 1/32 bytes per linear weight (the LM head stays bf16); under uniform routing both layouts
  read the same bytes per GPU; measured counts are of all experts (slices, each 1/WAYS wide) or of the device's
  own (experts, whole)."""
  layouts = _load_script("shard_layouts")
  t = _load_script("bench_full").model_config(None, True).text  # 1 dense + 3 MoE layers, 8 experts of width 32
  bf16, fp8 = layouts.decode_weight_bytes(t, 4), layouts.decode_weight_bytes(t, 4, fp8=True)
  head = 2 * t.hidden_size * t.vocab_size
  assert fp8 - head == pytest.approx((bf16 - head) / 2 * (1 + 1 / 32))
  uniform = {lay: layouts.shard_weight_bytes(t, 4, ways=2, layout=lay, fp8=True) for lay in layouts.LAYOUTS}
  assert uniform["slices"] == uniform["experts"] == pytest.approx(fp8 / 2)
  per_expert = 3 * t.hidden_size * t.intermediate_size * (1 + 1 / 32)
  none = layouts.shard_weight_bytes(t, 4, ways=2, layout="experts", fp8=True, counts=[0, 0, 0])
  assert layouts.shard_weight_bytes(t, 4, ways=2, layout="experts", fp8=True, counts=[1, 2, 3]) == pytest.approx(
      none + 6 * per_expert)
  assert layouts.shard_weight_bytes(t, 4, ways=2, layout="slices", fp8=True, counts=[1, 2, 3]) == pytest.approx(
      none + 6 * per_expert / 2)
  with pytest.raises(ValueError, match="3 experts do not split over 2"):
    layouts.local_experts(dataclasses.replace(t, num_experts=3), 2)


@pytest.mark.quick
def test_decode_weight_bytes_counts_the_experts_touched():
  """Uniform routing's expected count by default; measured counts replace it layer by layer."""
  analysis = _load_script("decode_analysis")
  t = _load_script("bench_full").model_config(None, True).text  # 1 dense + 3 MoE layers, 8 experts of width 32
  per_expert = 2 * 3 * t.hidden_size * t.intermediate_size
  none = analysis.decode_weight_bytes(t, 4, [0, 0, 0])
  assert analysis.decode_weight_bytes(t, 4, [1, 2, 3]) == none + 6 * per_expert
  assert analysis.decode_weight_bytes(t, 4, [8, 8, 8]) == none + 24 * per_expert
  uniform = 8 * (1 - (1 - 2 / 8) ** 4)
  assert analysis.decode_weight_bytes(t, 4) == pytest.approx(none + 3 * uniform * per_expert)


def test_routed_expert_counts_match_the_recorded_routing():
  """The decode-batch expert count equals the distinct expert_ids the model records for the same step."""
  from flax import nnx
  from m3jax.model import M3ForCausalLM
  from m3jax.research import Collect

  bench_full = _load_script("bench_full")
  cfg = bench_full.model_config(None, True)
  model = M3ForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
  b, length = 6, 32
  tok = jax.random.randint(jax.random.key(1), (b,), 0, cfg.text.vocab_size, jnp.int32)
  pos = jnp.full((b,), 5, jnp.int32)
  expected = [len(np.unique(np.asarray(rec["expert_ids"])))
              for rec in model.forward(tok[:, None], positions=pos[:, None], caches=model.init_caches(b, length),
                                       collect=Collect(routing=True)).intermediates if "expert_ids" in rec]
  graphdef, state = nnx.split(model)
  fresh = jax.tree.map(jnp.copy, model.init_caches(b, length))  # distinct buffers: they are donated
  counts, caches = _load_script("decode_analysis").routed_expert_counts(graphdef, state, tok, pos, fresh)
  assert counts == expected and len(counts) == 3 and len(caches) == cfg.text.num_layers


@pytest.mark.quick
def test_shard_config_divides_widths_and_names_what_does_not_divide():
  bench_full = _load_script("bench_full")
  full = bench_full.model_config(None, False).text
  shard = bench_full.shard_config(full, 8)
  assert (shard.num_heads, shard.num_kv_heads, shard.index_num_heads) == (8, 1, 1)
  assert (shard.intermediate_size, shard.shared_intermediate_size, shard.dense_intermediate_size) == (384, 384, 1536)
  assert shard.vocab_size * 8 == full.vocab_size and shard.num_experts == full.num_experts
  whole = bench_full.shard_config(full, 8, "experts")  # 16 whole experts per GPU, routed over all 128
  assert (whole.intermediate_size, whole.num_experts, whole.shared_intermediate_size) == (3072, 128, 384)
  assert bench_full.shard_config(full, 2).num_kv_heads == 2
  with pytest.raises(ValueError, match="num_kv_heads = 4 is not divisible by 3"):
    bench_full.shard_config(full, 3)
  with pytest.raises(ValueError, match="vocab_size = 200065 is not divisible by 8"):
    bench_full.shard_config(dataclasses.replace(full, vocab_size=200065), 8)
  with pytest.raises(ValueError, match="cannot replicate 4 KV heads"):
    bench_full.shard_config(dataclasses.replace(full, num_heads=96, vocab_size=6 * 1000), 6)


def _load_script(name: str):
  """scripts/<name>.py as a module (the repo root and scripts/ on sys.path for its imports)."""
  import importlib.util

  for path in (REPO, REPO / "scripts"):
    if str(path) not in sys.path:
      sys.path.insert(0, str(path))
  spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_window_shared_selections_control_the_overlap():
  """The locality sweep's selections: causal, distinct, block 0 and the own block always in, two queries
  of a 64-query window share >= topk - 2 x replaced blocks (all of them when replaced = 0), and the 4-query
  union grows with `replaced`."""
  import numpy as np
  import pytest

  bench = _load_script("bench_attention")
  s, topk = 16384, bench.TOPK
  unions = []
  for replaced in (0, 3, topk - 2):
    ids = np.asarray(bench.window_shared_selections(s, replaced))
    assert ids.shape == (1, s, bench.NKV, topk) and ids.dtype == np.int32
    own = np.arange(s) // bench.BLOCK
    assert (ids[0] <= own[:, None, None]).all()  # causal
    real = ids[0] >= 0
    assert (real.sum(-1) == np.minimum(own + 1, topk)[:, None]).all()  # nothing dropped, nothing extra
    srt = np.sort(np.where(real, ids[0], -1 - np.arange(topk)), -1)
    assert (np.diff(srt, axis=-1) != 0).all()  # distinct blocks
    late = ids[0, topk * bench.BLOCK:]  # queries that see more than topk blocks
    assert (late[..., 0] == 0).all() and (late[..., 1] == own[topk * bench.BLOCK:, None]).all()
    windows = late.reshape(-1, 64, bench.NKV, topk)
    for w in windows[::7]:
      for g in range(bench.NKV):
        sets = [set(q) for q in w[:, g]]
        overlap = min(len(sets[0] & x) for x in sets[1:])  # both swapped <= replaced of the shared draw
        assert overlap >= topk - 2 * replaced and (replaced > 0 or overlap == topk)
    unions.append(np.mean([len(set(late[i:i + 4, g].ravel())) for i in range(0, len(late), 4)
                           for g in range(bench.NKV)]))
  assert unions[0] == topk and unions[0] < unions[1] < unions[2]
  with pytest.raises(ValueError, match="replaced"):
    bench.window_shared_selections(s, topk - 1)


def test_estimate_tile_regrouping_finds_the_better_grouping():
  """Queries alternate between two disjoint block sets: consecutive groups of 4 hold both (union 4),
  and every regrouping strategy separates them (union 2). The script's CLI runs on a small prefill."""
  import numpy as np

  module = _load_script("estimate_tile_regrouping")
  ids = np.full((64, 1, 16), -1, np.int32)
  ids[0::2, 0, :2] = [0, 1]
  ids[1::2, 0, :2] = [2, 3]
  got = module.estimate(ids, num_blocks=4)
  assert got == {"consecutive": 4.0, "single_user_blocks": 0.0, "best_split_of_8": 2.0, "greedy_64_window": 2.0,
                 "minhash_sort_64_window": 2.0, "per_block_packing_16": 2.0, "per_block_packing_64": 2.0,
                 "hybrid_consecutive": 4.0, "hybrid_greedy_64_window": 2.0}
  # Block 0 shared by all, one private block each: 4 of a group's 5 blocks have a single user, and packing
  # users per block cannot help private blocks (block 0: 1 step per 4 queries, plus 4 private steps).
  private = np.full((64, 1, 16), -1, np.int32)
  private[:, 0, 0] = 0
  private[:, 0, 1] = np.arange(1, 65)
  got = module.estimate(private, num_blocks=65)
  assert got["consecutive"] == 5.0 and got["single_user_blocks"] == 4.0
  assert got["per_block_packing_16"] == 5.0 and got["per_block_packing_64"] == 5.0
  # Hybrid: block 0 takes one 64-row step, each of the 4 private blocks a 16-wide step.
  assert got["hybrid_consecutive"] == round(1 + 4 * module.SINGLETON_COST, 2)
  assert module.estimate(private, num_blocks=65, singleton_cost=0.25)["hybrid_consecutive"] == 2.0
  out = run_script("scripts/estimate_tile_regrouping.py", "--size", "2048", "--queries", "128")
  rows = [json.loads(line) for line in out.splitlines()]
  assert [r["selection"] for r in rows][:2] == ["random indexer", "correlated indexer"] and len(rows) == 5
  for r in rows:
    assert r["best_split_of_8"] <= r["consecutive"] and r["greedy_64_window"] <= r["consecutive"] + 1e-9
    assert r["per_block_packing_64"] <= r["per_block_packing_16"] <= r["consecutive"] + 1e-9
    assert r["hybrid_consecutive"] <= r["consecutive"] + 1e-9


def test_bench_row_tile_kernels_lower_for_cuda():
  """bench_row_tile.py's kernels are GPU-only (no interpreter rule for plgpu.mma or threaded wgmma), but their
  Mosaic GPU lowering, layout inference included, runs on the CPU: every kind must get through it."""
  code = """
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
sys.path.insert(0, "scripts")
import bench_row_tile as b
for kind in b.ROWS:
  for optimized in (True, False):
    q, k, v = b.inputs(2, 1, b.ROWS[kind])
    fn = b.build(kind, ctas=2, wgs=1, steps=2, optimized=optimized)
    text = fn.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text, kind
    print(kind, optimized, "lowered")
"""
  out = run_script("-c", code)
  assert out.count("lowered") == 2 * 6, out


def test_check_xla_topk_runs_and_compares_against_a_sort(tmp_path, monkeypatch):
  """The top-k check runs on the CPU (its GPU-only question is XLA's __gpu$TopK kernel) and finds lax.top_k
  equal to the full sort there; its sort helper follows lax.top_k's contract on ties."""
  import jax.numpy as jnp
  import numpy as np

  module = _load_script("check_xla_topk")
  vals, ids = module.sorted_topk(jnp.asarray([[1.0, 3.0, 3.0, -jnp.inf, jnp.inf]]), 3)
  np.testing.assert_array_equal(np.asarray(ids), [[4, 1, 2]])
  np.testing.assert_array_equal(np.asarray(vals), [[np.inf, 3.0, 3.0]])
  out = run_script("scripts/check_xla_topk.py", "--out", str(tmp_path))
  summary = json.loads(out.splitlines()[-1])
  assert summary == {"cases": 39, "cases_with_differences": 0, "device": "cpu:0"}
  rows = json.loads((tmp_path / "xla_topk.json").read_text())
  assert len(rows) == 39 and all(r["rows_with_other_ids"] == 0 for r in rows)
  assert not any(r["gpu_topk_kernel"] for r in rows)  # no GPU here
  # A wrong top-k (the k smallest) is reported as a difference.
  import jax
  monkeypatch.setattr(jax.lax, "top_k", lambda x, k: module.sorted_topk(-x, k))
  bad = module.check("finite", 2, 256, 16)
  assert bad["rows_with_other_ids"] == bad["rows"] == 8 and bad["rows_with_other_values"] == 8


def test_balance_routing_evens_out_a_skewed_router():
  """Selection biases that favour a few experts are replaced by minus each expert's mean score: the busiest
  expert's load falls to near the even share, and the caches come back (donated) with their shapes."""
  from flax import nnx
  from m3jax.model import M3ForCausalLM

  bench_full = _load_script("bench_full")
  cfg = bench_full.model_config(None, True)  # 8 experts, top-2, 3 MoE layers
  model = M3ForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(4))
  moe = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "correction_bias")]
  for i, mlp in enumerate(moe):  # a strong preference for experts 0 and 1 in every layer
    mlp.correction_bias.set_value(jnp.asarray([1.0, 1.0] + [0.0] * 6) + 0.01 * i)
  b, s, length = 4, 16, 128
  tok = jax.random.randint(jax.random.key(2), (b, s), 0, cfg.text.vocab_size, jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32) + 40, (b, s))
  caches = jax.tree.map(jnp.copy, model.init_caches(b, length))
  before, after, caches = _load_script("decode_analysis").balance_routing(model, tok, pos, caches)
  assert len(before) == len(after) == 3 and len(caches) == cfg.text.num_layers
  assert min(before) == pytest.approx(4.0)  # every token picks experts 0 and 1: 2 x the even share of 8
  assert max(after) < 2.0
  for mlp in moe:
    bias = np.asarray(mlp.correction_bias.get_value())
    assert (bias < 0).all() and (bias > -1).all()  # minus a mean sigmoid score


@pytest.mark.slow
def test_bench_speculative_smoke(tmp_path):
  out = tmp_path / "spec.json"
  run_script("scripts/bench_speculative.py", "--smoke", "--rounds", "3", "--concurrency", "2", "--drafts", "1,2",
             "--stream-prompt", "32", "--stream-rounds-per-call", "2", "--stream-calls", "4", "--out", str(out))
  r = json.loads(out.read_text())
  (row,) = r["rows"]
  assert row["concurrency"] == 2 and row["step_ms"] > 0 and set(row["rounds"]) == {"1", "2"}
  for k, rd in row["rounds"].items():
    assert rd["round_ms"] > 0 and rd["round_over_step"] == pytest.approx(rd["round_ms"] / row["step_ms"])
    assert 0.0 <= rd["acceptance_on_random_weights"] <= 1.0
    expected = (1 - 0.7 ** (int(k) + 1)) / (1 - 0.7) * row["step_ms"] / rd["round_ms"]
    assert rd["projected_speedup"]["0.7"] == pytest.approx(expected)
    stream = rd["stream_2"]  # 4 calls of 2 rounds, the first 2 untimed
    assert stream["round_ms"] > 0 and stream["calls_timed"] == 2 and stream["call_ms_max"] > 0


def test_estimate_prefill_memory_smoke(tmp_path):
  """Compile-only: chunking the prefill shrinks the program's temporary memory, and the arguments (weights) and
  outputs (caches, logits) are the same programs' either way."""
  out = tmp_path / "mem.json"
  run_script("scripts/estimate_prefill_memory.py", "--smoke", "--prompt", "1024", "--chunks", "256,64",
             "--out", str(out))
  rows = json.loads(out.read_text())["rows"]
  assert [r["chunk"] for r in rows] == [None, 256, 64]
  assert rows[0]["temp_bytes"] > rows[1]["temp_bytes"] > rows[2]["temp_bytes"] > 0, rows
  assert len({r["argument_bytes"] for r in rows}) == 1 and len({r["output_bytes"] for r in rows}) == 1


@pytest.mark.slow
def test_bench_engine_smoke(tmp_path):
  out = tmp_path / "engine.json"
  run_script("scripts/bench_engine.py", "--smoke", "--kernels", "reference", "--out", str(out))
  r = json.loads(out.read_text())
  assert r["check_equal"] is True  # the engine's greedy tokens are generate's
  assert r["check_first_difference"] == [None] and r["check_logprob_gaps"] == [None]
  # fp32 on the CPU: both paths' tokens are a full forward's top-1 everywhere
  assert r["check_generate_not_forward_top1"] == [0] and r["check_engine_not_forward_top1"] == [0]
  assert r["static"]["decode_steps"] >= r["engine"]["decode_steps"] > 0 and r["speedup"] > 0


@pytest.mark.slow
def test_bench_serving_smoke(tmp_path):
  out = tmp_path / "serving.json"
  run_script("scripts/bench_serving.py", "--smoke", "--kernels", "reference", "--out", str(out))
  r = json.loads(out.read_text())
  t = r["throughput"]
  assert t["check_equal"] == [True] * 4  # fp32: the paged engine's greedy tokens are the slot engine's
  assert t["slot"]["useful_tok_s"] > 0 and t["paged"]["useful_tok_s"] > 0 and t["ratio"] > 0
  assert r["prefix"]["prefix_hit_tokens"] == 2 * 64  # each pass's second request read the 64-token prefix
  lp = r["long_prompt"]
  # 96 tokens in chunks of 32: the runners decode between the paged engine's prefill calls.
  assert lp["paged"]["during_updates"] >= 3 and lp["paged"]["ratio"] > 0 and lp["slot"]["before_s"] > 0
  assert lp["paged_chunk16"]["during_updates"] > lp["paged_chunk32"]["during_updates"]  # smaller chunks, more steps
  a = r["attention"]
  assert a["max_abs_diff"] == 0.0  # the pages are the rows (fp32 references)
  assert a["sparse_layer"]["paged_s"] > 0 and a["full_layer"]["ratio"] > 0
  assert set(r["targets_met"]) == {"throughput", "prefix", "long_prompt", "attention"}


def test_bench_engine_gap_is_the_logprob_difference_at_the_first_difference():
  """_gap scores both tokens after the shared prefix: 0 for the same token, else |log p(a) - log p(b)| as
  token_logprobs gives them for the two sequences."""
  from flax import nnx

  from m3jax.model import M3ForCausalLM
  from m3jax.scoring import token_logprobs

  bench = _load_script("bench_engine")
  model = M3ForCausalLM(bench.slice_config(True), dtype=jnp.float32, kernels="reference", rngs=nnx.Rngs(0))
  prompt, shared = [3, 1, 4, 1, 5], [9, 2]
  a, b = shared + [6, 7], shared + [8]
  assert bench._gap(model, prompt, a, shared + [6], 2) == 0.0
  scored = token_logprobs(model, [prompt + a[:3], prompt + b]).logprobs
  at = len(prompt) + 2
  assert bench._gap(model, prompt, a, b, 2) == pytest.approx(abs(scored[0, at] - scored[1, at]), abs=1e-5)
  assert bench._gap(model, prompt, a, b, 2) > 0


@pytest.mark.slow
def test_bench_fp8_tiny(tmp_path):
  """scripts/bench_fp8.py (issue #47's fp8 rows) end to end: the fp8 MoE block and dense projection beside the
  bf16 kernels on the same dequantized weights, which must agree."""
  out = tmp_path / "fp8.json"
  run_script("scripts/bench_fp8.py", "--tiny", "--decode", "1", "--prefill", "80", "--dense", "q", "--dense-tokens",
             "1", "--reps", "1", "--out", str(out))
  r = json.loads(out.read_text())
  rows = [*r["moe_decode"], *r["moe_prefill"]]
  assert len(rows) == 2 and len(r["dense"]) == 1
  for row in rows:
    assert row["rel_err_fp8_vs_bf16"] < 1e-2 and isinstance(row["fp8_ms"], float) and isinstance(row["bf16_ms"], float)
  assert r["moe_decode"][0]["touched"] >= 1 and r["dense"][0]["rel_err"] < 1e-2
