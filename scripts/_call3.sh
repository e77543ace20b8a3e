O=/tmp/o3; rm -rf $O; mkdir -p $O
source scripts/gpu_env.sh
PAGEDKV_CORE_PROFILE=$O/core_profile.txt:3300:150 OUT=$O STEP_TRACE=1 RATES=20,40 DURATION_S=12 BUDGET_S=300 DECODE_RESERVE_S=70 bash scripts/gpu_serve_sweep.sh > $O/sweep_stdout.log 2>&1; echo "sweep rc=$?"
tail -22 $O/sweep_stdout.log
head -45 $O/core_profile.txt
timeout 150 python3 scripts/gpu_structured_output.py --tokenizer .gpu_tok > $O/structured.log 2>&1; echo "structured rc=$?"; tail -6 $O/structured.log
timeout 200 python3 -m pytest -m gpu tests/kernels/test_fp8.py tests/engine/test_fp8.py -q -p no:cacheprovider -rs > $O/fp8_gpu_tests.log 2>&1; echo "fp8 tests rc=$?"; tail -8 $O/fp8_gpu_tests.log
tar czf $OUT/call3.tgz -C /tmp o3
