"""Evaluation of trained checkpoints (minimal: loss, perplexity, exact match)."""
from iha_jax.eval.evaluator import evaluate_workdir

__all__ = ["evaluate_workdir"]
