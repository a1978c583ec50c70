#!/usr/bin/env bash
# Usage: scripts/train.sh ENV_ID [ALGO] [SEED] [extra flags...]
# Runs algos/ALGO.py (default dqn; ALGO may also be the path of a script file, e.g. a copy of
# algos/custom_value_atari.py) with --seed SEED (default 1) and --device auto (CUDA, then
# Apple MPS, then CPU) unless the extra flags give --device; extra flags pass through. Works
# from any working directory.
set -euo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 ENV_ID [ALGO] [SEED] [extra flags...]" >&2
    exit 2
fi
env_id=$1
shift
algo=dqn
seed=1
if [ $# -gt 0 ] && [[ $1 != -* ]]; then
    algo=$1
    shift
fi
if [ $# -gt 0 ] && [[ $1 != -* ]]; then
    seed=$1
    shift
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $algo == */* || $algo == *.py ]]; then
    # a script file anywhere, e.g. a copy of algos/custom_value_atari.py
    script=$algo
    if [ ! -f "$script" ]; then
        echo "error: algorithm script '$algo' does not exist" >&2
        exit 2
    fi
else
    script="$root/algos/$algo.py"
fi
if [ ! -f "$script" ]; then
    known=""
    for file in "$root"/algos/*.py; do
        name=${file##*/}
        known="$known ${name%.py}"
    done
    echo "error: unknown algorithm '$algo'; choose one of:$known" >&2
    exit 2
fi
if ! [[ $seed =~ ^[0-9]+$ ]]; then
    echo "error: SEED '$seed' must be a non-negative integer" >&2
    exit 2
fi

export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
device=(--device auto)
for arg in "$@"; do
    if [[ $arg == --device || $arg == --device=* ]]; then
        device=()  # the user's own --device, once
    fi
done
# ${device[@]+...}: an empty array is safe under set -u in bash 3.2 (macOS) too
command=("${PYTHON:-python}" "$script" --env-id "$env_id" --seed "$seed" ${device[@]+"${device[@]}"} "$@")
echo "+ ${command[*]}"
exec "${command[@]}"
