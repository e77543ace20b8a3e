#!/usr/bin/env bash
# Issue 20 on one H200: fp8 KV cache and fp8 weights, measured. Parts, each within one device
# call of 10 minutes (run from the repository root; results and logs under $OUT):
#
#   bash scripts/gpu_fp8.sh tests kernels      # ~5 min
#     tests    the `gpu` tests of the fp8 code (kernels on fp8 caches compiled, with float16
#              products and packed loads; the hardware e4m3 conversion of every e4m3 writer,
#              next to rounding ties too; _scaled_mm against the fallback, fp8_matmul within
#              its bound with both split-K merges, the engine with both options and CUDA
#              graphs, fp8 swaps)
#     kernels  `python -m pagedkv.bench.kernels --fp8`: the whole kernel benchmark (decode rows,
#              prefill rows `prefill[].tokens` / `prefill[].vs_sdpa` at 1k/4k/16k, fused ops,
#              split and tile sweeps, prefill tiles at 4k and 16k) plus decode and prefill on
#              an fp8 cache (`decode_fp8[]`, bandwidth in fp8 bytes) and the decode GEMMs of a
#              Llama-3-8B layer, fp8 against bf16 at 64-1,024 tokens (`gemm_layer[]`,
#              `gemm_fp8_vs_16bit_m512`)                                 -> kernels.json
#   bash scripts/gpu_fp8.sh gemm               # ~2 min
#     `python -m pagedkv.bench.kernels --gemm-only`: the fp8 GEMM rows alone (`gemm_layer[]`,
#     `gemm_layer_fused[]`) and the quantization kernels, a program per row against tiled
#     (`quant[]`)                                  -> kernels_fp8_gemm.json
#   bash scripts/gpu_fp8.sh bf16               # ~6 min, carrying .gpu_data
#   bash scripts/gpu_fp8.sh fp8                # ~2 min, carrying .gpu_data
#     Llama-3-8B shape (random bf16 weights), 1,000 requests of the real ShareGPT V3 when
#     .gpu_data/sharegpt_1000.json is carried, else the ShareGPT-like lengths; bf16 with
#     the transformers baselines in the same run (as scripts/gpu_bench_throughput.sh), then
#     --kv-cache-dtype fp8 --quantization fp8 on the same requests (BASELINES_FP8=1: with the
#     baselines too)      -> throughput_llama3_8b_sharegpt_real.json, ..._real_fp8.json
#     (`..._sharegpt_like*.json` without the file)
#   bash scripts/gpu_fp8.sh ratio              # ~4 min, carrying .gpu_data
#     fp8 weights + fp8 KV then bf16 (no transformers runs), RATIO_ROUNDS (2) times
#     interleaved: each round's fp8/bf16 ratio, their median and spread; RATIO_KINDS="fp8
#     fp8lm bf16" adds fp8 with --quantize-lm-head to each round
#                                  -> ratio_summary.json, the last round's ..._{fp8,bf16}_rN.json
#   bash scripts/gpu_fp8.sh dense              # ~4 min, carrying .gpu_data
#     the bf16 run with its decode matmuls of up to PAGEDKV_MATMUL_16BIT_MAX_ROWS rows in
#     pagedattn_kernels.matmul_16bit (32, the default) and in F.linear (0), DENSE_LIMITS in
#     turn, DENSE_ROUNDS (2) times          -> ..._bf16_dense{32,0}_r{1,2}.json
#   bash scripts/gpu_fp8.sh plan               # ~6 min, carrying .gpu_data
#     the fp8 and the bf16 run with decode plans where they pay (the engine's default) and
#     without (PAGEDKV_DECODE_PLAN=0); PLAN_RUNS picks them  -> ..._{fp8,bf16}_plan{1,0}.json
#   bash scripts/gpu_fp8.sh rows256            # ~1 min, carrying .gpu_data
#     the fp8 run with PAGEDKV_FP8_MATMUL_MAX_ROWS=256: pagedattn_kernels.fp8_matmul for the
#     decode matmuls of 129-256 rows too (torch._scaled_mm there by default)
#                                                  -> ..._real_fp8_rows256.json
#   bash scripts/gpu_fp8.sh splits             # ~4 min
#     scripts/decode_fp8_engine_shapes.py --automatic-configs at small batches
#     (SPLIT_SHAPES): decode attention on the bf16 and fp8 caches with the automatic split
#     count and forced ones (SPLIT_SET, 2,4,8,16)  -> decode_splits.json
#   bash scripts/gpu_fp8.sh order              # ~4 min, carrying .gpu_data
#     the fp8 and the bf16 run with decode attention programs longest context first (the
#     engine's default) and in batch order (PAGEDKV_DECODE_ORDER=0); ORDER_RUNS picks them
#                                                  -> ..._{fp8,bf16}_order{1,0}.json
#   bash scripts/gpu_fp8.sh realcontexts       # ~1 min, carrying .gpu_data
#     decode attention over real ShareGPT contexts at 32-768 sequences, in batch order and
#     longest first, both caches                   -> decode_realcontexts.json
#   bash scripts/gpu_fp8.sh plans              # ~3 min, carrying .gpu_data
#     decode attention by plans (plan_decode) against the automatic splits over real ShareGPT
#     contexts at 16-768 sequences, both caches, plans PLAN_CHUNKS (128,128x2: min chunk 128,
#     lanes x1 and x2), PLAN_ORDER=1: batch order and longest first; then the fp8 cache's
#     narrow and one-warp tiles with plans at PLAN_TILE_SHAPES (16x0,32x0,64x0; empty: none)
#                                                  -> decode_plans*.json
#   bash scripts/gpu_fp8.sh bigshapes          # ~4 min
#     scripts/decode_fp8_engine_shapes.py at the large batches of the run's decode bands
#     (BIG_SHAPES, 192x700,384x600,768x450): every tile configuration on the fp8 cache
#                                                  -> decode_bigshapes.json
#   bash scripts/gpu_fp8.sh onewarp            # ~5 min, carrying .gpu_data
#     the fp8 run with the decode kernel's one-warp tiles (the launcher's threshold, 512
#     (sequence, KV head) pairs) and without them (PAGEDATTN_FP8_ONE_WARP_PAIRS=1000000000),
#     interleaved twice: each round's ratio and the decode bands (the tiles' share of the run)
#                                                  -> ..._fp8_onewarp{1,0}_r{1,2}.json
#   ENV_AB="base: x:VAR=1" bash scripts/gpu_fp8.sh envab   # ~1 min a run, carrying .gpu_data
#     runs under each setting of ENV_AB (NAME:VAR=VALUE[,...]), ENV_AB_ROUNDS (2) rounds
#     interleaved, of each of ENV_AB_KINDS (fp8; bf16): output tok/s and the decode bands
#   bash scripts/gpu_fp8.sh stepab             # ~6 min
#     a decode step (Llama-3-8B shape, ~900 tokens, 8-128 sequences) under STEP_AB's settings,
#     fp8 and bf16, interleaved twice; by default SwiGLU's activation made in the gate/up
#     matmul's kernel (the engine's default) against the two kernels
#     (PAGEDKV_FUSED_GATE_UP_SILU=0): the median ms of each, printed
#   bash scripts/gpu_fp8.sh profile            # ~3 min
#     `python -m pagedkv.bench.decode_step --profile-steps 4` at 16 and 48 sequences of ~900
#     tokens, bf16 then fp8: a decode step's GPU time by kernel -> decode_profile_*.log
#   bash scripts/gpu_fp8.sh prefill            # ~2 min
#     `python -m pagedkv.bench.decode_step --prefill-prompt-len 246 --profile-steps 2`: a
#     prefill pass of 16,384 tokens by kernel, bf16 then fp8 -> prefill_profile_*.log
#   bash scripts/gpu_fp8.sh pdl                # ~4 min
#     a decode step at 16, 64 and 256 sequences of ~900 tokens with PAGEDATTN_PDL=1 and =0,
#     interleaved twice, bf16 then fp8 -> decode_pdl{1,0}_{bf16,fp8}_{1,2}.json/.log
#   bash scripts/gpu_fp8.sh ropecache          # ~4 min
#     a decode step at 16, 64 and 256 sequences with the rotary embedding in the cache-write
#     kernel (PAGEDKV_FUSED_ROPE_CACHE=1) and apart (=0): fp8 interleaved twice, bf16 once;
#     then the fp8 step at 16 by kernel           -> decode_profile_fp8_ropecache.log
#   bash scripts/gpu_fp8.sh fp8swap            # ~2 min, carrying .gpu_data
#     the fp8 run with PAGEDKV_FP8_MATMUL_MAX_ROWS=${SWAP_ROWS:-0}: torch._scaled_mm for every
#     matmul, against the engine's pagedattn_kernels.fp8_matmul up to 128 rows
#                                                  -> ..._real_fp8_swap.json
#   bash scripts/gpu_fp8.sh diagnose           # ~8 min
#     scripts/prefill_variants.py --gap (the prefill kernel's remaining gap to a minimal TMA
#     kernel) and scripts/decode_fp8_variants.py (why decode on an fp8 cache stays at ~46% of
#     the copy bandwidth)                        -> prefill_gap.json, decode_fp8_variants.json
#   bash scripts/gpu_fp8.sh weightonly         # ~3 min
#     scripts/fp8_weight_only_gemm.py: a weight-only fp8 GEMM (e4m3 weights widened in the
#     kernel, bf16 activations) against bf16 F.linear and fp8_linear at M = 1-128, the four
#     Llama-3-8B linear shapes                    -> fp8_weight_only_gemm.json
#   bash scripts/gpu_fp8.sh blas               # ~2 min
#     scripts/bf16_stream_gemm.py --blas: bf16 F.linear through cuBLAS (torch's default) and
#     through cuBLASLt (TORCH_BLAS_PREFER_CUBLASLT=1) on the four Llama-3-8B linear shapes at
#     BLAS_M rows (1-1,024)                        -> bf16_blas.json
#     For the whole step or run: STEP_AB="cublas: lt:TORCH_BLAS_PREFER_CUBLASLT=1"
#     STEP_KINDS=bf16 ... stepab, or ENV_AB (the same settings) ENV_AB_KINDS=bf16 ... envab
#   bash scripts/gpu_fp8.sh fp8exact           # ~2 min, carrying .gpu_data
#     the fp8 run without fast accumulation (PAGEDKV_FP8_FAST_ACCUM=0: torch._scaled_mm and
#     pagedattn_kernels.fp8_matmul)
#                                                  -> ..._real_fp8_exact.json
#   bash scripts/gpu_fp8.sh accuracy           # ~1 min, with the embedded model joined
#     `python -m pagedkv.bench.fp8_accuracy` in bf16 on the GPU: greedy agreement of fp8 KV,
#     fp8 weights and both with bf16, and of both with the LM head in fp8 (--quantize-lm-head),
#     64 prompts x 64 tokens (ACC_VARIANTS picks others) -> fp8_accuracy_smollm2_bf16.json
#
# Prepare on a CPU machine first (the GPU machine has neither the dataset nor the tokenizer):
#   python -m pagedkv.bench.paper_gpu prepare --num-prompts 1000 \
#       --output-json .gpu_data/sharegpt_1000.json            # the same 1,000 as --dataset sharegpt
#   python -m pagedkv.bench.fp8_accuracy --num-prompts 64 --max-tokens 1 --variants control \
#       --save-prompts .gpu_data/fp8_prompts.json              # the prompts' token ids
#   git rev-parse --short HEAD > .gpu_commit
# and for `accuracy` the embedded GGUF in parts, as scripts/gpu_notebooks.sh describes
# (`bash scripts/fetch_notebook_wheels.sh`, then calls `bash scripts/gpu_notebooks.sh receive`
# carrying .nbgguf/1, .nbgguf/2, ... just before `bash scripts/gpu_fp8.sh accuracy` carrying the
# last part and .gpu_data).
#
# CPU smoke run (tiny sizes, the embedded model, no GPU; a minute or two):
#   SMOKE=1 PYTHON=.venv/bin/python SKIP_WHEELS=1 bash scripts/gpu_fp8.sh kernels bf16 fp8 accuracy
# Tunables: PROFILE_BATCHES (16,48), PROFILE_CONTEXT (900), PREFILL_PROMPT_LEN (246), PROFILE_LINES (120), PDL_BATCHES (16,64,256; pdl and ropecache), BASELINES_BF16 (1; 0: no transformers runs), RATIO_ROUNDS (2), WEIGHTONLY_BUDGET (180 s), NUM_PROMPTS (1000), HF_N (128), HF_BS (64,128), HF_TIME_LIMIT (90), MAX_NUM_SEQS
# (1024), MAX_BATCHED (16384), RUN_TIMEOUT (540), EXTRA (more throughput options).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
PYTHON="${PYTHON:-python3}"
SMOKE="${SMOKE:-0}"
mkdir -p "$OUT"
parts=("$@")
[[ ${#parts[@]} -eq 0 ]] && parts=(tests kernels bf16 fp8 accuracy)  # diagnose, weightonly: on demand
source scripts/gpu_env.sh || exit 1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 || echo "no nvidia-smi"
  "$PYTHON" -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
  echo "commit ${PAGEDKV_COMMIT:-unknown}"
} > "$OUT/fp8_env.txt" 2>&1
cat "$OUT/fp8_env.txt"

REQS=.gpu_data/sharegpt_1000.json
PROMPTS=.gpu_data/fp8_prompts.json
NUM_PROMPTS="${NUM_PROMPTS:-1000}"
if [[ -f $REQS ]]; then
  workload=(--dataset "$REQS"); name=llama3_8b_sharegpt_real
  have=$("$PYTHON" -c "import json,sys; print(len(json.load(open(sys.argv[1]))['requests']))" "$REQS")
  (( have < NUM_PROMPTS )) && echo "note: $REQS holds $have requests, fewer than NUM_PROMPTS=$NUM_PROMPTS"
else
  workload=(--workload sharegpt); name=llama3_8b_sharegpt_like
  echo "note: no $REQS: the ShareGPT-like lengths (see the header for how to make the file)"
fi
if [[ "$SMOKE" == 1 ]]; then  # the embedded model on the CPU, a few tokens
  model=(--device cpu --kv-cache-gb 0.1)
  workload=(--input-len 16 --output-len 8); name=smoke_smollm2_cpu
  sizes=(--num-prompts 4 --max-model-len 1024 --max-num-seqs 4)
  baselines=(--baseline hf --hf-batch-sizes 4 --hf-num-prompts 2 --hf-time-limit 5)
else
  model=(--model meta-llama/Meta-Llama-3-8B --load-format dummy --dtype bfloat16)
  sizes=(--num-prompts "$NUM_PROMPTS" --max-model-len 2048 --max-num-seqs "${MAX_NUM_SEQS:-1024}"
         --max-num-batched-tokens "${MAX_BATCHED:-16384}")
  baselines=(--baseline hf --baseline hf-cb --hf-time-limit "${HF_TIME_LIMIT:-90}"
             --hf-num-prompts "${HF_N:-128}" --hf-batch-sizes "${HF_BS:-64,128}")
fi

throughput() {  # throughput SUFFIX [options...]
  local suffix=$1; shift
  local json="$OUT/throughput_${name}${suffix}.json" log="$OUT/throughput_${name}${suffix}.log"
  echo "=== throughput${suffix:- (bf16)}: ${model[*]} ${workload[*]} $*"
  # shellcheck disable=SC2086  # EXTRA is a list of options
  timeout "${RUN_TIMEOUT:-540}" "$PYTHON" -m pagedkv.bench.throughput "${model[@]}" "${sizes[@]}" \
    "${workload[@]}" --workload-seed 0 "$@" ${EXTRA:-} --output-json "$json" 2>&1 \
    | grep -v -E "it/s\]|req/s\]|s/req\]" | tee "$log" | grep -v -E "^\s*$" | tail -20
  [[ -f $json ]] && "$PYTHON" -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('output_tok_s','roofline_frac','decode_step_ms','decode_step_bound_ms','num_gpu_blocks','kv_cache_dtype','quantization','workload','ratio_vs_hf')})" "$json"
}

