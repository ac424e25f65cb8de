#!/bin/bash
# The long-trace study on public reasoning traces (data/reasoning_traces.jsonl: Thought Anchors' labelled traces of
# DeepSeek-R1-Distill-Llama-8B and -Qwen-14B, then Sky-T1's), read by the 1.5B (Qwen2.5-Coder-1.5B-Instruct, int4):
#   bash results/reasoning/run.sh A & bash results/reasoning/run.sh B & wait     # two lanes, one thread each
#   bash results/reasoning/run.sh A 3                                           # the third step alone
#   bash results/reasoning/run.sh all                                           # one lane, every step in turn
#   N=12 bash results/reasoning/run.sh A                                        # the first 12 traces only (a cut)
#   MIN=6000 N=10 bash results/reasoning/run.sh A                               # the traces of 6,000 tokens or more
#   SKIP=8 N=8 bash results/reasoning/run.sh A                                  # the next block: traces 9 to 16
#   MIN=6000 SKIP=5 N=5 bash results/reasoning/run.sh A    # the longest past block 4 (tools/seeds.py --long-min 6000)
#   DIR=results/reasoning/amx SKIP=8 N=8 bash results/reasoning/run.sh A 21   # another kernel path's rows, apart
# The traces: the first N (default 35) of MIN (default 2,000) tokens or more, in file order, none a loop, after the
# first SKIP (default 0): a block of its own file, which tools/seeds.py and tools/sentences.py pool with the others
# (a sitting adds a block to the last one's; the first block, SKIP 0, is fid_MIN_nN.json, the next fid_MIN_sSKIP_nN).
# Each step is one policy at one (K, r); lane A takes the odd steps, lane B the even ones, so that the two lanes read
# the same traces and share the full cache's logits (eval.py computes each trace's once; the other waits for it). Every
# policy with its prompt protected (comparison 1's setting; a problem's turn is under 300 tokens). The int4 weights
# through their bf16 copies (the default path on a CPU with bf16 units; the rows carry it). Every step resumes where
# it stopped (finished traces are saved) and logs its start, end and machine to results/reasoning/run.log. Rows pair
# only with rows of their own kernel path (the CPU's level, AMX or not): a machine of another path writes to a DIR of
# its own (its rows measured against full-cache references replayed on it; a pair never across two folders).
# Order: what matters most first, K = 512 before K = 1,024: Random Attention's parity against snapkv; CriticalKV on
# snapkv; VASE's sampling against CurDKV drawn once; EPIKV against H2O at EPIKV's window, r = min(128, K/4) (its
# authors' default: 128 at K = 512 and at K = 1,024); the other baselines last.
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
lane=$1 only=$2 N=${N:-35} MIN=${MIN:-2000} SKIP=${SKIP:-0} DIR=${DIR:-results/reasoning}
[[ "$lane" =~ ^(A|B|all)$ ]] || { echo "error: lane '$lane': pass A (odd steps), B (even steps) or all" >&2; exit 2; }
[[ "$SKIP" =~ ^[0-9]+$ ]] || { echo "error: SKIP '$SKIP' is not a number of traces (0 or more)" >&2; exit 2; }
for v in "$only" "$N" "$MIN"; do
  [ -z "$v" ] || [[ "$v" =~ ^[1-9][0-9]*$ ]] || { echo "error: '$v' is not a positive number (step, N, MIN)" >&2
    exit 2; }
done
machine=$(python -c "import cli, torch; print(cli.made_on(torch.device('cpu')))") || exit 1
log() { echo "$(date -u +%FT%TZ) lane $lane${only:+ step $only} ($machine): $*" >> results/reasoning/run.log; }
mkdir -p "$DIR" || exit 1
OUT=$DIR/fid_${MIN}_n${N}.json
[ "$SKIP" = 0 ] || OUT=$DIR/fid_${MIN}_s${SKIP}_n${N}.json
RUN="python eval.py fidelity --traces data/reasoning_traces.jsonl --long $MIN --n $N --model qwen2.5-coder-1.5b"
[ "$SKIP" = 0 ] || RUN+=" --skip $SKIP"
RUN+=" --quant int4 --batch-size 16 --protect-prompt --keep-refs --out $OUT"  # one line in the log
n=0
step() {  # step POLICY K r
  n=$((n + 1))
  if [ -n "$only" ]; then [ "$only" = $n ] || return 0
  elif { [ "$lane" = A ] && [ $((n % 2)) = 0 ]; } || { [ "$lane" = B ] && [ $((n % 2)) = 1 ]; }; then return 0; fi
  log "start $RUN --policies $1 --budgets $2 --buffer $3"
  $RUN --policies "$1" --budgets "$2" --buffer "$3"; local rc=$?
  log "end (rc $rc) $RUN --policies $1 --budgets $2 --buffer $3"
  [ $rc = 0 ] || { log "stopped: a failed step (rc $rc) would fail the same way in the next"; exit $rc; }
}
for K in 512 1024; do
  w=$((K / 4 < 128 ? K / 4 : 128))  # EPIKV's window, and its baselines' r
  for p in random snapkv criticalkv vase-dkv curdkv-fixed; do step $p $K 64; done
  for p in epikv h2o; do step $p $K $w; done
  for p in rkv vase triattention triattention-layer adakv criticalkv-ada curdkv; do step $p $K 64; done
  for p in raas lagkv scissorhands; do step $p $K $w; done
done
