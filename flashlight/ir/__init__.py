"""Region IR (DESIGN.md §2): scalar expressions, the region, its verifier and reference evaluator."""
from .expr import Expr, call, coerce, const, dot, free_vars, lift, load, red, refs, substitute, var, walk
from .region import Dot, Input, Reduction, Region, Row, VerifyError, verify

__all__ = ["Expr", "call", "coerce", "const", "dot", "free_vars", "lift", "load", "red", "refs",
           "substitute", "var", "walk", "Dot", "Input", "Reduction", "Region", "Row", "VerifyError", "verify"]
