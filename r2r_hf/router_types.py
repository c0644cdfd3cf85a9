"""The kinds of router, declared once (stdlib only: the CLI offers them before torch loads).

``mlp`` is the paper's neural router (it has weights); ``entropy`` and ``random`` are the baselines (no
weights: a folder whose config names one must hold none). ``router.build_router`` builds each kind.
"""

MLP, ENTROPY, RANDOM = "mlp", "entropy", "random"
ROUTER_TYPES = (MLP, ENTROPY, RANDOM)
BASELINES = (ENTROPY, RANDOM)
