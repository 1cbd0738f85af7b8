"""Codegen (DESIGN.md §5): Triton source from the region IR."""
from .backward import generate_backward
from .emit import CodegenError
from .kernel import generate

__all__ = ["CodegenError", "generate", "generate_backward"]
