"""The Hugging Face layer: ``R2RForCausalLM`` (loading, saving, the ``generate`` hooks), loading the pair,
Hub I/O, the official routers, the router's record and model card, and the LogitsProcessor form."""
