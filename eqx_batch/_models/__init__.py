"""Models: `ensemble`, `scan_layers` and `per_member`."""
