"""The benchmark: the grid of cells, the results database, the resumable runner and the report."""
