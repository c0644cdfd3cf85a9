"""The kinds of router, declared once (stdlib only: the CLI offers them before torch loads).

``mlp`` is the paper's neural router (it has weights); ``entropy`` and ``random`` are the baselines (no
weights: a folder whose config names one must hold none). ``router.build_router`` builds each kind.
"""

MLP, ENTROPY, RANDOM = "mlp", "entropy", "random"
ROUTER_TYPES = (MLP, ENTROPY, RANDOM)
BASELINES = (ENTROPY, RANDOM)
# The free signals an MLP router may read beside the paper's inputs (``R2RConfig.router_signals``), computed from the
# SLM's top-k logits: the normalised entropy and the gap between the two largest logits.
SIGNALS = ("entropy", "margin")
