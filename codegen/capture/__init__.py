"""Capture: run the user's Python under a ``TorchFunctionMode``, record its torch calls, and
decide what each later call must check (guards) or run again (following)."""
