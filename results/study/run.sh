#!/bin/bash
# How the rows in this folder are made (the claims study, issue 25, and the full-cache baselines, issue 20).
# Two lanes on the 2-core CPU, each single-threaded; rerunning this script resumes every sweep where it stopped.
# The claims files start with full_q15.json's GSM8K full-cache row copied in (the same job), so neither recomputes it.
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
B="--policies full --n 100 --batch-size 16"
S="--model qwen2.5-coder-1.5b --budgets 192 --buffer 16 --n 100 --batch-size 16 --max-new-tokens 512 --data data/gsm8k_test.jsonl"
( python eval.py accuracy --model qwen2.5-coder-0.5b $B --max-new-tokens 512 --data data/gsm8k_test.jsonl --out results/study/full_q05.json
  python eval.py accuracy --model qwen2.5-coder-0.5b $B --max-new-tokens 1024 --data data/math500.jsonl --out results/study/full_q05.json
  python eval.py accuracy --policies snapkv,vase,vase-adversary,random $S --protect-prompt --out results/study/claims_q15.json ) &
( python eval.py accuracy --model qwen2.5-coder-1.5b $B --max-new-tokens 512 --data data/gsm8k_test.jsonl --out results/study/full_q15.json
  python eval.py accuracy --policies snapkv,vase,vase-adversary,random $S --no-protect-prompt --out results/study/claims_q15_noprotect.json
  python eval.py accuracy --model qwen2.5-coder-1.5b $B --max-new-tokens 1024 --data data/math500.jsonl --out results/study/full_q15.json ) &
wait