kernel_bench() {  # kernel_bench LOG JSON TIMEOUT LINES KEYS [benchmark options...]
  local log="$OUT/$1.log" json="$OUT/$2.json" limit=$3 lines=$4 keys=$5; shift 5
  timeout "$limit" "$PYTHON" -m pagedkv.bench.kernels "$@" --commit "${PAGEDKV_COMMIT:-}" > "$log" 2>&1
  echo "    exit $?"
  tail -1 "$log" > "$json"
  grep -E "^($lines)" "$log" | tail -30
  "$PYTHON" -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if k.startswith(($keys))})" "$json" \
    || echo "$json: no JSON line (see $log)"
}

engine_shapes() {  # engine_shapes TAG [decode_fp8_engine_shapes.py options...]: -> TAG.json/.log
  local tag=$1; shift
  timeout 300 "$PYTHON" scripts/decode_fp8_engine_shapes.py "$@" --budget-s 240 \
    --commit "${PAGEDKV_COMMIT:-}" --output-json "$OUT/$tag.json" > "$OUT/$tag.log" 2>&1
  echo "    exit $?"
  grep -E "B=|best|rror" "$OUT/$tag.log" | grep -v " run " | sed 's/^.*INFO[^B]*//' | tail -60
}

step_profiles() {  # step_profiles TAG TITLE [decode_step options...]: bf16 then fp8 weights
  # and cache, PDL off (under it a kernel's time includes its wait for the one before)
  local tag=$1 title=$2 kind extra; shift 2
  for kind in bf16 fp8; do
    extra=(); [[ $kind == fp8 ]] && extra=(--kv-cache-dtype fp8 --quantization fp8)
    echo "=== $title ($kind)"
    PAGEDATTN_PDL=0 timeout 240 "$PYTHON" -m pagedkv.bench.decode_step "$@" \
      "${model[@]}" "${extra[@]}" --max-model-len 2048 --max-num-seqs "${MAX_NUM_SEQS:-1024}" \
      --max-num-batched-tokens "${MAX_BATCHED:-16384}" \
      --output-json "$OUT/${tag}_${kind}.json" > "$OUT/${tag}_${kind}.log" 2>&1
    echo "    exit $?"
    grep -vE " INFO |Warn|warn_once" "$OUT/${tag}_${kind}.log" | head -"${PROFILE_LINES:-120}"
  done
}

