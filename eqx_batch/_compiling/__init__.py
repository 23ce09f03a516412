"""Compile plumbing: static parts of pytrees, `AsyncJit`, lowered programs, memos."""
