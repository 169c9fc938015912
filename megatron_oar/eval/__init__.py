"""Evaluation and analysis: pass@k on benchmarks, the causal-token oracle, importance maps."""
