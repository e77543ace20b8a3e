O=/tmp/o5; rm -rf $O; mkdir -p $O
source scripts/gpu_env.sh
timeout 200 python3 -m pytest -m gpu tests/engine/test_engine_gpu.py -q -x -p no:cacheprovider -rs > $O/engine_gpu_tests.log 2>&1; rc=$?; echo "engine gpu tests rc=$rc"; tail -15 $O/engine_gpu_tests.log
timeout 120 python3 -m pytest -m gpu tests/engine/test_fp8.py tests/kernels/test_fp8.py -q -p no:cacheprovider -rs > $O/fp8_gpu_tests.log 2>&1; echo "fp8 tests rc=$?"; tail -3 $O/fp8_gpu_tests.log
if [[ $rc == 0 ]]; then
  OUT=$O STEP_TRACE=1 RATES=10,20,40,60 DURATION_S=15 BUDGET_S=280 DECODE_RESERVE_S=70 bash scripts/gpu_serve_sweep.sh > $O/sweep_stdout.log 2>&1; echo "sweep rc=$?"
  grep -E "piecewise|captured" $O/serve_sweep_llama3_8b_server.log | tail -3
  cat $O/serve_sweep_llama3_8b_steps.log | tail -8
  tail -12 $O/sweep_stdout.log
fi
tar czf $OUT/call5.tgz -C /tmp o5
