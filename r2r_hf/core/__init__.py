"""The inference core: one decoding loop for ``generate`` and the server. Nothing here knows about HF ``generate``.

The loop (this folder) reads top to bottom as steps over explicit values: ``decoding`` is ``generate``'s loop,
``turn`` the schedule both run, ``plan`` the step's decisions as a plain value, ``step`` their execution on the
device over a ``batch``; ``routing``, ``policy``, ``choice``, ``budget``, ``sampling``, ``counters``, ``outputs``,
``pair``, ``features``, ``notes`` and ``staging`` are what they use. ``layouts/`` is where rows keep their tokens and
caches (HF's rectangle, or the server's slots); ``fast/`` is the fast path (captured and fused reads, the captured
router, the store that lends captures to calls).

Words, each with one meaning here:

* **row**    one answer being written: a row of a generate call's left-padded batch, or a served answer.
* **slot**   a fixed place for a row in the server's caches (``layouts/slot_layout.py``); a row joins a free slot
             and leaves it when its answer ends.
* **read**   a model reading the tokens of some rows it has not read yet into its cache, in one or more forwards:
             a prompt's prefill, the SLM's one-token read after each committed token, the LLM's catch-up.
* **step**   one decoding step of a running batch: every row that is not waiting proposes a token, the host
             synchronises once, ``plan.plan_step`` decides, and the plan runs (the LLM's catch-up, the commits, the
             SLM's read). ``StepPlan`` is one step's decisions.
* **turn**   one iteration of a serving loop: a piece of each prompt being read, one step, the ended rows leave.
* **call**   a model call of a generate call's rectangle (``layouts/rectangle.ModelCalls``), or a fixed-shape call
             the fast path captures (``fast/graphs.py``).
"""
