"""Rollouts, grouping, advantages, losses, batching of rows and the jitted update."""
