"""What runs on every later call: launch plans, compiled binaries, the disk cache,
straight-line replay, CUDA graphs and the trial against the recorded ops."""
