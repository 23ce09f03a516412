"""Transforms: `filter_vmap`, `filter_pmap`, `filter_jit`, `shard` and their calls."""
