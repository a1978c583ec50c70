#!/usr/bin/env bash
# Usage: scripts/pong.sh [ALGO] [SEED] [extra flags...]   (ALGO defaults to dqn, SEED to 1)
# Trains on PongNoFrameskip-v4 with --device auto: CUDA, then Apple MPS, then CPU.
exec "$(dirname "${BASH_SOURCE[0]}")/train.sh" PongNoFrameskip-v4 "$@"
