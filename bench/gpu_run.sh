#!/usr/bin/env bash
# GPU checks and benchmarks in one go (run from the repo root on the GPU machine).
#   bash bench/gpu_run.sh [stage ...]     stages: tests, kernels, parity7b, profile, bench (default), serving, ablation,
#                                         e2e, tp (2 GPUs), compare, cpu, prefix, shared, stall, prefill, kvquant,
#                                         gemma, llama_attn (Llama's attention kernels per tree of COMPARE_TREES), dense,
#                                         moe, bloom, wquant_tests and wquant (quantized checkpoints: GPTQ, AWQ, FP8),
#                                         moe_routing (the MoE launch work, step by step), launch_cost (what
#                                         a batch-1 step's small launches cost: Qwen3-30B-A3B, Llama-2-7B),
#                                         wquant_families (quantized Phi-3 / StarCoder2), spec (speculative
#                                         decoding), spec_medusa (the demo's Medusa heads against n-gram
#                                         lookup), verify_attn (the attention launches of verify rows),
#                                         spec_profile (a verify step's kernels), frontend, quant_gemm (the
#                                         4-bit and FP8 GEMMs' config sweep), long_context (prompt chunks'
#                                         contexts through cuDNN: kernel tests, bf16 greedy test)
# compare/cpu run the same HTTP benchmark (batch-1 decode, 512 requests at once) / the per-process
# CPU use on each tree of COMPARE_TREES (default: .baseline, an export of an older commit, then
# this tree), one after the other in this run: before and after numbers from one machine; prefix
# runs the prefix-cache loads on each tree's launcher (PREFIX_CACHE=on|off|both for this tree's).
# serving/ablation drive the real launcher over HTTP (bench.serving_bench); POISSON_S sets the
# Poisson phase's length (default 120 s, the issue's two minutes).
# Writes logs and JSON under ${OUT:-/tmp/gpu_out}; prints a short table last.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
stages=${*:-tests parity7b bench}
MODEL_7B=${MODEL_7B:-/tmp/llama2-7b}
declare -A result
failed=0

ensure_7b() {
  [ -f "$MODEL_7B/config.json" ] && return 0
  python3 -m weights.random_checkpoint --config llama-2-7b --out "$MODEL_7B" --dtype bfloat16 --device cuda \
    2>&1 | tail -3
}

