"""The step's decisions (core/plan.py) are a pure function of host values: no model, no tensor, no device here.

``plan_step`` says who writes, who waits, whether the LLM runs and for whom, and who speculates; ``settle`` what a
step commits once the LLM has rejected a pending token (a slot's row alone is cut back; a rectangle's every row).
"""

from r2r_hf.core.ledger import Pending, RowState
from r2r_hf.core.plan import Outcome, StepPlan, plan_step, settle
from r2r_hf.core.policy import IMMEDIATE, WaitPolicy


def _rows(*states):
    return [None if s is None else RowState(**s) for s in states]


def test_a_plan_is_a_plain_value_that_compares_and_prints():
    rows = _rows({}, {}, None)
    a = plan_step(rows, 3, [0, 1], [False, True], set(), IMMEDIATE)
    b = plan_step(rows, 3, [0, 1], [False, True], set(), IMMEDIATE)
    assert a == b and isinstance(a, StepPlan) and "llm_writers=(1,)" in repr(a)
    assert a.slm_writers == (0,) and a.llm_writers == (1,) and a.writers == (0, 1) and a.waited == (0,)
    assert a.llm_reads == (1,), "slots: the LLM reads the rows it writes for"
    assert plan_step(rows, 3, [0, 1], [False, True], set(), IMMEDIATE, lockstep=True).llm_reads == (0, 1)


def test_routed_rows_wait_until_the_policy_runs_the_llm():
    policy = WaitPolicy((2,), 4)
    rows = _rows({}, {}, {})
    first = plan_step(rows, 0, [0, 1, 2], [True, False, False], set(), policy)
    assert first.llm_writers == () and first.waiting == (0,) and first.slm_writers == (1, 2)
    rows[0].waiting_since = 0
    both = plan_step(rows, 1, [1, 2], [True, False], set(), policy)
    assert both.llm_writers == (0, 1) and both.waited == (1, 0), "two wait: the LLM serves both"
    old = plan_step(rows, 4, [1, 2], [False, False], set(), policy)
    assert old.llm_writers == (0,) and old.waited == (4,), "the oldest waited max_wait steps"
    stalled = plan_step(_rows({"waiting_since": 0}), 1, [], [], set(), policy)
    assert stalled.llm_writers == (0,), "nothing else can go on"


def test_ended_rows_commit_nothing_and_draining_rows_are_not_read():
    rows = _rows({"max_new": 1}, {}, {})
    plan = plan_step(rows, 0, [0, 1, 2], [False, False, True], {2}, IMMEDIATE)
    assert plan.ended == (2,) and plan.writers == (0, 1) and plan.llm_writers == ()
    assert plan.slm_reads == (1,), "row 0 committed its last token: no proposal follows it"


def test_a_routed_row_speculates_until_it_holds_its_depth_then_waits():
    policy = WaitPolicy((3,), 16, speculate=2)
    rows = _rows({}, {"pending": [Pending(0, 0), Pending(3, 2)]}, {})
    plan = plan_step(rows, 5, [0, 1, 2], [True, True, False], set(), policy)
    assert plan.speculating == (0,) and plan.slm_writers == (0, 2), "row 0 goes on with the SLM's token"
    assert plan.waiting == (1,) and plan.llm_writers == (), "row 1 holds its depth: it waits (two hold, m = 3)"
    runs = plan_step(rows, 16, [0, 2], [False, False], set(), policy)
    assert runs.resolving == (1,) and runs.llm_reads == (1,), "the oldest pending position is max_wait old"


def test_a_rectangle_runs_the_llm_rather_than_let_a_row_wait():
    policy = WaitPolicy((3,), 32, speculate=1)
    rows = _rows({"pending": [Pending(0, 0)]}, {})
    plan = plan_step(rows, 1, [0, 1], [True, False], set(), policy, lockstep=True)
    assert plan.llm_writers == (0,) and plan.resolving == (0,) and plan.llm_reads == (0, 1)
    assert plan_step(rows, 1, [0, 1], [True, False], set(), policy).llm_writers == (), "slots: row 0 waits"


