"""Runtime: the custom op, kernel launch and the on-disk kernel cache (imported lazily)."""
