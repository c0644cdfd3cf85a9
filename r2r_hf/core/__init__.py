"""The inference core: the decoding loop (``decoding``), the per-call ``Routing`` value (``routing``), the
router's features and ``score`` (``features``), the shared steps (``steps``) and the engines that run
the model calls, eager (``engines``) or captured (``capture``). Nothing here knows about HF ``generate``.
"""
