#!/bin/sh
# The shipped recordings of the Replay page, made by the command line (run from the repository's root).
set -e
cd "$(dirname "$0")/../.."
py=.venv/bin/python
$py -m model trace --model micro --prompt-ids 1,3 --check --json --device cpu > assets/recordings/micro.json
$py -m model trace --model small --prompt "con mèo" --check --json --device cpu > assets/recordings/small.json
$py -m model trace --model smollm2 --chat "What is the capital of France?" --max-new-tokens 12 --check --json \
    --device cpu > assets/recordings/smollm2.json
$py -m model trace --model gemma3 --prompt "Thủ đô của Việt Nam là" --max-new-tokens 12 --check --json \
    --device cpu > assets/recordings/gemma3.json
$py -m model speculate --model small --draft small-draft --gamma 3 --prompt "the dog" --json --device cpu \
    > assets/recordings/small-speculative.json
