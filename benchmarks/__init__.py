"""Benchmarks, in rooms by subject: ``gpu`` (the device check), ``serving`` (the server under load and its cost model),
``speed`` (``generate``'s speed and the host's work per step), ``quality`` (HumanEval, the routers' accuracy) and
``router`` (building the shipped router); ``models``, ``demo`` and ``tables`` serve them all."""
