"""Shared parts of value-atari: environments, replay buffer, encoder, evaluation, run record."""
