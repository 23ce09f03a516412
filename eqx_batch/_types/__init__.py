"""Typed batched models: `Stacked` annotations, `typecheck`, leaves' annotations."""
