"""Evaluation of trained checkpoints: metrics, long-context sweep, attention pictures."""
from iha_jax.eval.evaluator import (attention_pictures, evaluate_workdir, parse_mesh,
                                    restore_run)
from iha_jax.eval.sweep import length_sweep, parse_lengths

__all__ = ["attention_pictures", "evaluate_workdir", "length_sweep", "parse_lengths",
           "parse_mesh", "restore_run"]
