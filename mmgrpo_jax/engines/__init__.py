"""Rollout engines: the protocol the trainer samples through, the JAX engine, external LMs."""