for stage in $stages; do
  start=$(date +%s)
  case $stage in
    tests)
      # a test still running after 120 s dumps every thread's stack (a compile that never ends shows in ptxas);
      # the 15 slowest are listed. With pytest-xdist importable (its wheels in .whl) 4 workers share the GPU and
      # compile in parallel: 753 tests in 285 s on an H200 (TEST_WORKERS sets how many)
      parallel=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${TEST_WORKERS:-4}")
      python3 -m pytest -q -p no:cacheprovider $parallel -o faulthandler_timeout=120 --durations=15 tests/kernels \
        tests/unit/test_parity.py tests/gpu/test_greedy_picks.py 2>&1 | tee "$OUT/tests.log" | tail -45
      rc=${PIPESTATUS[0]} ;;
    kernels)
      python3 -m pytest -q -p no:cacheprovider tests/kernels/test_prefill_attention_kernel.py \
        tests/kernels/test_decode_attention_kernel.py tests/unit/test_parity.py 2>&1 | tee "$OUT/kernels.log" | tail -8
      rc=${PIPESTATUS[0]} ;;
    parity7b)
      ensure_7b
      LLAMA2_7B_DIR=$MODEL_7B python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_parity_7b.py 2>&1 \
        | tee "$OUT/parity7b.log" | grep -v -E "it/s|s/it" | tail -40
      rc=${PIPESTATUS[0]} ;;
    tp)
      ensure_7b
      LLAMA2_7B_DIR=$MODEL_7B python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_tp_7b.py 2>&1 \
        | tee "$OUT/tp.log" | grep -v -E "it/s|s/it" | tail -40
      rc=${PIPESTATUS[0]}
      for shards in 1 2; do
        python3 -m bench.engine_bench --model-dir "$MODEL_7B" --no-peer --num-shards $shards \
          --json "$OUT/tp$shards.json" 2>&1 | tee -a "$OUT/tp.log" | grep -E "tokens/s|capacity" ; done
      MODEL_13B=${MODEL_13B:-/tmp/llama2-13b}
      [ -f "$MODEL_13B/config.json" ] || python3 -m weights.random_checkpoint --config llama-2-13b \
        --out "$MODEL_13B" --dtype bfloat16 --device cuda 2>&1 | tail -2
      python3 -m bench.engine_bench --model-dir "$MODEL_13B" --no-peer --num-shards 2 --json "$OUT/tp2_13b.json" \
        2>&1 | tee -a "$OUT/tp.log" | grep -E "tokens/s|capacity" ;;
    verify_attn)
      # the prefill attention of verify rows (4 drafts, 512 positions of context: spec_bench verify's shape) for
      # every tile, BLOCK_N, warps, stages and split count, beside a decode step's attention (issue 20's verify cost)
      python3 -m bench.attention_bench --verify-drafts 4 --batch-sizes ${VERIFY_BATCHES:-1,8,32} --seq-lens 512 \
        --json "$OUT/verify_attn.json" 2>&1 | tee "$OUT/verify_attn.log" | tail -6
      rc=${PIPESTATUS[0]} ;;
    shared)
      # the shared-prefix (cascade) decode kernel's launch sweep, 3,000 shared positions
      python3 -m bench.attention_bench --shared-prefix 3000 --batch-sizes ${SHARED_BATCHES:-64,256} --seq-lens 3064 \
        --json "$OUT/shared_sweep.json" 2>&1 | tee "$OUT/shared_sweep.log" | tail -6
      rc=${PIPESTATUS[0]} ;;
    profile)
      # PROFILE_TREES=".baseline ." profiles each tree in turn (device and host time per decode step);
      # PROFILE_ARGS="--prompt-chunk 704" profiles the mixed steps of stall-free batching instead
      ensure_7b
      for tree in ${PROFILE_TREES:-.}; do
        tag=$(basename "$(realpath "$tree")"); mkdir -p "$OUT/$tag"
        (cd "$tree" && PYTHONPATH=/tmp/site:$PWD python3 -m bench.profile_step --model-dir "$MODEL_7B" \
          --batch-sizes "${PROFILE_BATCHES:-1,32,128,256}" ${PROFILE_ARGS:-} --table-dir "$OUT/$tag" \
          --json "$OUT/profile_$tag.json" 2>&1 \
          | tee "$OUT/profile_$tag.log" | grep -v -E "it/s|s/it" | tail -8)
        rc=$?
      done ;;
    bench)
      ensure_7b
      python3 -m bench.engine_bench --model-dir "$MODEL_7B" ${BENCH_ARGS:-} --json "$OUT/engine_bench.json" 2>&1 \
        | tee "$OUT/bench.log" | grep -v -E "^\s*$|it/s|s/it" | tail -20
      rc=${PIPESTATUS[0]} ;;
    serving)
      ensure_7b
      python3 -m bench.serving_bench --model-dir "$MODEL_7B" --num-requests 512 --duration "${POISSON_S:-120}" ${SERVING_ARGS:-} \
        --json "$OUT/serving${SERVING_TAG:-}.json" 2>&1 | tee "$OUT/serving${SERVING_TAG:-}.log" | grep -v -E "it/s|s/it" | tail -45
      rc=${PIPESTATUS[0]} ;;
    ablation)
      ensure_7b
      python3 -m bench.serving_bench --model-dir "$MODEL_7B" --workloads "" --ablation \
        --ablation-requests "${ABLATION_REQUESTS:-512}" --json "$OUT/ablation.json" 2>&1 \
        | tee "$OUT/ablation.log" | grep -v -E "it/s|s/it" | tail -40
      rc=${PIPESTATUS[0]} ;;
    e2e)
      # The launcher e2e suite on the random 7B. float32: its "200 concurrent streams equal one
      # at a time" is exact batch invariance, which bf16 near-ties break (tests/gpu/greedy.py).
      ensure_7b
      E2E_MODEL_DIR=$MODEL_7B E2E_SERVER_ARGS="--dtype float32" E2E_STARTUP_S=300 \
        python3 -m pytest -q -p no:cacheprovider tests/e2e/test_launcher.py tests/e2e/test_launcher_lifecycle.py 2>&1 | tee "$OUT/e2e.log" | tail -30
      rc=${PIPESTATUS[0]} ;;
    compare)
      ensure_7b
      for tree in ${COMPARE_TREES:-.baseline .}; do
        tag=$(basename "$(realpath "$tree")")
        (cd "$tree" && PYTHONPATH=/tmp/site:$PWD python3 -m bench.serving_bench --model-dir "$MODEL_7B" \
          --workloads batch1,batch --no-peer ${COMPARE_ARGS:-} --json "$OUT/compare_$tag.json" 2>&1 | tee "$OUT/compare_$tag.log" \
          | grep -v -E "it/s|s/it" | tail -12)
        rc=${PIPESTATUS[0]}
      done ;;
    cpu)
      ensure_7b
      for tree in ${COMPARE_TREES:-.baseline .}; do
        tag=$(basename "$(realpath "$tree")")
        [ -f "$tree/bench/process_cpu.py" ] || cp bench/process_cpu.py "$tree/bench/"
        (cd "$tree" && PYTHONPATH=/tmp/site:$PWD python3 -m bench.process_cpu --model-dir "$MODEL_7B" \
          --json "$OUT/cpu_$tag.json" 2>&1 | tail -14)
        rc=$?
      done ;;
    prefix)
      # The shared-prefix and multi-turn loads (bench.prefix_bench): the cache on with the launcher of
      # each tree of COMPARE_TREES but the last (before), then on and off with this tree's (after). The front end
      # tokenizes with the tokenizers' own threads, as a user's would (TOKENIZERS_PARALLELISM unset).
      ensure_7b
      trees=(${COMPARE_TREES:-.baseline .})
      for tree in "${trees[@]:0:${#trees[@]}-1}"; do
        tag=$(basename "$(realpath "$tree")")
        LAUNCHER_REPO=$tree env -u TOKENIZERS_PARALLELISM python3 -m bench.prefix_bench --model-dir "$MODEL_7B" \
          --cache on ${PREFIX_ARGS:-} \
          --json "$OUT/prefix_$tag.json" 2>&1 | tee "$OUT/prefix_$tag.log" | grep -v -E "it/s|s/it" | tail -11
      done
      env -u TOKENIZERS_PARALLELISM python3 -m bench.prefix_bench --model-dir "$MODEL_7B" \
        --cache ${PREFIX_CACHE:-both} ${PREFIX_ARGS:-} \
        --json "$OUT/prefix.json" 2>&1 | tee "$OUT/prefix.log" | grep -v -E "it/s|s/it" | tail -11
      rc=${PIPESTATUS[0]} ;;
    stall)
      # Long prompts beside decoding streams (bench.long_prompt_bench) on a random Llama-3.1-8B with
      # --max-input-tokens 120000, served by the launcher of each tree of COMPARE_TREES (before, after). The front
      # end tokenizes with the tokenizers' own threads, as a user's would (TOKENIZERS_PARALLELISM unset: with this
      # script's "false" a 32,000-token prompt's validation took 36-68 ms on one H200 host, a long prompt's TTFT
      # counting it)
      MODEL_8B=${MODEL_8B:-/tmp/llama31-8b}
      [ -f "$MODEL_8B/config.json" ] || python3 -m weights.random_checkpoint --config llama-3.1-8b --out "$MODEL_8B" \
        --dtype bfloat16 --device cuda 2>&1 | tail -2
      for tree in ${COMPARE_TREES:-.baseline .}; do
        tag=$(basename "$(realpath "$tree")")
        LAUNCHER_REPO=$tree env -u TOKENIZERS_PARALLELISM python3 -m bench.long_prompt_bench --model-dir "$MODEL_8B" \
          ${STALL_ARGS:-} \
          --json "$OUT/stall_$tag.json" 2>&1 | tee "$OUT/stall_$tag.log" | grep -v -E "it/s|s/it" | tail -7
        rc=${PIPESTATUS[0]}
      done ;;
    long_context)
      # prompt chunks' long contexts through cuDNN (kernels.context_attention): its kernel tests, then
      # tests/gpu/test_long_context.py's bf16 greedy run of a 12,000-token prompt (random Llama-3.1-8B, 4 layers)
      # against transformers and against the prefill kernel alone. About 2 minutes (stop 73: 68 s for the test)
      MODEL_8B_4L=${MODEL_8B_4L:-/tmp/llama31-8b-4l}
      [ -f "$MODEL_8B_4L/config.json" ] || python3 -m weights.random_checkpoint --config llama-3.1-8b --num-layers 4 \
        --out "$MODEL_8B_4L" --dtype bfloat16 --device cuda 2>&1 | tail -2
      python3 -m pytest -q -p no:cacheprovider tests/kernels/test_context_attention_kernel.py 2>&1 \
        | tee "$OUT/long_context_kernels.log" | tail -2
      kernels_rc=${PIPESTATUS[0]}
      LLAMA31_DIR=$MODEL_8B_4L python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_long_context.py 2>&1 \
        | tee "$OUT/long_context.log" | grep -E "vs|passed|failed|^E " | tail -8
      rc=${PIPESTATUS[0]}; [ "$kernels_rc" -eq 0 ] || rc=$kernels_rc ;;
    prefill)
      # the prefill attention's launch sweep at long context (Llama-3.1-8B heads by default)
      python3 -m bench.prefill_attention_bench ${PREFILL_ARGS:-} --json "$OUT/prefill_attention.json" 2>&1 \
        | tee "$OUT/prefill_attention.log" | tail -30
      rc=${PIPESTATUS[0]} ;;
    kvquant)
      # The quantized KV cache (issue 17, bench.kv_quant_bench): the kernel tests on the GPU, then per KV dtype
      # beside bf16 the slots, the 512-request load and batch-1 decode on the random 7B, the 100k-token
      # context's decode speed on the random Llama-3.1-8B, the float32 7B's logprob drift. About 9 minutes
      # (estimated: kernel tests 1, 3 servers of the 7B 4, 2 of the 8B 2.5, drift 1.5); KVQUANT_ARGS adds
      # e.g. "--kv-dtypes int8,fp8_e4m3fn,fp8_e5m2 --long-kv-dtypes int8,fp8_e4m3fn" (longer).
      ensure_7b
      MODEL_8B=${MODEL_8B:-/tmp/llama31-8b}
      [ -f "$MODEL_8B/config.json" ] || python3 -m weights.random_checkpoint --config llama-3.1-8b --out "$MODEL_8B" \
        --dtype bfloat16 --device cuda 2>&1 | tail -2
      python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kv_quant_kernel.py 2>&1 | tee "$OUT/kvquant.log" | tail -4
      rc=${PIPESTATUS[0]}
      python3 -m bench.kv_quant_bench --model-dir "$MODEL_7B" --long-model-dir "$MODEL_8B" ${KVQUANT_ARGS:-} \
        --json "$OUT/kvquant.json" 2>&1 | tee -a "$OUT/kvquant.log" | grep -v -E "it/s|s/it" | tail -60
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
    gemma)
      # Gemma / Gemma 2 (issue 18): the score-mod and GeLU kernel tests on the GPU, float32 greedy parity
      # and bf16 closeness against transformers on random gemma-7b / gemma-2-9b (GEMMA_LAYERS layers, default 8),
      # then batch-1 decode and the 256-request throughput beside transformers (bench.engine_bench)
      GEMMA_7B=${GEMMA_7B:-/tmp/gemma-7b}; GEMMA2_9B=${GEMMA2_9B:-/tmp/gemma-2-9b}
      for pair in "gemma-7b $GEMMA_7B" "gemma-2-9b $GEMMA2_9B"; do
        set -- $pair
        [ -f "$2/config.json" ] || python3 -m weights.random_checkpoint --config "$1" --num-layers "${GEMMA_LAYERS:-8}" \
          --out "$2" --dtype bfloat16 --device cuda 2>&1 | tail -2
      done
      python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention_score_mods_kernel.py \
        tests/kernels/test_silu_and_mul_kernel.py 2>&1 | tee "$OUT/gemma_kernels.log" | tail -5
      rc=${PIPESTATUS[0]}
      GEMMA_7B_DIR=$GEMMA_7B GEMMA2_9B_DIR=$GEMMA2_9B python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gemma.py \
        2>&1 | tee "$OUT/gemma_parity.log" | grep -v -E "it/s|s/it" | tail -30
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      for model in "$GEMMA_7B" "$GEMMA2_9B"; do
        python3 -m bench.engine_bench --model-dir "$model" --json "$OUT/gemma_bench_$(basename "$model").json" 2>&1 \
          | tee -a "$OUT/gemma_bench.log" | grep -v -E "^\s*$|it/s|s/it" | tail -8
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      done ;;
    llama_attn)
      # Llama's attention kernels before (the first trees of COMPARE_TREES) and after the score mods (this
      # tree): decode (Llama-2-7B heads) and prefill (Llama-3.1-8B heads, no launch sweep), one machine
      for tree in ${COMPARE_TREES:-.baseline .}; do
        tag=$(basename "$(realpath "$tree")")
        (cd "$tree" && PYTHONPATH=/tmp/site:$PWD python3 -m bench.attention_bench --json "$OUT/llama_decode_$tag.json" \
          2>&1 | tee "$OUT/llama_attn_$tag.log" | tail -10
         PYTHONPATH=/tmp/site:$PWD python3 -m bench.prefill_attention_bench --seq-lens 4096,32768 --sweep-lens "" \
          --json "$OUT/llama_prefill_$tag.json" 2>&1 | tee -a "$OUT/llama_attn_$tag.log" | tail -6)
        rc=$?
      done ;;
    dense)
      # Phi-3-mini-4k / -128k and StarCoder2-7B (DENSE_LAYERS layers, default 8): float32 greedy parity
      # with transformers, then bf16 batch-1 decode and the 256-request throughput beside transformers
      dense_dirs=""
      for name in phi-3-mini-4k phi-3-mini-128k starcoder2-7b; do
        dir=/tmp/dense-$name
        [ -f "$dir/config.json" ] || python3 -m weights.random_checkpoint --config $name --out "$dir" \
          --dtype bfloat16 --device cuda --num-layers "${DENSE_LAYERS:-8}" 2>&1 | tail -1
        dense_dirs="$dense_dirs $name=$dir"
      done
      DENSE_DIRS="$dense_dirs" python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_dense_families.py 2>&1 \
        | tee "$OUT/dense.log" | grep -v -E "it/s|s/it" | tail -30
      rc=${PIPESTATUS[0]}
      for name in phi-3-mini-4k starcoder2-7b; do
        python3 -m bench.engine_bench --model-dir /tmp/dense-$name --json "$OUT/dense_$name.json" 2>&1 \
          | tee -a "$OUT/dense.log" | grep -v -E "it/s|s/it" | tail -12
      done ;;
    moe)
      # Mixtral-8x7B, Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B, Qwen3-8B (layers reduced, tests/gpu/test_moe_parity.py
      # MODELS), one at a time (the disk holds one): float32 greedy parity with transformers (4 prompts x 32
      # tokens), then bench.moe_bench (bf16 batch-1 decode and 256 requests beside transformers, batch-1
      # decode as a fraction of the active-bytes floor); each checkpoint is deleted after its runs.
      MOE_DIR=${MOE_DIR:-/tmp/moe}; mkdir -p "$MOE_DIR"; rc=0
      for name in ${MOE_MODELS:-mixtral-8x7b qwen1.5-moe-a2.7b qwen3-30b-a3b qwen3-8b}; do
        MOE_DIR=$MOE_DIR python3 -m pytest -q -s -p no:cacheprovider \
          "tests/gpu/test_moe_parity.py::test_float32_greedy_tokens_equal_transformers[$name]" 2>&1 \
          | tee -a "$OUT/moe.log" | grep -v -E "it/s|s/it" | tail -8
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        python3 -m bench.moe_bench --model-dir "$MOE_DIR/$name"-*l --json "$OUT/moe_$name.json" 2>&1 \
          | tee -a "$OUT/moe.log" | grep -E "bandwidth|tokens/s|floor|capacity" | tail -8
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        rm -rf "$MOE_DIR/$name"-*l
      done ;;
    launch_cost)
      # a batch-1 decode step with its norms, rotary, split merge or MoE routing skipped, one variant a process
      # (bench.launch_cost): what fusing them away could save at best, on Qwen3-30B-A3B (16 layers) and Llama-2-7B
      ensure_7b; rc=0
      dir=${MOE_DIR:-/tmp/moe}/qwen3-30b-a3b-16l
      [ -f "$dir/config.json" ] || python3 -m weights.random_checkpoint --config qwen3-30b-a3b --out "$dir" \
        --dtype bfloat16 --device cuda --num-layers 16 2>&1 | tail -1
      for spec in "$dir:base,norms,rotary,merge,route,all,base" "$MODEL_7B:base,norms,rotary,merge,all,base"; do
        python3 -m bench.launch_cost --model-dir "${spec%%:*}" --variants "${spec#*:}" \
          --json "$OUT/launch_cost_$(basename "${spec%%:*}").json" 2>&1 | tee -a "$OUT/launch_cost.log" | tail -9
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      done
      rm -rf "$dir" ;;
    moe_routing)
      # What each step of the MoE launch work brings to batch-1 decode (bench.moe_bench --routing-ab): from torch's
      # routing and alignment, through the routing kernels, the one-token expert kernels and Qwen2-MoE's shared
      # expert inside them, to Qwen3's q/k norms inside the rotary kernel; one MoE block in a CUDA graph per
      # variant, then an engine per variant. Qwen3-30B-A3B (16 layers), Qwen1.5-MoE-A2.7B (all 24) and
      # Mixtral-8x7B (8 layers), with --requests 64 for the throughput line (about 3 minutes a model on an H100)
      MOE_DIR=${MOE_DIR:-/tmp/moe}; mkdir -p "$MOE_DIR"; rc=0
      for spec in qwen3-30b-a3b:16 qwen1.5-moe-a2.7b:24 mixtral-8x7b:8; do
        dir=$MOE_DIR/${spec%:*}-${spec#*:}l
        [ -f "$dir/config.json" ] || python3 -m weights.random_checkpoint --config ${spec%:*} --out "$dir" \
          --dtype bfloat16 --device cuda --num-layers ${spec#*:} 2>&1 | tail -1
        python3 -m bench.moe_bench --no-peer --routing-ab --requests 64 --model-dir "$dir" \
          --json "$OUT/moe_routing_${spec%:*}.json" 2>&1 | tee -a "$OUT/moe_routing.log" \
          | grep -E "bandwidth|routing by|floor|MoE block" | tail -8
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        rm -rf "$dir"
      done ;;
    bloom)
      # Bloom-7b1 (BLOOM_LAYERS of its 30 layers, default 8 to keep the stage near 2 minutes; 30, the whole
      # model, fits one H100): float32 greedy parity with transformers (4 prompts x 64 tokens; ALiBi inside both
      # attention kernels, K stored unrotated), then bf16 batch-1 decode and the 256-request throughput beside
      # transformers (eager attention: its Bloom has no SDPA path)
      layers=${BLOOM_LAYERS:-8}; dir=/tmp/bloom-7b1-${layers}l; rc=0
      [ -f "$dir/config.json" ] || timeout 300 python3 -m weights.random_checkpoint --config bloom-7b1 --out "$dir" \
        --dtype bfloat16 --device cuda --num-layers "$layers" 2>&1 | tail -1
      DENSE_DIRS="bloom-7b1=$dir" timeout 420 python3 -m pytest -q -s -p no:cacheprovider \
        "tests/gpu/test_dense_families.py::test_float32_greedy_tokens_equal_transformers[bloom-7b1]" 2>&1 \
        | tee "$OUT/bloom.log" | grep -v -E "it/s|s/it" | tail -12
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      timeout 420 python3 -m bench.engine_bench --model-dir "$dir" --json "$OUT/bloom_bench.json" 2>&1 \
        | tee -a "$OUT/bloom.log" | grep -v -E "it/s|s/it" | tail -12
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
    wquant_tests)
      # Quantized checkpoints (issue 19), correctness: the 4-bit and FP8 GEMM kernel tests on the GPU and
      # tests/gpu/test_quantized.py (kernels vs references on Llama-2-7B shapes; float32 greedy parity of
      # GPTQ act-order / AWQ / FP8 Llama-2-7B-shaped models, QUANT_LAYERS layers, with transformers on their
      # dequantized twins). A few minutes (estimated).
      timeout 900 python3 -m pytest -q -s -p no:cacheprovider tests/kernels/test_quant_gemm_kernel.py \
        tests/kernels/test_fp8_gemm_kernel.py tests/gpu/test_quantized.py 2>&1 | tee "$OUT/wquant_tests.log" \
        | grep -v -E "it/s|s/it" | tail -20
      rc=${PIPESTATUS[0]} ;;
    wquant)
      # Quantized checkpoints (issue 19), speed: random Llama-2-7B GPTQ (4-bit, groups of 128), AWQ and FP8
      # checkpoints written on the GPU, then beside the bf16 one batch-1 decode over HTTP (bench.serving_bench,
      # 128-token prompt, 256 new tokens) for each; targets GPTQ/AWQ >= 450 tok/s, FP8 >= 330 (bf16: 196).
      # About 4 minutes a tree (call 6 of stop 34: a checkpoint written in ~25 s, a batch-1 run in ~35 s);
      # WQUANT_WORKLOADS=batch1,batch adds the 512-request load (longer); WQUANT_FORMATS picks the checkpoints
      # (default "bf16 gptq awq fp8"); WQUANT_TREES serves each from each tree in turn (default ".": e.g.
      # ".baseline ." for before and after in one run).
      rc=0; formats=${WQUANT_FORMATS:-bf16 gptq awq fp8}
      [[ " $formats " == *" bf16 "* ]] && ensure_7b
      models=()
      for fmt in $formats; do
        if [ "$fmt" = bf16 ]; then models+=("$MODEL_7B"); continue; fi
        [ -f "$MODEL_7B-$fmt/config.json" ] || timeout 300 python3 -m weights.random_checkpoint --config llama-2-7b \
          --out "$MODEL_7B-$fmt" --dtype bfloat16 --device cuda --quantize $fmt 2>&1 | tail -1
        models+=("$MODEL_7B-$fmt")
      done
      for model in "${models[@]}"; do
        for tree in ${WQUANT_TREES:-.}; do
          tag="$(basename "$model")_$(basename "$(realpath "$tree")")"
          (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 600 python3 -m bench.serving_bench --model-dir "$model" \
            --workloads "${WQUANT_WORKLOADS:-batch1}" --num-requests 512 --no-peer --json "$OUT/wquant_$tag.json" 2>&1 \
            | tee -a "$OUT/wquant.log" | grep -E "tok/s|tokens/s" | sed "s|^|$tag: |"; exit "${PIPESTATUS[0]}") || rc=1
        done
      done ;;
    spec)
      # speculative decoding: tests/gpu/test_speculation.py checks the tokens (the demo model with 4 and 8 drafts on
      # prompts that quote their input, equal or parting at a near-tie; the demo's Medusa heads) and prints the
      # demo's batch-1 speed-ups and acceptance (issue 20: >= 1.8x); random Llama-2-7B: a verify step with 4 drafts
      # vs a decode step at batch 1 and 32 (<= 1.15x); 64 random prompts with --speculate 2 vs 0 (>= 0.95x)
      ensure_7b
      timeout ${SPEC_TIMEOUT:-360} python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_speculation.py 2>&1 \
        | tee "$OUT/spec.log" | grep -v -E "it/s|s/it" | grep -E "speed-up|identical to|passed|failed|Error" | tail -20
      rc=${PIPESTATUS[0]}
      timeout 200 python3 -m bench.spec_bench verify --model-dir "$MODEL_7B" --json "$OUT/spec_verify.json" 2>&1 \
        | tee -a "$OUT/spec.log" | grep -E "^batch"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      timeout 300 python3 -m bench.spec_bench load --model-dir "$MODEL_7B" --json "$OUT/spec_load.json" 2>&1 \
        | tee -a "$OUT/spec.log" | grep -E "speculate"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
    spec_medusa)
      # the demo's bundled Medusa heads (weights/demo/medusa) against n-gram lookup, on rename and write prompts:
      # tokens/s, tokens per step and acceptance at batch 1, one run after the other on this machine
      for task in rename write; do
        for heads in "" "--draft-heads weights/demo/medusa"; do
          name="spec_medusa_${task}${heads:+_heads}"
          timeout 200 python3 -m bench.spec_bench demo --task $task $heads --json "$OUT/$name.json" 2>&1 \
            | grep -v -E "it/s|s/it" | tee "$OUT/$name.log" | grep -E "speed-up"
        done
      done; rc=0 ;;
    spec_profile)
      # where a batch-1 verify step's extra time goes (bench.spec_bench profile): kernels of a decode and a verify
      # step side by side, without PDL (each kernel's own time) and with it (the engine's default)
      ensure_7b; rc=0
      for pdl in 0 1; do
        ENGINE_PDL=$pdl timeout 200 python3 -m bench.spec_bench profile --model-dir "$MODEL_7B" --batch-sizes 1 \
          --json "$OUT/spec_profile_pdl$pdl.json" 2>&1 | grep -v -E "it/s|s/it" | tee "$OUT/spec_profile_pdl$pdl.log" \
          | tail -17
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      done ;;
    frontend)
      # The front end alone under issue 15's burst (bench.frontend_bench: 256 streamed prompts of ~3,000 tokens at
      # once against a paced stand-in router, this machine's CPUs, no GPU): TTFT, ITL, mean validation and the
      # front end's CPU seconds, 1 and 64 new tokens, with the Llama-2-7B tokenizer of weights.tokenizer_builder
      # (the random 7B's), per tree of COMPARE_TREES (before, after). FRONTEND_ARGS adds flags.
      tok=${MODEL_7B}; rc=0
      if [ ! -f "$tok/tokenizer.json" ]; then
        tok=/tmp/llama2-7b-tokenizer
        [ -f "$tok/tokenizer.json" ] || python3 -c "from weights.random_checkpoint import resolve_config as r