ab_runs() {  # ab_runs VAR TAG "KIND:VALUE ..." [AUTO]: each run with VAR=VALUE ("auto": AUTO),
  # -> throughput_NAME_KIND_TAGVALUE.json in turn (a call cut short keeps the finished ones),
  # then each run's figures and each fp8 run's ratio to each bf16 run
  local var=$1 tag=$2 runs=$3 auto=${4:-} keep_out=$OUT kind value extra
  OUT=/tmp/pagedkv-ab; mkdir -p "$OUT"
  for run in $runs; do
    IFS=: read -r kind value <<< "$run"
    [[ $value == auto ]] && value=$auto
    extra=(); [[ $kind == fp8 ]] && extra=(--kv-cache-dtype fp8 --quantization fp8)
    (export "$var=$value"; throughput "_${kind}_${tag}${value}" "${extra[@]}") | grep -E "^\{'output"
    cp "$OUT/throughput_${name}_${kind}_${tag}${value}.json" "$keep_out"/ 2>/dev/null
  done
  OUT=$keep_out
  "$PYTHON" - "$OUT" "$name" "$tag" <<'PY'
import glob, json, re, sys
out, name, tag = sys.argv[1:4]
runs = {}
for path in sorted(glob.glob(f"{out}/throughput_{name}_*_{tag}*.json")):
    m = re.search(rf"_(fp8|bf16)_{tag}(\w+)\.json$", path)
    if not m:
        continue
    runs[m.groups()] = d = json.load(open(path))
    bands = ", ".join(f"{b}: {v['seconds']:.2f}" for b, v in d.get("decode_host_gap_by_batch", {}).items())
    print(f"{m[1]} {tag}={m[2]}: {d['output_tok_s']:,.0f} output tok/s, roofline "
          f"{d.get('roofline_frac') or 0:.1%}, {d['seconds']:.2f} s (prefill passes "
          f"{d.get('mixed_seconds') or 0:.2f} s); decode bands (s) {bands}")
for (kind, value), d in runs.items():
    for (other, bvalue), b in runs.items():
        if kind == "fp8" and other == "bf16":
            print(f"fp8 {tag}={value} / bf16 {tag}={bvalue}: "
                  f"{d['output_tok_s'] / b['output_tok_s']:.3f}x (goal 1.5x)")
PY
}

