#!/usr/bin/env bash
# The H200 measurements still owed by the CPU-only sessions (BENCHMARKS.md, "Chunked prefill, streamed and
# multimodal speculative decoding" and "Conversations and scoring"), as one device call of under 10 minutes:
#
#   run(command="bash scripts/gpu_pending.sh", timeout_s=600)       # the device tool, from the repo root
#   run(command="STEPS='full_chunked spec_stream' bash scripts/gpu_pending.sh")   # chosen steps only
#
# STEPS (default "engine full_chunked tests") picks steps by name: engine, full_chunked, tests, spec_stream,
# prefill_memory. The last two are not in the default set: with it they would not fit one 10-minute call.
#
# Each step has its own time limit and log under $OUT (default /tmp/gpu_pending), so a step that hangs or fails
# costs only its own slot and the rest still run; $OUT/summary.txt lists each step's exit status and seconds.
set -u
OUT="${OUT:-/tmp/gpu_pending}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD" JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
: > "$OUT/summary.txt"

STEPS="${STEPS:-engine full_chunked tests}"
source "$(dirname "$0")/gpu_steps.sh"
check_steps gpu_pending.sh "engine full_chunked tests spec_stream prefill_memory"

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1

# Limits from the 2026-12-05 run, where every step of the first version timed out: a 60-layer program takes ~50 s
# to compile, and the engine compiles one admission prefill per row count.

# 1. Continuous batching against static batches of the same engine programs (real-dims 4-layer slice).
step engine 200 python3 scripts/bench_engine.py --check 1 --out "$OUT/engine.json"

# 2. Chunked prefill against one shot, one GPU's shard of the full model (60 layers), 32K prompt (the decode part
#    that follows may be cut by the limit: the prefill rows are saved to full.json first).
#    LAYERS=30 fits an H100 (80 GB; all 60 need ~113 GB: an H200).
step full_chunked 190 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 python3 scripts/bench_full.py --one-shard 8 \
  --layers "${LAYERS:-60}" --prompt 32768 --concurrency 4 --decode-steps 4 --prefill-chunks 8192 --out "$OUT/full.json"

# 3. The new model-level paths compiled for the GPU (the CPU suite runs them on XLA:CPU and in interpret mode).
step tests 170 env XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -v -p no:cacheprovider -n 8 \
  -m "not interpret" tests/test_engine.py tests/test_conversation.py tests/test_scoring.py tests/test_generate.py \
  tests/test_speculative.py -k "engine or request or cancel or conversation or scor or logprob or continuation or chunked"

# 4. generate_speculative_stream's cost per round against the on-device speculative loop, 60 layers + MTP
#    (plain step, k=3 round, then the stream at 1 and 4 rounds per call: ~5 compiles of ~50 s).
#    LAYERS=30 fits an H100 (as in step 2).
step spec_stream 330 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 python3 scripts/bench_speculative.py --one-shard 8 \
  --layers "${LAYERS:-60}" --concurrency 4 --drafts 3 --stream-prompt 256 --stream-rounds-per-call 1,4 --out "$OUT/spec.json"

# 5. Temporary memory of the Pallas-path prefill, one shot against chunks (compile only, first 4 layers, 128K).
step prefill_memory 200 python3 scripts/estimate_prefill_memory.py --layers 4 --prompt 131072 --chunks 8192,2048 \
  --out "$OUT/prefill_memory.json"

cat "$OUT/summary.txt"
