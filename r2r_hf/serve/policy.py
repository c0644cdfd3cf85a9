"""The server's policy: when its LLM runs and how its answers speculate, decided once when it starts.

Three sources name it, each read here and nowhere else: the flags (``ServeSettings``: ``--llm-min-rows``,
``--llm-max-wait``, ``--speculate``, ``--speculate-below``, ``--draft-block``, ``--draft-confidence``,
``--fixed-depth``, ``--draft-cost``, checked when the settings are made; ``--draft-cost auto`` timed here, on the
pair: ``core/costs.py``), what the router was saved with
(``speculate_below``, as ``generate`` reads it from ``model.generation_config``), and what the pair can do
(``core.abilities``: a pair that cannot be cut back where it decodes does not speculate, said once). A request's
own ``speculate`` field is checked against the result (``request_depth``).
"""

from __future__ import annotations

import logging

from ..core.costs import resolved_draft_cost
from ..core.policy import WaitPolicy, serving_policy
from ..core.routing import speculation_for
from .errors import APIError

logger = logging.getLogger(__name__)


def served_policy(settings, model, pair, device_type: str) -> WaitPolicy:
    """The policy a server of ``model`` (its routed ``pair``) on ``device_type`` runs by (see the module docstring)."""
    below = settings.speculate_below  # the flag, else what the router was saved with (as generate reads it)
    below = getattr(model.generation_config, "speculate_below", None) if below is None else below
    cost = resolved_draft_cost(settings.draft_cost, pair) if settings.speculate else None
    policy = serving_policy(device_type, settings.max_batch_size, settings.llm_min_rows, settings.llm_max_wait,
                            settings.speculate, below, settings.draft_block, settings.draft_confidence,
                            not settings.fixed_depth, cost)
    policy = speculation_for(policy, pair, slots=pair.abilities.slots is None)
    if policy.speculate:  # (the pair may not speculate whatever the flag says: ``speculation_for``)
        logger.info("speculating: %s.", policy.said())
    return policy


def request_depth(asked: int | None, policy: WaitPolicy, flag: int) -> int | None:
    """A request's own speculation depth ``asked`` (None: the server's): 0 turns it off, at most the policy's (0 where
    the server was started without ``--speculate``, ``flag``, or its pair cannot speculate); else a 400 that says
    why and what to send."""
    server = policy.speculate
    if asked is None or 0 <= asked <= server:
        return asked
    if server == 0:
        why = "its models cannot be cut back after a rejected position" if flag else "it was started without --speculate"
        remedy = f", or start it with --speculate {asked} or more" if asked > 0 and not flag else ""
        raise APIError(400, f"speculate={asked} cannot be honoured: this server does not speculate ({why}); send 0 or "
                            f"leave speculate out{remedy}.", param="speculate")
    raise APIError(400, f"speculate={asked} is out of range: this server speculates up to {server} pending positions "
                        f"per answer; send a whole number from 0 (off) to {server}.", param="speculate")