for part in "${parts[@]}"; do
  case "$part" in
    tests)
      if [[ "$SMOKE" == 1 ]]; then echo "=== tests: gpu tests need a GPU (skipped in a smoke run)"; continue; fi
      echo "=== gpu tests (fp8)"
      timeout 300 "$PYTHON" -m pytest -m gpu tests/kernels/test_fp8.py tests/kernels/test_fused_fp8.py \
        tests/kernels/test_fp8_matmul.py tests/engine/test_fp8.py \
        -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/fp8_gpu_tests.log" | tail -15
      ;;
    kernels)
      echo "=== kernel benchmark with the fp8 rows"
      if [[ "$SMOKE" == 1 ]]; then kargs=(--quick --fp8-only); else kargs=(--fp8 --budget-s 200); fi
      kernel_bench kernels_fp8 kernels 420 "decode fp8|prefill fp8|prefill N|gemm layer" \
        "'gemm_fp8', 'decode_fp8', 'prefill_fp8', 'prefill_vs'" "${kargs[@]}"
      ;;
    gemm)
      # The fp8 GEMM rows and the quantization kernels that feed them (a program per row
      # against tiled), without the rest of the kernel benchmark
      echo "=== fp8 GEMMs and quantization kernels"
      if [[ "$SMOKE" == 1 ]]; then kargs=(--quick --gemm-only); else kargs=(--gemm-only); fi
      kernel_bench kernels_gemm kernels_fp8_gemm 240 "quant M|gemm layer" \
        "'gemm_fp8', 'quant_', 'silu_fp8'" "${kargs[@]}"
      ;;
    bf16)
      bf16_baselines=("${baselines[@]}")
      [[ "${BASELINES_BF16:-1}" == 0 ]] && bf16_baselines=()
      throughput "" "${bf16_baselines[@]}"
      ;;
    fp8)
      fp8_baselines=()
      [[ "${BASELINES_FP8:-0}" == 1 ]] && fp8_baselines=("${baselines[@]}")
      throughput _fp8 --kv-cache-dtype fp8 --quantization fp8 "${fp8_baselines[@]}"
      ;;
    ratio)
      # Issue 20's fp8 goal as a same-call comparison: fp8 weights + fp8 KV, then bf16, no
      # transformers runs, RATIO_ROUNDS (2) times interleaved; each round's ratio, then their
      # median and spread. RATIO_KINDS (fp8 bf16) lists the runs of a round: fp8lm is fp8 with
      # --quantize-lm-head. The logs stay in /tmp and only the last round's JSONs come back (a
      # call returns 8 files), with ratio_summary.json: every run's figures.
      keep_out=$OUT; OUT=/tmp/pagedkv-ratio; mkdir -p "$OUT"
      kinds=(${RATIO_KINDS:-fp8 bf16})
      for ((round = 1; round <= ${RATIO_ROUNDS:-2}; round++)); do
        for kind in "${kinds[@]}"; do
          case $kind in
            fp8) extra=(--kv-cache-dtype fp8 --quantization fp8) ;;
            fp8lm) extra=(--kv-cache-dtype fp8 --quantization fp8 --quantize-lm-head) ;;
            *) extra=() ;;
          esac
          throughput "_${kind}_r$round" "${extra[@]}" | grep -E "^\{'output"
        done
      done
      for kind in "${kinds[@]}"; do
        cp "$OUT/throughput_${name}_${kind}_r${RATIO_ROUNDS:-2}.json" "$keep_out"/ 2>/dev/null
      done
      "$PYTHON" - "$OUT" "$name" "${RATIO_ROUNDS:-2}" "$keep_out/ratio_summary.json" "${kinds[@]}" <<'PY'
