#!/usr/bin/env bash
# Usage: scripts/beamrider.sh [ALGO] [SEED] [extra flags...]   (ALGO defaults to dqn, SEED to 1)
# Trains on BeamRiderNoFrameskip-v4 with --device auto: CUDA, then Apple MPS, then CPU.
exec "$(dirname "${BASH_SOURCE[0]}")/train.sh" BeamRiderNoFrameskip-v4 "$@"
