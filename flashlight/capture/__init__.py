"""Capture (DESIGN.md §1): normalise a Dynamo graph to ATen before autograd, find regions."""
from .regions import Fallback, Match, find_regions, source_line
from .symbolic import RULES, Unsupported

__all__ = ["Fallback", "Match", "find_regions", "source_line", "RULES", "Unsupported"]