def test_settle_cuts_a_slot_back_alone_and_a_rectangle_together():
    rows = _rows({"written": 6, "max_new": 4, "pending": [Pending(2, 1), Pending(4, 3)]},
                 {"written": 6, "max_new": 4, "pending": [Pending(5, 4)]}, {"written": 6, "max_new": 4})
    plan = StepPlan(7, proposed=(0, 1, 2), slm_writers=(0, 1, 2), resolving=(0, 1), llm_reads=(0, 1))
    slots = settle(rows, plan, {0: 1, 1: None}, lockstep=False)
    assert slots.rollbacks == {0: 4} and slots.llm_writers == (0,) and slots.slm_writers == (1, 2)
    assert (slots.agreed, slots.rejected) == (2, 1), "row 0's first and row 1's only pending confirmed"
    together = settle(rows, plan, {0: 1, 1: None}, lockstep=True)
    assert together.rollbacks == {0: 4, 1: 4, 2: 4} and together.llm_writers == (0,) and together.kept == (1, 2)
    assert together.writers == (0, 1, 2) and together.slm_writers == ()
    assert (slots.thrown, together.thrown) == (2, 4), "tokens past each cut thrown away (a kept token stays)"
    planned = settle(rows, plan, {0: None, 1: None})
    assert planned == Outcome(plan.llm_writers, plan.slm_writers, {}, (), plan.resolving, plan.slm_reads, 3,
                              tally={0: (2, 0, 0), 1: (1, 0, 0)}, held={0: 2, 1: 1})
    assert slots.held == together.held == {0: 2, 1: 1}, "per resolving row: the pending positions judged"
    assert slots.tally == {0: (1, 1, 2), 1: (1, 0, 0)}, "per row: (agreed, rejected, thrown)"
    assert together.tally == {0: (1, 1, 2), 1: (1, 0, 1), 2: (0, 0, 1)}, "row 2 resolved nothing: cut back with them"
    assert planned.writers == plan.writers, "nothing rejected: the plan's commits"
    assert settle(rows, plan, {}).writers == plan.writers, "nothing to resolve: the plan as planned"


def test_a_row_the_router_is_sure_of_waits_rather_than_speculates():
    policy = WaitPolicy((3,), 16, speculate=4, speculate_below=0.9)
    rows = _rows({}, {})
    plan = plan_step(rows, 0, [0, 1], [True, True], set(), policy, sure=[True, False])
    assert plan.speculating == (1,) and plan.waiting == (0,), "row 0's score reached speculate_below"


def test_a_row_that_routes_everywhere_waits_for_its_frontier_token_once_it_holds_its_depth():
    """Its next position routes whatever the SLM proposes and it may hold no more pending positions: it waits without
    proposing (the SLM does not read its token now) and the resolution of its tail writes its next token."""
    from r2r_hf.core.ledger import Ledger

    policy = WaitPolicy((4,), 16, speculate=2)
    ledger = Ledger(3)
    ledger.rows = _rows({"routes": True, "pending": [Pending(0, 0)], "written": 1},
                        {"pending": [Pending(0, 0)], "written": 1}, {"routes": True, "written": 1})
    plan = plan_step(ledger.rows, 1, [0, 1, 2], [True, True, True], set(), policy)
    assert plan.frontier == (0,) and plan.speculating == (0, 1, 2), "row 1's router decides; row 2 holds one"
    assert plan.slm_reads == (1, 2) and plan.waiting == (0,)
    ledger.apply(plan, settle(ledger.rows, plan, {}), after={0: "stream after its draw"})
    assert (ledger.rows[0].waiting_since, ledger.rows[0].rng) == (2, "stream after its draw")
    assert ledger.proposing() == [1, 2]
    held = plan_step(ledger.rows, 2, [1, 2], [True, True], set(), WaitPolicy((3,), 16, speculate=2))
    assert held.llm_writers == (), "row 2 routes everywhere: it counts once its tail is full, not while it holds one"
    runs = plan_step(ledger.rows, 2, [1, 2], [True, True], set(), WaitPolicy((2,), 16, speculate=2))  # two wait
    assert runs.llm_writers == (0, 1, 2) and runs.resolving == (0, 1, 2) and runs.waited == (0, 0, 0)
    rows = _rows({"routes": True, "pending": [Pending(0, 0)]}, {"routes": True, "max_new": 1})
    assert plan_step(rows, 1, [0, 1], [True, True], set(), policy).frontier == (0,), "row 1 writes its last token"
    rows[1].max_new = 5
    assert plan_step(rows, 1, [0, 1], [True, False], set(), policy, lockstep=True).frontier == (), \
        "a rectangle's SLM reads every row or none: row 1 proposes next"


