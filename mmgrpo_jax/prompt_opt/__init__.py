"""Prompt optimization (MIPROv2-style demo bootstrapping, instruction proposals, TPE search) and
BetterTogether (prompt and weight optimization in sequence)."""
