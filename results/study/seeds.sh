#!/bin/bash
# Each paper's own comparison, baseline for baseline, on the 1.5B (Qwen2.5-Coder-1.5B-Instruct, int4):
#   bash results/study/seeds.sh A & bash results/study/seeds.sh B & wait
#   bash results/study/seeds.sh A 2     # lane A's second step alone, e.g. to run two of lane A's steps side by side
#   bash results/study/seeds.sh B 4 lagkv,scissorhands   # only these of the step's policies (a step split in two lanes)
# Two single-threaded lanes, as replicate.sh. Every step resumes where it stopped (accuracy: its finished problems in a
# .progress file; fidelity: its finished traces) and logs its start and end to results/study/seeds.log.
# The path: int4 at batch 16 with the int kernels and batches that drain (--int-kernels --no-refill), as every row
# of the replication study was made, so that the new policies pair with its snapkv, random, vase, criticalkv, h2o,
# rkv, vase-dkv and epikv rows. The faster paths (refill, the bf16 copies) are keyed apart: refill changes int4's numbers (19 of 32
# 135M answers differ), and the bf16 copies have not been shown equal to the int kernels (RESULTS.md, the fast modes).
# Order: what matters most first; the planned cuts come last, the last cut first: the MATH-500 column, then the
# unprotected half of comparison 1, then the long traces of comparison 3.
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
die() { echo "error: $*" >&2; exit 2; }
usage="usage: bash results/study/seeds.sh A|B [STEP [POLICY,...]]"
[ $# -ge 1 ] && [ $# -le 3 ] || die "$usage"
lane=$1 only=$2 pick=$3
[ "$lane" = A ] || [ "$lane" = B ] || die "lane '$lane': the lanes are A and B ($usage)"
[ -z "$only" ] || [[ $only =~ ^[1-9][0-9]*$ ]] || die "step '$only' is not a step number ($usage)"
[ -z "$pick" ] || [[ $pick =~ ^[a-z0-9-]+(,[a-z0-9-]+)*$ ]] || die "'$pick' is not a comma list of policies ($usage)"
n=0 dry=1  # a first pass counts the lane's steps, so that a step it does not have is refused before anything runs
step() {
  n=$((n + 1)); [ -z "$dry" ] || return 0; [ -z "$only" ] || [ "$only" = $n ] || return 0
  local a=("$@") i rc  # with a third argument: its policies in place of the step's own
  [ -z "$pick" ] || for i in "${!a[@]}"; do [ "${a[i]}" = --policies ] && a[i + 1]=$pick; done
  log "start ${a[*]}"; "${a[@]}"; rc=$?; log "end (rc $rc) ${a[*]}"
  [ $rc = 0 ] || { echo "error: lane $lane step $n failed (rc $rc); the lane stops here (results/study/seeds.log)" >&2
                   exit $rc; }  # the later steps would queue behind a failure nobody saw
}
Q15="--model qwen2.5-coder-1.5b --quant int4 --batch-size 16 --int-kernels"
# GSM8K: claim 3's curve set (the first 100 problems whose protected prompt fits K = 160), K = 192, r = 16; its file
# holds full, snapkv, random, vase and criticalkv at K = 192 already
GSM="$Q15 --no-refill --data results/study/gsm8k_fit144.jsonl --n 100 --buffer 16 --max-new-tokens 512
     --out results/study/curve_q15.json"
MATH="$Q15 --no-refill --data data/math500.jsonl --n 100 --budgets 416 --buffer 16 --max-new-tokens 2048
      --protect-prompt --out results/study/math_q15.json"
LONG="$Q15 --data results/study/long_pool.jsonl --long 1500 --max-new-tokens 4096 --n 12
      --out results/study/longfid_q15.json"
RA=rkv,triattention,triattention-layer        # Random Attention's baselines not yet run (snapkv, vase: done)
steps() {
if [ "$lane" = A ]; then
  step python eval.py accuracy --policies $RA --budgets 192 $GSM --protect-prompt                   # 1: RA
  step python eval.py accuracy --policies adakv,criticalkv-ada --budgets 192 $GSM --protect-prompt  # 2: CriticalKV
  step python eval.py accuracy --policies curdkv-fixed,vase-dkv,curdkv --budgets 192 $GSM \
       --protect-prompt                                                                             # 3: VASE
  step python eval.py accuracy --policies epikv,h2o,raas,lagkv,scissorhands --budgets 192 $GSM --protect-prompt \
       --buffer 48                                                                                 # 4: EPIKV, r = K/4
  step python eval.py accuracy --policies snapkv,vase,random,$RA --budgets 192 $GSM --no-protect-prompt  # cut 2
  step python eval.py accuracy --policies $RA $MATH                                                # cut 1
else
  step python eval.py fidelity --policies triattention,triattention-layer --budgets 512 --buffer 64 $LONG --keep-refs
  # comparison 1 is protected throughout: the study's snapkv, rkv and vase long-trace rows are not
  step python eval.py fidelity --policies snapkv,rkv,vase --budgets 512 --buffer 64 $LONG --keep-refs --protect-prompt
  step python eval.py fidelity --policies adakv,criticalkv-ada --budgets 512 --buffer 64 $LONG --keep-refs
  step python eval.py fidelity --policies h2o,raas,lagkv,scissorhands --budgets 512 --buffer 128 $LONG --keep-refs
  # the perturbation shares beside the study's snapkv and criticalkv rows (claim 3's 12 conversations, fp32, K = 192)
  step python eval.py perturbation --policies adakv,criticalkv-ada --budgets 192 --model qwen2.5-coder-1.5b \
       --buffer 16 --n 12 --min-tokens 512 --batch-size 16 --data data/gsm8k_test.jsonl \
       --out results/study/fidelity_q15.json
  step python eval.py fidelity --policies curdkv-fixed,curdkv --budgets 512 --buffer 64 $LONG --keep-refs  # cut 3
fi
}

steps
[ -z "$only" ] || [ "$only" -le $n ] || die "lane $lane has steps 1 to $n, not $only"
machine=$(python -c "import cli, torch; print(cli.made_on(torch.device('cpu')))") || die "python cannot import torch"
log() { echo "$(date -u +%FT%TZ) lane $lane${only:+ step $only}${pick:+ $pick} ($machine): $*" >> results/study/seeds.log; }
n=0 dry=
steps