import json, statistics, sys
out, name, rounds, summary, *kinds = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], *sys.argv[5:]
runs, ratios = {}, {k: [] for k in kinds if k != "bf16"}
for r in range(1, rounds + 1):
    for k in kinds:
        try:
            d = json.load(open(f"{out}/throughput_{name}_{k}_r{r}.json"))
        except OSError as exc:
            print(f"round {r} {k}: no figures ({exc})")
            continue
        runs[f"{k}_r{r}"] = {f: d.get(f) for f in ("output_tok_s", "roofline_frac", "seconds",
                             "mixed_seconds", "decode_seconds", "num_gpu_blocks",
                             "quantize_lm_head", "roofline_serial_frac")}
        runs[f"{k}_r{r}"]["bands_s"] = {b: v["seconds"] for b, v in d.get("decode_host_gap_by_batch", {}).items()}
    bf16 = runs.get(f"bf16_r{r}")
    for k in ratios:
        if bf16 and f"{k}_r{r}" in runs:
            ratio = runs[f"{k}_r{r}"]["output_tok_s"] / bf16["output_tok_s"]
            ratios[k].append(ratio)
            print(f"round {r}: {k} {runs[f'{k}_r{r}']['output_tok_s']:,.0f} / bf16 {bf16['output_tok_s']:,.0f} output tok/s = {ratio:.3f}x")
for k, rs in ratios.items():
    if rs:
        print(f"{k} / bf16: median {statistics.median(rs):.3f}x, spread {min(rs):.3f}-{max(rs):.3f}x over {len(rs)} rounds (goal 1.5x)")
for key, run in runs.items():
    print(f"{key}: {run['output_tok_s']:,.0f} tok/s, {run['seconds']:.2f} s (prompt passes "
          f"{run['mixed_seconds'] or 0:.2f}), roofline {run['roofline_frac'] or 0:.1%}, bands {run['bands_s']}")
json.dump({"runs": runs, "ratios": ratios}, open(summary, "w"), indent=1)
PY
      OUT=$keep_out
      ;;
    dense)
      # bf16 linear layers of at most PAGEDKV_MATMUL_16BIT_MAX_ROWS rows through
      # pagedattn_kernels.matmul_16bit (the engine's default, 32) against F.linear for all
      # (0): DENSE_LIMITS in turn, DENSE_ROUNDS (2) times; each round's ratio to limit 0
      keep_out=$OUT; OUT=/tmp/pagedkv-dense; mkdir -p "$OUT"
      for ((round = 1; round <= ${DENSE_ROUNDS:-2}; round++)); do
        for limit in ${DENSE_LIMITS:-32 0}; do
          PAGEDKV_MATMUL_16BIT_MAX_ROWS=$limit throughput "_bf16_dense${limit}_r$round" \
            | grep -E "^\{'output"
          cp "$OUT/throughput_${name}_bf16_dense${limit}_r$round.json" "$keep_out"/ 2>/dev/null
        done
      done
      OUT=$keep_out
      "$PYTHON" - "$OUT" "$name" <<'PY'
import glob, json, re, sys
out, name = sys.argv[1:3]
runs = {}
for path in sorted(glob.glob(f"{out}/throughput_{name}_bf16_dense*_r*.json")):
    limit, rnd = map(int, re.search(r"_dense(\d+)_r(\d+)\.json$", path).groups())
    runs[limit, rnd] = d = json.load(open(path))
    bands = ", ".join(f"{b}: {v['seconds']:.3f}" for b, v in d.get("decode_host_gap_by_batch", {}).items())
    print(f"limit {limit} round {rnd}: {d['output_tok_s']:,.0f} output tok/s, roofline "
          f"{d.get('roofline_frac') or 0:.1%}, {d['seconds']:.2f} s; decode bands (s) {bands}")
for (limit, rnd), d in sorted(runs.items()):
    base = runs.get((0, rnd))
    if limit and base:
        print(f"round {rnd}: limit {limit} / limit 0 = {d['output_tok_s'] / base['output_tok_s']:.4f}x")
PY
      ;;
    order)
      # decode attention programs longest context first (the engine's default) against batch
      # order (PAGEDKV_DECODE_ORDER=0): ORDER_RUNS lists KIND:ORDER, run in turn
      ab_runs PAGEDKV_DECODE_ORDER order "${ORDER_RUNS:-fp8:1 bf16:1 fp8:0 bf16:0}"
      ;;
    plan)
      # decode attention by plans where they pay (the engine's default) against the
      # longest-first order and automatic splits everywhere (PAGEDKV_DECODE_PLAN=0): PLAN_RUNS
      # lists KIND:ON, run in turn
      ab_runs PAGEDKV_DECODE_PLAN plan "${PLAN_RUNS:-fp8:1 fp8:0 bf16:1 bf16:0}"
      ;;
    rows256)
      PAGEDKV_FP8_MATMUL_MAX_ROWS=256 throughput _fp8_rows256 --kv-cache-dtype fp8 --quantization fp8
      ;;
    onewarp)
      keep_out=$OUT; OUT=/tmp/pagedkv-onewarp; mkdir -p "$OUT"
      for round in 1 2; do
        for one in 1 0; do  # 1: the launcher's own threshold; 0: a threshold never reached
          if [[ $one == 1 ]]; then unset PAGEDATTN_FP8_ONE_WARP_PAIRS
          else export PAGEDATTN_FP8_ONE_WARP_PAIRS=1000000000; fi
          throughput "_fp8_onewarp${one}_r$round" --kv-cache-dtype fp8 --quantization fp8 \
            | grep -E "^\{'output|decode batches"
          cp "$OUT/throughput_${name}_fp8_onewarp${one}_r$round.json" "$keep_out"/ 2>/dev/null
        done
      done
      unset PAGEDATTN_FP8_ONE_WARP_PAIRS; OUT=$keep_out
      "$PYTHON" - "$OUT" "$name" <<'PY'
