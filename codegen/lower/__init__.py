"""Lowering: one recorded segment becomes a fused graph (functionalize, autograd regions,
decompose, fuse), judged against the recorded ops by one kernel check."""
