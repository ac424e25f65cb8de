#!/bin/bash
# How the rows in this folder are made: the full-cache baselines and the claims study, in two
# lanes on the 2-core CPU, each single-threaded. Every command resumes where it stopped (finished jobs are rows in
# --out; an accuracy job's finished batches are in its .progress file), so rerunning this script continues the study;
# a command whose rows are all in --out only prints them. The claims files start with full_q15.json's GSM8K full-cache
# row copied in (the same job), so neither recomputes it. Lane B is the longer (the 1.5B's MATH-500 row); a sweep
# left running alone can be stopped and rerun with OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 (it resumes) on both cores.
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
# --no-refill: these rows were made before refill, which keys its rows apart
B="--policies full --n 100 --batch-size 16 --no-refill"
S="--no-refill --model qwen2.5-coder-1.5b --budgets 192 --buffer 16 --n 100 --batch-size 16 --max-new-tokens 512 --data data/gsm8k_test.jsonl"
F="--model qwen2.5-coder-1.5b --buffer 16 --n 12 --min-tokens 512 --batch-size 16 --data data/gsm8k_test.jsonl --out results/study/fidelity_q15.json"
( # lane A: claims 1-2 with the prompt protected, claims 3 and 5 at the tight budget
  python eval.py accuracy --model qwen2.5-coder-0.5b $B --max-new-tokens 512 --data data/gsm8k_test.jsonl --out results/study/full_q05.json
  python eval.py accuracy --model qwen2.5-coder-0.5b $B --max-new-tokens 1024 --data data/math500.jsonl --out results/study/full_q05.json
  python eval.py accuracy --policies snapkv,vase-noreserve,random $S --protect-prompt --out results/study/claims_q15.json
  python eval.py fidelity --policies all --budgets 192 $F   # every policy, with the reference traces scored once
  python eval.py perturbation --policies snapkv,criticalkv --budgets 192 $F
) &
( # lane B: the 1.5B baselines, claim 1 without protection, claim 3's larger budgets, claim 4, protected vase, MATH-500,
    # the VASE adversary with the prompt protected and at its paper's setting
  python eval.py accuracy --model qwen2.5-coder-1.5b $B --max-new-tokens 512 --data data/gsm8k_test.jsonl --out results/study/full_q15.json
  python eval.py accuracy --policies snapkv,random,vase $S --no-protect-prompt --out results/study/claims_q15_noprotect.json
  python eval.py fidelity --policies snapkv,criticalkv,vase,random --budgets 256,384 $F
  python eval.py probe --probe heads --model qwen2.5-coder-1.5b --n 8 --gap 1500 --data data/gsm8k_test.jsonl --out results/study/heads_q15.json
  python eval.py accuracy --policies vase $S --protect-prompt --out results/study/claims_q15.json
  python eval.py accuracy --model qwen2.5-coder-1.5b $B --max-new-tokens 1024 --data data/math500.jsonl --out results/study/full_q15.json
  python eval.py accuracy --policies vase-adversary $S --protect-prompt --out results/study/claims_q15.json
  python eval.py accuracy --policies vase-adversary $S --no-protect-prompt --out results/study/claims_q15_noprotect.json
) &
wait
