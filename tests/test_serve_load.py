"""benchmarks/serving/load.py's configurations (the load itself needs the real pair: a benchmark, not a test)."""

from benchmarks.serving import load as serve_load


def test_every_configuration_records_the_policy_its_flags_name():
    """The speculative configurations name no --llm-min-rows: recording their policy raised KeyError after the
    first run, so no speculative load was ever measured."""
    policies = {name: serve_load._policy_of(flags) for name, flags in serve_load.CONFIGS.items()}
    assert policies["m1"] == {"min_rows": [1], "max_wait": 0}
    assert policies["spec"] == {"speculate": 8}
    assert policies["spec-below"] == {"speculate": 4, "speculate_below": 0.95}
    assert policies["spec-llm"] == {"speculate": 8, "threshold": 0.0}