def test_rows_at_threshold_0_hold_as_many_pending_positions_as_the_load_allows():
    """Depth by load (``WaitPolicy.depths``, the server's on a GPU from the cost model): a row that routes everywhere
    holds at most the depth for the running rows, capped by ``speculate``; other rows hold ``speculate``."""
    from r2r_hf.core.policy import LOSSLESS_DEPTHS, serving_policy, speculative_policy

    policy = speculative_policy("cuda", 16, 16, adapts=False)  # (the depth by load alone: no row's own acceptance)
    assert policy.depths == LOSSLESS_DEPTHS and policy.depth(1, True) == 8 and policy.depth(12, True) == 6
    assert policy.depth(12) == 16 and speculative_policy("cuda", 16, 4).depth(1, True) == 4
    assert speculative_policy("cpu", 16, 16).depth(1, True) == 16, "on a CPU: --speculate"
    gains = serving_policy("cuda", 16, speculate=32, draft_cost=8.0)  # (the expected-gain rule ends the drafts)
    assert [gains.depth(n, True) for n in (1, 2, 3, 12)] == [32, 32, 6, 6] and not gains.adapts
    six = [Pending(i, i) for i in range(5)]
    alone = plan_step(_rows({"routes": True, "pending": list(six)}), 9, [0], [True], set(), policy)
    crowd = plan_step(_rows({"routes": True, "pending": list(six)}, {}, {}), 9, [0, 1, 2], [True, False, False],
                      set(), policy)
    assert alone.speculating == (0,) and alone.frontier == (), "alone it may hold 8"
    assert crowd.speculating == (0,) and crowd.frontier == (0,), "among 3 rows, 6: its sixth fills its tail"


def test_a_rows_own_depth_follows_its_acceptance():
    """``adapted`` (the rule, on plain values): back to the floor after a rejection, deeper after a tail as deep as
    the row was let go and confirmed whole, unchanged after a tail cut short or cut back by a neighbour."""
    from r2r_hf.core.plan import DRAFT_FIRST, DRAFT_FLOOR, DRAFT_GROWTH, adapted

    assert (DRAFT_FIRST, DRAFT_FLOOR, DRAFT_GROWTH) == (4, 2, 4), "the rule measured (docs: lossless.md)"
    assert adapted(4, 4, 4, False) == 8 and adapted(8, 8, 8, False) == 12, "a full draft confirmed whole: deeper"
    assert adapted(12, 12, 5, True) == 2 and adapted(2, 2, 0, True) == 2, "a rejection: short drafts"
    assert adapted(8, 3, 3, False) == 8, "a draft the SLM's doubt or the answer's end cut short: as it was"
    assert adapted(8, 8, 5, False) == 8, "cut back by a neighbour's rejection (a rectangle): as it was"
    assert adapted(12, 8, 8, False) == 12, "held back by the load or the request's depth: no deeper than that"


