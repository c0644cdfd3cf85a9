"""The inference core: one decoding loop for ``generate`` and the server. Nothing here knows about HF ``generate``.

The loop (this folder) reads top to bottom as steps over explicit values: ``decoding`` is ``generate``'s loop,
``turn`` the schedule both run (``decode_step``: propose, sync, plan, the LLM's read, settle, commit, apply, over
the ``DeviceStep`` protocol a ``batch`` implements), ``plan`` the step's two decisions as plain values, ``moves`` each
row's move in them (one rule), ``step`` the values its device side hands between its stages, ``ledger`` each row's
progress on the host, ``speculation`` the resolving read and the rollback; ``routing``, ``policy``, ``choice``,
``budget``, ``sampling``, ``counters``, ``outputs``, ``pair``, ``features``, ``notes`` and ``staging`` are what they
use; ``abilities`` says what each model of a pair can do on the fast paths (its checks: ``probes``), the one place
that probes a model. ``layouts/`` is where rows keep their tokens and caches (HF's rectangle, or the server's slots);
``fast/`` is the fast path (captured and fused reads, the captured router, the store that lends captures to calls).

Words, each with one meaning here:

* **row**       one answer being written: a row of a generate call's left-padded batch, or a served answer.
* **slot**      a fixed place for a row in the server's caches (``layouts/slot_layout.py``); a row joins a free slot
                and leaves it when its answer ends.
* **lockstep**  the rows move together (HF's rectangle: one length for every row): the LLM reads every row whenever
                it runs, no row waits for it, a rollback cuts every row back. Slots are not in lockstep.
* **read**      a model reading the tokens of some rows it has not read yet into its cache, in one or more forwards:
                a prompt's prefill, the SLM's one-token read after each committed token, the LLM's catch-up.
* **step**      one decoding step of a running batch (``turn.decode_step``): every row that is not waiting
                proposes, the host synchronises once, ``plan.plan_step`` decides (a ``StepPlan``), the LLM reads
                what the plan asks for, ``plan.settle`` decides what the step commits (an ``Outcome``), the batch
                commits it, the ledger applies it.
* **pending**   a routed position a row went past with the SLM's token (speculative routing): the LLM has not yet
                judged it.
* **settle**    decide what a step commits once the LLM has judged its pending positions (``plan.settle``): the plan
                as planned where it confirmed them all.
* **rollback**  a row cut back to the first pending position the LLM rejected: its tokens past it thrown away, both
                models' caches, its budget and its random stream back to where they stood there
                (``speculation.roll_back``), then the LLM's token written there.
* **confirmed** a committed token no rollback can take back (every token before the row's first pending position);
                callers see confirmed tokens only.
* **move**      what a proposing row does at a step (``moves.move``, one rule for every step): it writes the SLM's
                token, speculates, waits for the LLM, or takes its frontier (where the LLM runs in the step, it
                writes the rows that speculate or wait).
* **block**     a draft block: steps the server's SLM drafts on the device between two host synchronisations
                (``fast/drafts.py``), planned once (``plan.plan_block``); the LLM does not run inside one.
* **ledger**    the host-side record of every row's progress (``ledger.Ledger``); ``Ledger.apply`` is its one writer.
* **turn**      one iteration of a serving loop: a piece of each prompt being read, one step, the ended rows leave.
* **call**      a model call of a generate call's rectangle (``layouts/rectangle.ModelCalls``), or a fixed-shape call
                the fast path captures (``fast/graphs.py``).
"""
