"""A run's checkpoint (or none), where draws go, files, lock, rows, reader, writer."""
