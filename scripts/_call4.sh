O=/tmp/o4; rm -rf $O; mkdir -p $O
source scripts/gpu_env.sh
timeout 200 python3 -m pytest -m gpu tests/kernels/test_fp8.py tests/engine/test_fp8.py -q -p no:cacheprovider -rs > $O/fp8_gpu_tests.log 2>&1; echo "fp8 tests rc=$?"; tail -4 $O/fp8_gpu_tests.log
timeout 160 python3 scripts/gpu_structured_output.py --tokenizer .gpu_tok > $O/structured_output.log 2>&1; echo "structured rc=$?"; grep -v "^{" $O/structured_output.log | grep -v INFO | tail -12; tail -1 $O/structured_output.log > $O/structured_output_llama3_8b.json
OUT=$O RATES=10,20,40,60 DURATION_S=15 BUDGET_S=330 DECODE_RESERVE_S=70 bash scripts/gpu_serve_sweep.sh > $O/sweep_stdout.log 2>&1; echo "sweep rc=$?"
tail -14 $O/sweep_stdout.log
tar czf $OUT/call4.tgz -C /tmp o4
