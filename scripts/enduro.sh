#!/usr/bin/env bash
# Usage: scripts/enduro.sh [ALGO] [SEED] [extra flags...]   (ALGO defaults to dqn, SEED to 1)
# Trains on EnduroNoFrameskip-v4 with --device auto: CUDA, then Apple MPS, then CPU.
exec "$(dirname "${BASH_SOURCE[0]}")/train.sh" EnduroNoFrameskip-v4 "$@"
