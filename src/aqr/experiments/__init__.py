"""Experiments beyond the benchmark grid: the synthetic ones, the demo and the tail-deviation figure."""
