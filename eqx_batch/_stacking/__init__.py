"""Stacking members: `stack`, `unstack`, `concat`, `batch_size`, `index`, `take`."""
