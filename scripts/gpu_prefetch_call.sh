#!/usr/bin/env bash
# Device calls (carrying .whl, .gpu_commit and .gpu_data) for the output projection's L2
# prefetch during attention (PAGEDKV_PREFETCH_O_ROWS; issue 20, twenty-third session). Parts,
# in the order given (default: tests steps, ~6 min):
#   tests    the prefetch op's GPU tests and the layout/specialization checks; the engine's
#            GPU tests (transformers parity, graphs, preemption) with the prefetch on
#   steps    decode steps (python -m pagedkv.bench.decode_step) at STEP_BATCHES of ~STEP_CONTEXT
#            tokens, bf16 (STEP_KINDS: bf16 fp8), under the settings of STEP_SETTINGS in turn
#            (off; on for every decode pass with evict_last; on without it), then a table of
#            each batch size's step time against the first setting's
#   profile  one decode step of 16 sequences by kernel, prefetch off and on (PDL on, as served)
#   runs     the real-ShareGPT run (Llama-3-8B shape, bf16), prefetch off and on at RUN_ROWS,
#            RUN_ROUNDS (2) rounds interleaved; output tok/s, roofline and decode bands
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/pagedkv-gpu-out}"; mkdir -p "$OUT"
PY="${PYTHON:-python3}"
source scripts/gpu_env.sh || exit 1
C=${PAGEDKV_COMMIT:-unknown}
MODEL=(--model meta-llama/Meta-Llama-3-8B --load-format dummy --dtype bfloat16 --max-model-len 2048
       --max-num-seqs 1024 --max-num-batched-tokens 16384)
kind_args() { [[ $1 == fp8 ]] && echo "--kv-cache-dtype fp8 --quantization fp8"; }
parts=("$@")
[[ ${#parts[@]} -eq 0 ]] && parts=(tests steps)
for part in "${parts[@]}"; do
  echo "=== $part"
  case $part in
    tests)
      timeout 200 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_prefetch.py \
        tests/kernels/test_layout.py tests/kernels/test_specialization.py 2>&1 | tail -4 \
        | tee "$OUT/prefetch_gpu_tests_$C.log"
      PAGEDKV_PREFETCH_O_ROWS=1024 timeout 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider \
        tests/engine/test_engine_gpu.py 2>&1 | tail -4 | tee -a "$OUT/prefetch_gpu_tests_$C.log"
      ;;
    steps)
      for kind in ${STEP_KINDS:-bf16}; do
        for setting in ${STEP_SETTINGS:-off:0:1 last:1024:1 normal:1024:0 off2:0:1 last2:1024:1}; do
          IFS=: read -r label rows last <<< "$setting"
          # shellcheck disable=SC2046  # kind_args is a list of options
          PAGEDKV_PREFETCH_O_ROWS=$rows PAGEDKV_PREFETCH_EVICT_LAST=$last timeout 240 \
            "$PY" -m pagedkv.bench.decode_step "${MODEL[@]}" $(kind_args "$kind") \
            --batch-sizes "${STEP_BATCHES:-1,4,16,64,128,256}" --context "${STEP_CONTEXT:-1000}" \
            --steps 16 --output-json "/tmp/steps_${kind}_$label.json" > "/tmp/steps_${kind}_$label.log" 2>&1
          echo "  $kind $label: exit $?"
        done
      done
      "$PY" - "${STEP_KINDS:-bf16}" "${STEP_SETTINGS:-off:0:1 last:1024:1 normal:1024:0 off2:0:1 last2:1024:1}" <<'PY' | tee "$OUT/prefetch_steps_$C.log"
import json, sys
kinds, settings = sys.argv[1].split(), [s.split(":")[0] for s in sys.argv[2].split()]
for kind in kinds:
    runs = {}
    for label in settings:
        try:
            runs[label] = {r["batch_size"]: r["median_step_ms"]
                           for r in json.load(open(f"/tmp/steps_{kind}_{label}.json"))["by_batch"]}
        except (OSError, KeyError) as exc:
            print(f"{kind} {label}: no figures ({exc})")
    if not runs:
        continue
    base = next(iter(runs.values()))
    print(f"{kind}: median decode step (ms) by batch size; ratio to {next(iter(runs))}")
    print("batch " + " ".join(f"{label:>16}" for label in runs))
    for b in base:
        print(f"{b:>5} " + " ".join(f"{r.get(b, float('nan')):8.3f} ({r.get(b, float('nan')) / base[b]:.3f})" for r in runs.values()))
PY
      ;;
    profile)
      for setting in off:0 last:1024; do
        IFS=: read -r label rows <<< "$setting"
        PAGEDKV_PREFETCH_O_ROWS=$rows timeout 200 "$PY" -m pagedkv.bench.decode_step "${MODEL[@]}" \
          --batch-sizes 16 --context 1000 --steps 16 --profile-steps 4 \
          --output-json "/tmp/profile_$label.json" > "$OUT/prefetch_profile_${label}_$C.log" 2>&1
        echo "  $label: exit $?"
        grep -E "decode step|gemm|attention|prefetch|other|GPU time" "$OUT/prefetch_profile_${label}_$C.log" | head -24
      done
      ;;
    runs)
      for round in $(seq 1 "${RUN_ROUNDS:-2}"); do
        for setting in off:0 on:${RUN_ROWS:-1024}; do
          IFS=: read -r label rows <<< "$setting"
          json="$OUT/throughput_prefetch_${label}_r${round}_$C.json"
          PAGEDKV_PREFETCH_O_ROWS=$rows timeout 300 "$PY" -m pagedkv.bench.throughput "${MODEL[@]}" \
            --num-prompts 1000 --dataset .gpu_data/sharegpt_1000.json --workload-seed 0 \
            --output-json "$json" > "/tmp/run_${label}_$round.log" 2>&1
          echo "  round $round $label (rows $rows): exit $?"
        done
      done
      "$PY" - "$OUT" "$C" <<'PY' | tee "$OUT/prefetch_runs_$C.log"
import glob, json, re, sys
out, commit = sys.argv[1:3]
for path in sorted(glob.glob(f"{out}/throughput_prefetch_*_{commit}.json")):
    d = json.load(open(path))
    bands = ", ".join(f"{b}: {v['seconds']:.2f}" for b, v in d.get("decode_host_gap_by_batch", {}).items())
    label = re.search(r"prefetch_(\w+?)_" + commit, path)[1]
    print(f"{label}: {d['output_tok_s']:,.0f} tok/s, "
          f"roofline {d.get('roofline_frac', 0):.1%}, {d['seconds']:.2f} s, prefill passes "
          f"{d.get('mixed_seconds', 0):.2f} s; decode bands (s) {bands}")
PY
      ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
