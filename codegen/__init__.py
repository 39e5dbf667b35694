"""The compiler behind ``fxlite.compile``, installed as ``fxlite.codegen``: ``compile.py``,
then one package per stage, in the order a call travels: ``capture``, ``lower``,
``kernels`` and ``runtime`` (ARCHITECTURE.md)."""