from weights.tokenizer_builder import write_tokenizer as w; w('$tok', r('llama-2-7b'))"
      fi
      for tree in ${COMPARE_TREES:-.baseline .}; do
        tag=$(basename "$(realpath "$tree")")
        for new in 1 64; do
          (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m bench.frontend_bench --tokenizer "$tok" \
            --new-tokens $new ${FRONTEND_ARGS:-} --json "$OUT/frontend_${tag}_$new.json" 2>&1 | tail -1)
          [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        done
      done ;;
    quant_gemm)
      # the 4-bit and FP8 GEMMs alone (bench.quant_gemm_bench): the default and a sweep of configs per Llama-2-7B
      # shape at 1 and 512 rows beside bfloat16, and the linear layers' ms per step (QUANT_GEMM_ARGS adds flags)
      timeout 420 python3 -m bench.quant_gemm_bench ${QUANT_GEMM_ARGS:-} --json "$OUT/quant_gemm.json" 2>&1 \
        | tee "$OUT/quant_gemm.log" | tail -30
      rc=${PIPESTATUS[0]} ;;
    wquant_families)
      # Quantized Phi-3 (parts cut from fused packed qkv / gate_up) and StarCoder2 (biased layers): tiny GPTQ /
      # AWQ / FP8 checkpoints through the Triton GEMMs on the GPU, float32 greedy tokens == transformers on the
      # dequantized twins (tests/gpu/test_quantized.py). About a minute (estimated).
      timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_quantized.py \
        -k test_phi3_and_starcoder2_quantized_greedy_tokens_equal_transformers 2>&1 \
        | tee "$OUT/wquant_families.log" | grep -v -E "it/s|s/it" | tail -20
      rc=${PIPESTATUS[0]} ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
  result[$stage]="rc=$rc $(( $(date +%s) - start ))s"
  [ "$rc" = 0 ] || failed=1
done
echo; echo "== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)) =="
for stage in $stages; do echo "$stage: ${result[$stage]}"; done
[ -f "$OUT/engine_bench.json" ] && cat "$OUT/engine_bench.json"
exit $failed
