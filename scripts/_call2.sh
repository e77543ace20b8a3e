set -x
O=/tmp/o; mkdir -p $O
source scripts/gpu_env.sh
timeout 200 python3 scripts/step_profile.py --model meta-llama/Meta-Llama-3-8B --load-format dummy --dtype bfloat16 --skip-tokenizer-init --rate 40 --duration 15 --trace-out $O/step_profile_trace.json > $O/step_profile.log 2>&1; echo "step_profile rc=$?"
grep -v "INFO" $O/step_profile.log | head -150
timeout 150 python3 scripts/gpu_structured_output.py --tokenizer .gpu_tok > $O/structured.log 2>&1; echo "structured rc=$?"; tail -25 $O/structured.log
timeout 200 python3 -m pytest -m gpu tests/kernels/test_fp8.py tests/engine/test_fp8.py -q -p no:cacheprovider -rs -x > $O/fp8_gpu_tests.log 2>&1; echo "fp8 tests rc=$?"; tail -15 $O/fp8_gpu_tests.log
gzip -f $O/step_profile_trace.json
tar czf $OUT/call2.tgz -C /tmp o
