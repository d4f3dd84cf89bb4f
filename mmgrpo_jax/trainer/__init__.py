"""The mmGRPO loop, its configuration, checkpoints and run logs."""