import json, sys
out, name = sys.argv[1], sys.argv[2]
for r in (1, 2):
    try:
        on, off = (json.load(open(f"{out}/throughput_{name}_fp8_onewarp{k}_r{r}.json"))
                   for k in (1, 0))
    except OSError as exc:
        print(f"round {r}: no figures ({exc})")
        continue
    bands = {b: (on["decode_host_gap_by_batch"][b]["seconds"],
                 off["decode_host_gap_by_batch"][b]["seconds"])
             for b in on.get("decode_host_gap_by_batch", {}) if b in off.get("decode_host_gap_by_batch", {})}
    print(f"round {r}: one warp {on['output_tok_s']:,.0f} / without {off['output_tok_s']:,.0f} "
          f"output tok/s = {on['output_tok_s'] / off['output_tok_s']:.3f}x; decode bands (s) "
          + ", ".join(f"{b}: {a:.2f} / {c:.2f}" for b, (a, c) in bands.items()))
PY
      ;;
    envab)
      # runs under each of ENV_AB's settings in turn, ENV_AB_ROUNDS (2) rounds interleaved:
      # settings separated by spaces, each NAME:VAR=VALUE[,VAR=VALUE...] (NAME: alone: the
      # defaults), e.g. "base: onewarp:PAGEDATTN_FP8_ONE_WARP_PAIRS=1"; ENV_AB_KINDS (fp8)
      # names the runs: fp8 (weights and cache) and/or bf16; then each run's figures and its
      # decode bands (the JSONs copied to $OUT: at most 8 come back from a device call)
      keep_out=$OUT; OUT=/tmp/pagedkv-envab; mkdir -p "$OUT"
      for round in $(seq 1 "${ENV_AB_ROUNDS:-2}"); do
        for setting in ${ENV_AB:?ENV_AB: settings to compare}; do
          for kind in ${ENV_AB_KINDS:-fp8}; do
            label=${setting%%:*}; vars=${setting#*:}
            extra=(); [[ $kind == fp8 ]] && extra=(--kv-cache-dtype fp8 --quantization fp8)
            (IFS=,; for kv in $vars; do [[ -n $kv ]] && export "${kv?}"; done
             throughput "_${kind}_${label}_r$round" "${extra[@]}" \
               | grep -E "^\{'output")
            cp "$OUT/throughput_${name}_${kind}_${label}_r$round.json" "$keep_out"/ 2>/dev/null
          done
        done
      done
      OUT=$keep_out
      "$PYTHON" - "$OUT" "$name" <<'PY'
import glob, json, re, sys
out, name = sys.argv[1], sys.argv[2]
for path in sorted(glob.glob(f"{out}/throughput_{name}_*_*_r*.json")):
    d = json.load(open(path))
    label = re.search(rf"{name}_(\w+)\.json$", path)[1]
    bands = ", ".join(f"{b}: {v['gpu_ms_mean']:.2f} ms {v['seconds']:.2f} s"
                      for b, v in d.get("decode_host_gap_by_batch", {}).items())
    print(f"{label}: {d['output_tok_s']:,.0f} output tok/s, {d['seconds']:.2f} s, prefill "
          f"{d.get('mixed_seconds') or 0:.2f} s; {bands}")
PY
      ;;
    stepab)
      # A decode step under each of STEP_AB's settings (ENV_AB's form; default: SwiGLU's
      # activation in the gate/up matmul's kernel, and apart), STEP_KINDS (fp8 bf16),
      # STEP_ROUNDS (2) rounds interleaved, at STEP_BATCHES (8,32,64,128) sequences of
      # STEP_CONTEXT (900) tokens: the median step of each (logs in /tmp, figures printed)
      if [[ "$SMOKE" == 1 ]]; then echo "=== stepab: needs a GPU (skipped in a smoke run)"; continue; fi
      for round in $(seq 1 "${STEP_ROUNDS:-2}"); do
        for kind in ${STEP_KINDS:-fp8 bf16}; do
          extra=(); [[ $kind == fp8 ]] && extra=(--kv-cache-dtype fp8 --quantization fp8)
          for setting in ${STEP_AB:-fused: apart:PAGEDKV_FUSED_GATE_UP_SILU=0}; do
            label=${setting%%:*}; vars=${setting#*:}; tag="decode_stepab_${kind}_${label}_$round"
            (IFS=,; for kv in $vars; do [[ -n $kv ]] && export "${kv?}"; done
             timeout 200 "$PYTHON" -m pagedkv.bench.decode_step \
               --batch-sizes "${STEP_BATCHES:-8,32,64,128}" --context "${STEP_CONTEXT:-900}" \
               --steps 32 --warmup-steps 4 "${model[@]}" "${extra[@]}" > "/tmp/$tag.log" 2>&1)
            echo "$kind $label round $round (exit $?): $(grep -oE "batch +[0-9]+: decode step [0-9.]+ ms \(median [0-9.]+" "/tmp/$tag.log" \
              | sed -E 's/batch +([0-9]+): decode step [0-9.]+ ms \(median ([0-9.]+)/\1: \2/' | paste -sd' ')"
          done
        done
      done
      ;;
    splits)
      if [[ "$SMOKE" == 1 ]]; then echo "=== splits: needs a GPU (skipped in a smoke run)"; continue; fi
      echo "=== decode attention at small batches: automatic against forced split counts"
      engine_shapes decode_splits --automatic-configs --splits "${SPLIT_SET:-2,4,8,16}" \
        --shapes "${SPLIT_SHAPES:-16x900,32x900,48x900,64x700,128x500}"
      ;;
    realcontexts)
      # decode attention over the contexts of real ShareGPT runs (live requests' lengths, from
      # .gpu_data/sharegpt_1000.json), in batch order and longest first, both caches, the
      # automatic tiles and splits
      if [[ "$SMOKE" == 1 ]]; then echo "=== realcontexts: needs a GPU (skipped in a smoke run)"; continue; fi
      echo "=== decode attention over real ShareGPT contexts"
      engine_shapes decode_realcontexts --shapes "${REAL_SHAPES:-32x0,64x0,128x0,256x0,384x0,768x0}" \
        --lengths .gpu_data/sharegpt_1000.json --longest-first --automatic-configs --splits none
      ;;
    plans)
      # decode plans (chunks balanced over the batch's real contexts, longest first) against
      # the automatic splits, over real ShareGPT contexts, both caches, PLAN_CHUNKS as min
      # chunks; then the fp8 cache's other tiles with plans at the small batches
      if [[ "$SMOKE" == 1 ]]; then echo "=== plans: needs a GPU (skipped in a smoke run)"; continue; fi
      echo "=== decode plans: outputs against the automatic path"
      timeout 120 "$PYTHON" scripts/decode_fp8_engine_shapes.py --check 2>&1 | grep -cE " ok$" \
        | sed 's/^/    ok: /'
      echo "=== decode plans over real ShareGPT contexts"
      engine_shapes decode_plans --shapes "${PLAN_SHAPES:-16x0,32x0,64x0,128x0,256x0,384x0,768x0}" \
        --lengths .gpu_data/sharegpt_1000.json --automatic-configs --splits none \
        --plan "${PLAN_CHUNKS:-128,128x2}" ${PLAN_ORDER:+--longest-first}
      [[ -z ${PLAN_TILE_SHAPES-x} ]] && continue  # PLAN_TILE_SHAPES= : no tile sweep
      echo "=== decode plans with the fp8 cache's narrow and one-warp tiles at small batches"
      engine_shapes decode_plans_tiles --shapes "${PLAN_TILE_SHAPES:-16x0,32x0,64x0}" \
        --lengths .gpu_data/sharegpt_1000.json --splits none --configs 64/2/3/4,32/1/3/8 \
        --bf16-configs 64/4/2/2 --plan "${PLAN_CHUNKS:-128,128x2}"
      ;;
    bigshapes)
      if [[ "$SMOKE" == 1 ]]; then echo "=== bigshapes: needs a GPU (skipped in a smoke run)"; continue; fi
      echo "=== decode attention at large batches: every tile configuration"
      engine_shapes decode_bigshapes --shapes "${BIG_SHAPES:-192x700,384x600,768x450}"
      ;;
    profile)
      # A decode step by kernel family at small and mid batches, bf16 then fp8 weights and
      # cache (the attention's share before and after the per-sequence flash-decoding split);
      # without PDL, under which a kernel's time includes its wait for the one before
      if [[ "$SMOKE" == 1 ]]; then echo "=== profile: needs a GPU (skipped in a smoke run)"; continue; fi
      step_profiles decode_profile "decode step profile" --batch-sizes "${PROFILE_BATCHES:-16,48}" \
        --context "${PROFILE_CONTEXT:-900}" --steps 16 --warmup-steps 4 --profile-steps 4
      ;;
    prefill)
      # A prefill pass of the run's size (16,384 tokens of prompts of the real ShareGPT mean,
      # 246 tokens) by kernel family, bf16 then fp8 weights and cache, PDL off
      if [[ "$SMOKE" == 1 ]]; then echo "=== prefill: needs a GPU (skipped in a smoke run)"; continue; fi
      step_profiles prefill_profile "prefill pass profile" \
        --prefill-prompt-len "${PREFILL_PROMPT_LEN:-246}" --prefill-passes 4 --profile-steps 2
      ;;
    pdl)
      # A decode step with and without programmatic dependent launch (PAGEDATTN_PDL=1/0), bf16
      # then fp8 weights and cache, the two interleaved twice: one engine build each, the same
      # batches, only the kernels' launch differs
      if [[ "$SMOKE" == 1 ]]; then echo "=== pdl: needs a GPU (skipped in a smoke run)"; continue; fi
      for kind in bf16 fp8; do
        extra=(); [[ $kind == fp8 ]] && extra=(--kv-cache-dtype fp8 --quantization fp8)
        for round in 1 2; do
          for pdl in 1 0; do
            tag="decode_pdl${pdl}_${kind}_${round}"
            PAGEDATTN_PDL=$pdl timeout 200 "$PYTHON" -m pagedkv.bench.decode_step \
              --batch-sizes "${PDL_BATCHES:-16,64,256}" --context 900 --steps 32 --warmup-steps 4 \
              "${model[@]}" "${extra[@]}" --output-json "$OUT/$tag.json" > "$OUT/$tag.log" 2>&1
            echo "$kind PAGEDATTN_PDL=$pdl round $round (exit $?): $(tail -1 "$OUT/$tag.log")"
          done
        done
      done
      ;;
    ropecache)
      # The rotary embedding fused into the cache write (PAGEDKV_FUSED_ROPE_CACHE=1, the
      # default) against the two kernels (=0): a decode step of the fp8 model interleaved twice,
      # bf16 once, logs in /tmp and the figures printed (a call returns 8 files); then the fp8
      # step at 16 sequences by kernel with the fused kernel (without PDL, whose overlapping
      # kernels would blur the times)
      if [[ "$SMOKE" == 1 ]]; then echo "=== ropecache: needs a GPU (skipped in a smoke run)"; continue; fi
      for kind in fp8 fp8 bf16; do
        extra=(); [[ $kind == fp8 ]] && extra=(--kv-cache-dtype fp8 --quantization fp8)
        for fuse in 1 0; do
          tag="decode_ropecache${fuse}_${kind}"
          PAGEDKV_FUSED_ROPE_CACHE=$fuse timeout 200 "$PYTHON" -m pagedkv.bench.decode_step \
            --batch-sizes "${PDL_BATCHES:-16,64,256}" --context 900 --steps 32 --warmup-steps 4 \
            "${model[@]}" "${extra[@]}" > "/tmp/$tag.log" 2>&1
          echo "$kind PAGEDKV_FUSED_ROPE_CACHE=$fuse (exit $?): $(tail -1 "/tmp/$tag.log")"
        done
      done
      PAGEDATTN_PDL=0 timeout 200 "$PYTHON" -m pagedkv.bench.decode_step --batch-sizes 16 --context 900 \
        --steps 16 --warmup-steps 4 --profile-steps 4 "${model[@]}" --kv-cache-dtype fp8 \
        --quantization fp8 > "$OUT/decode_profile_fp8_ropecache.log" 2>&1
      grep -E "GPU time|^    [a-z]|_kernel" "$OUT/decode_profile_fp8_ropecache.log" | head -24
      ;;
    fp8swap)
      # The fp8 run again with pagedattn_kernels.fp8_matmul taking the matmuls of up to
      # SWAP_ROWS rows (default 0: torch._scaled_mm for all, against the engine's 128).
      PAGEDKV_FP8_MATMUL_MAX_ROWS="${SWAP_ROWS:-0}" \
        throughput _fp8_swap --kv-cache-dtype fp8 --quantization fp8
      ;;
    fp8exact)
      # The fp8 run without fast accumulation (PAGEDKV_FP8_FAST_ACCUM=0)
      PAGEDKV_FP8_FAST_ACCUM=0 \
        throughput _fp8_exact --kv-cache-dtype fp8 --quantization fp8
      ;;
    accuracy)
      if [[ "$SMOKE" == 1 ]]; then
        acc=(--device cpu --num-prompts 2 --max-tokens 4 --kv-cache-gb 0.05
             --variants control,kv_fp8,weights_fp8,kv_and_weights_fp8)
        acc_name=smoke_cpu
      else
        source scripts/gpu_embedded_model.sh || { echo "=== accuracy: skipped (no embedded model)"; continue; }
        if [[ ! -f $PROMPTS ]]; then echo "=== accuracy: skipped (no $PROMPTS: see the header)"; continue; fi
        acc=(--device cuda --dtype bfloat16 --gpu-memory-utilization 0.5 --prompts-file "$PROMPTS" --skip-tokenizer-init
             --variants "${ACC_VARIANTS:-control,kv_fp8,weights_fp8,kv_and_weights_fp8,weights_lm_head_fp8,kv_weights_lm_head_fp8}")
        acc_name=smollm2_bf16
      fi
      echo "=== fp8 accuracy: ${acc[*]}"
      timeout 400 "$PYTHON" -m pagedkv.bench.fp8_accuracy "${acc[@]}" \
        --output-json "$OUT/fp8_accuracy_${acc_name}.json" > "$OUT/fp8_accuracy_${acc_name}.log" 2>&1
      echo "    exit $?"
      grep -v '^{' "$OUT/fp8_accuracy_${acc_name}.log" | grep -E "agreement|variant|---|^(control|kv_|weights_)" | tail -16
      ;;
    diagnose)
      # The two open kernel gaps, each in one script: the prefill kernel with new rows against
      # the minimal TMA kernel (--gap), and decode on fp8 caches (decode_fp8_variants.py).
      if [[ "$SMOKE" == 1 ]]; then echo "=== diagnose: needs a GPU (skipped in a smoke run)"; continue; fi
      echo "=== diagnose: prefill gap, fp8 decode variants"
      timeout 130 "$PYTHON" scripts/prefill_variants.py --gap --budget-s 90 --commit "${PAGEDKV_COMMIT:-}" \
        --output-json "$OUT/prefill_gap.json" > "$OUT/prefill_gap.log" 2>&1
      grep "N=" "$OUT/prefill_gap.log"
      timeout 400 "$PYTHON" scripts/decode_fp8_variants.py --budget-s 300 --commit "${PAGEDKV_COMMIT:-}" \
        --output-json "$OUT/decode_fp8_variants.json" > "$OUT/decode_fp8_variants.log" 2>&1
      grep -E "of copy|error" "$OUT/decode_fp8_variants.log"
      ;;
    weightonly)
      if [[ "$SMOKE" == 1 ]]; then echo "=== weightonly: needs a GPU (skipped in a smoke run)"; continue; fi
      echo "=== weight-only fp8 GEMM against bf16 and fp8_linear"
      timeout $(( ${WEIGHTONLY_BUDGET:-180} + 120 )) "$PYTHON" scripts/fp8_weight_only_gemm.py --budget-s "${WEIGHTONLY_BUDGET:-180}" --commit "${PAGEDKV_COMMIT:-}" \
        --output-json "$OUT/fp8_weight_only_gemm.json" > "$OUT/fp8_weight_only_gemm.log" 2>&1
      echo "    exit $?"
      grep -E "layer|M=" "$OUT/fp8_weight_only_gemm.log" | tail -30
      ;;
    blas)
      if [[ "$SMOKE" == 1 ]]; then echo "=== blas: needs a GPU (skipped in a smoke run)"; continue; fi
      echo "=== bf16 F.linear through cuBLAS and cuBLASLt"
      # shellcheck disable=SC2086  # BLAS_M: rows separated by spaces
      timeout 300 "$PYTHON" scripts/bf16_stream_gemm.py --configs none --blas --budget-s 240 \
        --m ${BLAS_M:-1 16 32 64 96 128 160 192 256 384 512 768 1024} --commit "${PAGEDKV_COMMIT:-}" \
        --output-json "$OUT/bf16_blas.json" > "$OUT/bf16_blas.log" 2>&1
      echo "    exit $?"
      grep -E "layer M=|error" "$OUT/bf16_blas.log"
      ;;
    *) echo "unknown part $part (tests, kernels, gemm, bf16, fp8, fp8swap, fp8exact, profile, pdl, accuracy, diagnose, weightonly, blas)" ;;
  esac
done
