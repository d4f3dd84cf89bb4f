"""Sweeps over configs and seeds, and the statistics that say whether a difference is real."""
