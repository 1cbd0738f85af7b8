"""Codegen (DESIGN.md §5): Triton source from the region IR."""
from .emit import CodegenError
from .kernel import generate

__all__ = ["CodegenError", "generate"]
