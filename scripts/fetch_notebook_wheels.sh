#!/usr/bin/env bash
# Prepare, on a machine with pip's index, what the tutorials need on the GPU machine (Python
# 3.12, x86-64, no network): the wheels it lacks and the embedded model's GGUF in parts.
# Run from the repository root:
#   bash scripts/fetch_notebook_wheels.sh
# It writes two folders that git ignores (.gitignore) and that the device calls carry:
#   .nbwhl/                   the wheels: nbclient, nbformat, ipykernel, ipywidgets, gguf, openai,
#                             fastapi, uvicorn and what they need that the GPU machine's image
#                             lacks (its package list: the device tool's KINDS.md), one version
#                             each, pinned below to the versions of requirements/test.txt
#   .nbgguf/1 .nbgguf/2 ...   SmolLM2-135M-Instruct.Q4_1.gguf (98 MB) cut into parts of PART_MB
#                             (default 40) MiB, one carried per call, and .nbgguf/manifest (sizes
#                             and sha256, carried with the last part): one call carries 64 MiB
# and prints the device calls that scripts/gpu_notebooks.sh needs, in order.
# Needs: the embedded model installed in PYTHON's environment (./dev setup does it), pip, split.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}"
PART_MB="${PART_MB:-40}"
WHEELS=.nbwhl
PARTS=.nbgguf

# Pure-Python or manylinux wheels for CPython 3.12. The GPU machine already has torch, triton,
# transformers, numpy, pyyaml, requests, tqdm, httpx, h11, click, attrs, psutil, pygments,
# packaging, python-dateutil, prometheus-client, matplotlib, sentencepiece, tokenizers...
# anyio, idna and typing-extensions are carried too: openai and pydantic need versions newer
# than an image may hold, and newer ones of these three only add.
PINS=(
  # running notebooks: nbclient starts an ipykernel and executes the cells
  nbclient==0.11.0 nbformat==5.11.1 jupyter-client==8.10.0 jupyter-core==5.9.1
  ipykernel==7.4.0 comm==0.2.3 debugpy==1.8.22 nest-asyncio2==1.7.4 pyzmq==27.3.0
  tornado==6.6.1 traitlets==5.16.1 platformdirs==4.14.9 matplotlib-inline==0.2.2
  fastjsonschema==2.22.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==2026.9.1
  ipython==9.18.1 ipython-pygments-lexers==1.1.1 jedi==0.20.1 parso==0.8.7
  prompt-toolkit==3.0.53 wcwidth==0.9.4 stack-data==0.6.3 asttokens==3.0.2 executing==2.3.0
  pure-eval==0.2.4 pexpect==4.9.0 ptyprocess==0.7.0
  # widgets (their state is stored in the executed notebooks)
  ipywidgets==8.1.9 widgetsnbextension==4.0.16 jupyterlab-widgets==3.0.17
  # the embedded model's tokenizer and weights are read from its GGUF
  gguf==0.19.0
  # the engine: its core process's wire, and structured output
  msgspec==0.22.0 llguidance==1.9.1
  # 06: pagedkv serve and the official client
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.4 opentelemetry-api==1.45.2
  uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0
  sniffio==1.3.1 anyio==4.16.0 idna==3.20 typing-extensions==4.16.0
)

rm -rf "$WHEELS"
mkdir -p "$WHEELS"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$WHEELS" "${PINS[@]}"
count=$(ls "$WHEELS"/*.whl | wc -l)
if [[ "$count" -ne "${#PINS[@]}" ]]; then
  echo "expected ${#PINS[@]} wheels, got $count in $WHEELS" >&2
  exit 1
fi

gguf=$("$PYTHON" -c 'from pagedkv.engine.config import embedded_model_path; print(embedded_model_path())')
rm -rf "$PARTS"
mkdir -p "$PARTS/split"
split -b "${PART_MB}M" -d -a 1 "$gguf" "$PARTS/split/part"
n=0
for f in "$PARTS"/split/part*; do
  n=$((n + 1))
  mkdir -p "$PARTS/$n"
  mv "$f" "$PARTS/$n/$(basename "$gguf").part$n"
done
rmdir "$PARTS/split"
{
  echo "file $(basename "$gguf")"
  echo "parts $n"
  echo "size $(stat -c %s "$gguf")"
  echo "sha256 $(sha256sum "$gguf" | cut -d' ' -f1)"
} > "$PARTS/$n/manifest"

wheels_mb=$(du -sm "$WHEELS" | cut -f1)
echo "$count wheels in $WHEELS ($wheels_mb MiB); $(basename "$gguf") in $n parts of at most $PART_MB MiB in $PARTS/1..$n"
echo
echo "On the GPU machine, calls one right after the other (it keeps ignored files while warm, ~30 s):"
for ((i = 1; i < n; i++)); do
  echo "  run  carry=[\"$PARTS/$i\"]  command: bash scripts/gpu_notebooks.sh receive"
done
echo "  run  carry=[\"$PARTS/$n\", \"$WHEELS\", \".gpu_commit\"]  command: bash scripts/gpu_notebooks.sh run"
echo "(git rev-parse --short HEAD > .gpu_commit first; see scripts/gpu_notebooks.sh)"
