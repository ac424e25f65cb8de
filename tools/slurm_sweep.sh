#!/usr/bin/env bash
# Submit an eval.py sweep to Slurm as sharded jobs (docs/SWEEPS.md, "A sweep on many workers"):
#   1. OUT-full   the full cache's row alone (fidelity only: it writes the traces beside --out that every shard reads,
#                 so that they are generated once, not once per shard)
#   2. OUT-shard  an array of N tasks, task I running `--shard I/N`, once job 1 has succeeded
#   3. OUT-merge  `eval.py merge --out FILE`, once every task has succeeded
# (OUT: the --out file's name without .json). It prints the three job ids.
#
# usage: tools/slurm_sweep.sh N SUBCOMMAND ARGS...        (ARGS as for eval.py, --out FILE among them)
#   e.g. tools/slurm_sweep.sh 8 fidelity --policies all --budgets 128,256 --n 12 --max-new-tokens 128 \
#            --data data/math500.jsonl --out results/fidelity.json
# Nothing is taken from the shell by accident:
#   - python: $NANOKV_PYTHON, else the python on this shell's PATH (a venv's, once activated), as an absolute path;
#     it must import torch here, or nothing is submitted. The jobs run it by that path, not by their PATH.
#   - directory: every job runs in this repository (--chdir), wherever you submit from: relative paths in ARGS
#     (--out, --data, --model) are read from it.
#   - logs: results/logs/JOBNAME-JOBID_TASK.out (JOBNAME-JOBID.out for jobs 1 and 3), appended to, so that a task
#     that is run again (scontrol requeue) keeps its first try's log.
#   - resources of jobs 1 and 2: $NANOKV_SBATCH, default "--cpus-per-task=4 --time=4:00:00" (on a GPU:
#     "--gres=gpu:1 --time=4:00:00"; empty: none); Slurm's own SBATCH_PARTITION, SBATCH_ACCOUNT, ... reach all
#     three jobs.
#   - threads: OMP_NUM_THREADS=1 and OPENBLAS_NUM_THREADS = the task's CPUs (1 where --cpus-per-task is not given);
#     each job's log opens with them, its host and its python.
# Only some tasks: NANOKV_ARRAY=3,5 (an --array list) submits jobs 1 to 3 with only tasks 3 and 5 of the N.
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "error: $*" >&2; exit 1; }
[ $# -ge 2 ] && [[ $1 =~ ^[1-9][0-9]*$ ]] || die "usage: tools/slurm_sweep.sh N SUBCOMMAND ARGS... (N shards, e.g." \
    "tools/slurm_sweep.sh 8 fidelity --n 12 --out results/fidelity.json)"
n=$1 sub=$2
shift 2
# Everything is checked before anything is queued: a task that cannot run fails in the queue, and the merge, which
# waits for every task (afterok), would wait for ever
case "$sub" in fidelity | accuracy | probe | perturbation | bench) ;;
    *) die "'$sub' is not a sweep of eval.py: pass fidelity, accuracy, probe, perturbation or bench" ;; esac
out=
for ((i = 1; i <= $#; i++)); do  # the --out FILE (or --out=FILE) among ARGS: the merge needs it
    case "${!i}" in --out=*) out=${!i#--out=} ;; --out) j=$((i + 1)); out=${!j:-} ;;
        --shard | --shard=*) die "ARGS hold --shard: tools/slurm_sweep.sh gives each task its own; drop it" ;; esac
done
[ -n "$out" ] || die "tools/slurm_sweep.sh needs --out FILE among the eval.py arguments: the shards write beside it"
tasks=${NANOKV_ARRAY:-1-$n}  # Slurm's --array list: I, I-J, I-J:STEP, comma-separated, then %MAX at most at once
[[ $tasks =~ ^[0-9]+(-[0-9]+(:[1-9][0-9]*)?)?(,[0-9]+(-[0-9]+(:[1-9][0-9]*)?)?)*(%[1-9][0-9]*)?$ ]] ||
    die "NANOKV_ARRAY=$tasks is not a list of tasks such as 3,5 or 2-4"
IFS=, read -ra parts <<<"${tasks%\%*}"
for part in "${parts[@]}"; do  # each task I runs --shard I/N, which takes 1 <= I <= N
    range=${part%%:*} first=${part%%[-:]*} last=${range#*-}
    ((10#$first >= 1 && 10#$last <= n && 10#$first <= 10#$last)) ||
        die "NANOKV_ARRAY=$tasks asks for task $part, but the $n shards are tasks 1 to $n"
done
given=${NANOKV_PYTHON:-$(command -v python || command -v python3 || echo python)}
# its sys.executable: a full path that stays in its venv (realpath would leave it for the base interpreter)
py=$("$given" -c "import sys, torch; print(sys.executable)" 2>/dev/null) || die "$given cannot import torch: activate" \
    "the environment you installed nanokv into, or set NANOKV_PYTHON=/path/to/venv/bin/python"
# eval.py's own parser on the arguments every task gets (a misspelt flag, a bad --shard), in one line as eval.py says it
why=$("$py" -c "import sys, eval; eval.build_parser().parse_args(sys.argv[1:])" "$sub" "$@" --shard "$n/$n" 2>&1) ||
    die "every task would fail on its eval.py arguments (${why#error: }): fix them, then submit again"
command -v sbatch >/dev/null || die "sbatch not found: run this on a Slurm login node (or tools/slurm_local.sh" \
    "makes this machine a one-node cluster)"
mkdir -p results/logs  # Slurm does not create the folder of --output: a job whose log cannot be opened fails unseen
name=$(basename "$out" .json)
args=$(printf ' %q' "$@")
env="export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=\${SLURM_CPUS_PER_TASK:-1};
echo \"\$(hostname): OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=\$OPENBLAS_NUM_THREADS\" $(printf %q "$py");"
submit() { sbatch --parsable --chdir="$PWD" --open-mode=append "$@"; }  # prints the job id
read -ra res <<<"${NANOKV_SBATCH---cpus-per-task=4 --time=4:00:00}"  # set but empty: no options

after=()
if [ "$sub" = fidelity ]; then
    full=$(submit "${res[@]}" -J "$name-full" --output="results/logs/%x-%j.out" \
        --wrap "$env exec $(printf %q "$py") eval.py $sub$args --policies full")
    after=(--dependency="afterok:$full")
    echo "full cache: $full"
fi
array=$(submit "${res[@]}" -J "$name-shard" --array="$tasks" "${after[@]}" \
    --output="results/logs/%x-%A_%a.out" \
    --wrap "$env exec $(printf %q "$py") eval.py $sub$args --shard \$SLURM_ARRAY_TASK_ID/$n")
echo "shards: $array (tasks $tasks of $n)"
merge=$(submit -J "$name-merge" --dependency="afterok:$array" --output="results/logs/%x-%j.out" \
    --wrap "exec $(printf %q "$py") eval.py merge --out $(printf %q "$out")")
echo "merge: $merge (logs in results/logs/)"
