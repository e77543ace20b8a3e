#!/usr/bin/env bash
# The wheels the GPU machine lacks for serving, downloaded here into .whl/ (gitignored) for its
# Python 3.12 on x86-64; scripts/gpu_env.sh installs whatever lies in .whl/ there. That machine
# has torch, numpy, httpx, prometheus-client, anyio, h11, click and uvloop, and no network.
#   bash scripts/gpu_wheels.sh          # then carry .whl (and .gpu_commit) in the device call
# Versions: the pins of requirements/test.txt and what they pull in; httptools is uvicorn's
# faster HTTP parser (optional: uvicorn falls back to h11 without it); gguf reads the embedded
# model (scripts/gpu_fp8.sh accuracy, the embedded-model GPU tests); jsonschema (and what it
# pulls in) is what tests/engine/test_structured_output.py checks its JSON against.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-.venv/bin/python}"
mkdir -p .whl
pkgs=(
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  uvicorn==0.54.0 httptools==0.9.0
  pyzmq==27.3.0 msgspec==0.22.0
  llguidance==1.9.1
  gguf==0.19.0
  jsonschema==4.26.0 attrs==26.1.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==2026.9.1
)
plats=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_31_x86_64; do
  plats+=(--platform "$p")
done
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp "${plats[@]}" -d .whl "${pkgs[@]}"
ls -l .whl
du -sh .whl
