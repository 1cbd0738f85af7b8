"""Capture (DESIGN.md §1): normalise a Dynamo graph to ATen before autograd, find regions."""
from . import rules  # noqa: F401  (fills symbolic.RULES)
from .regions import Fallback, Match, find_regions, source_line
from .symbolic import RULES, Unsupported, carries_grad, mark_gradients

__all__ = ["Fallback", "Match", "find_regions", "source_line", "RULES", "Unsupported", "carries_grad", "mark_gradients"]
