"""Hostile-input suite: checkpoints, configs and the environment as an attacker or a broken system gives them."""
