"""`mixprec bench`: time-to-accuracy benchmarks."""