def test_the_depth_a_row_may_hold_is_the_least_of_the_load_the_request_and_its_own_acceptance():
    """``plan.depth``: a row at threshold 0 of a policy that ``adapts`` holds its own depth (``RowState.drafting``)
    within the policy's by load and its request's; a row the router decides, or a policy that does not adapt,
    ignores it."""
    from r2r_hf.core.plan import depth

    adapting = WaitPolicy((2,), 16, speculate=16, depths=(16, 6), adapts=True)
    fixed = WaitPolicy((2,), 16, speculate=16, depths=(16, 6))
    row = RowState(routes=True, drafting=10)
    assert depth(row, adapting, 1) == 10 and depth(row, adapting, 2) == 6 and depth(row, fixed, 1) == 16
    assert depth(RowState(routes=True, drafting=10, depth=3), adapting, 1) == 3, "the request's own depth"
    assert depth(RowState(routes=None, drafting=2), adapting, 1) == 16, "the router decides: its speculate"
    assert WaitPolicy().adapts is False and adapting.said().count("own acceptance") == 1
    from r2r_hf.core.policy import serving_policy

    assert serving_policy("cpu", 4, speculate=8).adapts and not serving_policy("cpu", 4, speculate=8, adapts=False).adapts
    assert not serving_policy("cuda", 4, speculate=8).adapts, "a GPU's depth by load is its default (the prediction)"


def test_a_draft_cost_replaces_the_depth_by_acceptance_in_generate_and_the_server():
    """``draft_cost`` (the expected-gain rule) decides where a draft ends: a row's depth by acceptance no longer caps
    it (its depth is the policy's), the policy says so, and ``generate``'s and the server's settings carry it."""
    from types import SimpleNamespace

    from r2r_hf.core.plan import depth
    from r2r_hf.core.policy import call_policy, serving_policy

    gaining = WaitPolicy((2,), 16, speculate=16, adapts=True, draft_cost=2.5)
    assert depth(RowState(routes=True, drafting=2), gaining, 1) == 16
    assert "no longer pays for itself (an LLM forward costing 2.5 SLM steps)" in gaining.said()
    served = serving_policy("cpu", 4, speculate=8, draft_cost=5.6)
    assert (served.draft_cost, served.adapts) == (5.6, False)
    assert serving_policy("cpu", 4, draft_cost=5.6).draft_cost == 0.0, "no speculation, no drafts"
    config = SimpleNamespace(speculate=8, draft_cost=2.5, do_sample=False, return_dict_in_generate=False)
    called = call_policy(config, 2)
    assert (called.draft_cost, called.adapts) == (2.5, False)


def test_the_ledger_moves_a_rows_depth_only_when_the_llm_judges_its_tail():
    """The rule's one home is the ledger's resolution (``Ledger.apply``): steps without the LLM leave the depth alone
    (the tail fills to it, the frontier last); a resolution that confirms a full tail whole deepens it, one that
    rejects sends it back to the floor, and the next tail fills to the new depth."""
    from r2r_hf.core.ledger import Ledger

    ledger, policy = Ledger(1), WaitPolicy((2,), 64, speculate=16, adapts=True)
    ledger.rows = _rows({"routes": True})
    judgements, tails, depths = [None, None, 3, None], [], []
    for step in range(40):
        row = ledger.rows[0]
        proposing = [] if row.waiting_since is not None else [0]
        plan = plan_step(ledger.rows, step, proposing, [True] * len(proposing), set(), policy)
        if plan.resolving:
            if not judgements:
                break
            tails.append(len(row.pending))
            ledger.apply(plan, settle(ledger.rows, plan, {0: judgements.pop(0)}))
            depths.append(ledger.rows[0].drafting)
        else:
            before = row.drafting
            ledger.apply(plan, settle(ledger.rows, plan, {}))
            assert ledger.rows[0].drafting == before, "no LLM, no change"
    assert tails == [4, 8, 12, 2] and depths == [8, 12, 2, 6], "full tails deepen, a rejection sends it back"
