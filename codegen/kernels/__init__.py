"""Triton source from a fused group: pure functions of the group, with no disk, no launches
and no state."""
