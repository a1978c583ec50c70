#!/usr/bin/env bash
# Usage: scripts/atari100k.sh [ALGO] [N_SEEDS] [extra flags...]
# Atari 100k (docs/protocol.md): the 26 games x seeds 1..N_SEEDS (default 5) of ALGO through the grid launcher
# (cleanrl_utils.tools.benchmark), then the results table beside the published DrQ(eps) means
# (benchmarks/atari100k_published.json). ALGO: drq (default; algos/drq.py, whose defaults are the protocol) or der
# (Data-Efficient Rainbow: algos/rainbow.py with Dopamine's DER.gin settings, below). Extra flags pass through to
# every run. Environment: GAMES (some of the 26, e.g. "Pong Boxing"; default all), WORKERS (parallel runs, default
# 1), THREADS (torch threads per run, default 1), RUN_DIR (default runs/atari100k; each algorithm in its own folder
# under it), PYTHON (default python). A launch again
# skips the finished runs and resumes the interrupted ones that have checkpoints.
set -euo pipefail

algo=drq
seeds=5
if [ $# -gt 0 ] && [[ $1 != -* ]]; then
    algo=$1
    shift
fi
if [ $# -gt 0 ] && [[ $1 != -* ]]; then
    seeds=$1
    shift
fi
if ! [[ $seeds =~ ^[1-9][0-9]*$ ]]; then
    echo "error: N_SEEDS '$seeds' must be a positive integer" >&2
    exit 2
fi

# Dopamine's dopamine/labs/atari_100k/configs/DER.gin as rainbow.py's flags (docs/algorithms.md has the sources);
# what rainbow.py cannot do: DER's noisy hidden layer (the fixed encoder's is plain; docs/algorithms.md). The runs
# keep the name rainbow (the launcher finds finished runs by it): in the table, rainbow's rows are DER's
der_flags=(
    --total-timesteps 100000 --buffer-size 100000 --n-step 10 --learning-starts 1600
    --train-frequency 1 --target-network-frequency 2000 --learning-rate 1e-4 --adam-eps 1.5e-4
    --n-atoms 51 --v-min -10 --v-max 10 --noisy-sigma 0.1 --prioritized-alpha 0.5 --prioritized-beta 0.5
    --prioritized-beta-end 0.5 --prioritized-eps 1e-10 --gamma 0.99 --batch-size 32 --eval-every 0
    --eval-episodes 100 --eval-epsilon 0.001 --no-forced-steps
)
case $algo in
    drq) script=drq flags=() ;;
    der) script=rainbow flags=("${der_flags[@]}") ;;
    *)
        echo "error: unknown algorithm '$algo'; choose drq or der" >&2
        exit 2
        ;;
esac

atari100k_games=(
    Alien Amidar Assault Asterix BankHeist BattleZone Boxing Breakout ChopperCommand CrazyClimber DemonAttack
    Freeway Frostbite Gopher Hero Jamesbond Kangaroo Krull KungFuMaster MsPacman Pong PrivateEye Qbert
    RoadRunner Seaquest UpNDown
)
read -r -a games <<< "${GAMES:-${atari100k_games[*]}}"
env_ids=()
for game in "${games[@]}"; do
    if [[ " ${atari100k_games[*]} " != *" $game "* ]]; then
        echo "error: GAMES: '$game' is not one of the 26 Atari 100k games: ${atari100k_games[*]}" >&2
        exit 2
    fi
    env_ids+=("${game}NoFrameskip-v4")
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python}
run_dir=${RUN_DIR:-runs/atari100k}
seed_list=()
for ((seed = 1; seed <= seeds; seed++)); do
    seed_list+=("$seed")
done

status=0
# ${flags[@]+...}: an empty array is safe under set -u in bash 3.2 (macOS) too
"$python" -m cleanrl_utils.tools.benchmark --algos "$script" --env-ids "${env_ids[@]}" --seeds "${seed_list[@]}" \
    --workers "${WORKERS:-1}" --threads-per-run "${THREADS:-1}" --run-dir "$run_dir/$algo" \
    -- ${flags[@]+"${flags[@]}"} "$@" || status=$?
"$python" -m cleanrl_utils.tools.results "$run_dir" --published "$root/benchmarks/atari100k_published.json"
exit "$status"
