"""The device check's serving phase, rehearsed on this CPU (tiny shapes, emulated graphs): every server runs on
captured steps, the LLM alone on the same engine never reads an SLM or routes, the forced share routes, and each
load says its time per step and how much of it was outside the graph replays."""

import json

from benchmarks.gpu import serve as gpu_serve


def test_the_serving_phase_dry_run_measures_every_server(tmp_path):
    gpu_serve.main(["--dry-run", "--out", str(tmp_path), "--no-peer", "--budget-s", "300"])
    servers = json.loads((tmp_path / "gpu_serve.json").read_text())["servers"]
    speculative = "R2R, speculative (worst case)"
    assert list(servers) == ["R2R, waiting", "LLM alone", "ratios", "R2R, m = 1", speculative], "in order of value"
    for name in ("R2R, waiting", "LLM alone", "R2R, m = 1", speculative):
        server = servers[name]
        assert [r["concurrency"] for r in server["runs"]] == [2, 4], name
        assert server["capture"]["path"] == "graphs", name
        for r in server["runs"]:
            assert r["tokens"] == 4 * r["requests"] and r["tokens_per_s"] > 0 and r["steps"] > 0, name
            assert 0 < r["outside_graphs_ms_per_step"] < r["ms_per_step"], name
            stages = r["host_stages_ms_per_step"]  # where the decoding thread's time went, per step
            assert {"propose", "sync", "read_llm", "commit", "_deliver"} <= set(stages), name
            assert all(v > 0 for v in stages.values()), name
            assert sum(stages.values()) < r["ms_per_step"], name
    assert all(r["llm_token_rate"] == 0.0 for r in servers["LLM alone"]["runs"]), "no LLM catch-up: it is the model"
    assert 0 < sum(r["llm_token_rate"] for r in servers["R2R, m = 1"]["runs"]) < 2
    assert sum(r["counters_total"]["speculative_rejected"] for r in servers[speculative]["runs"]) > 0, "it speculated"
    alone, r2r = servers["LLM alone"]["runs"], servers["R2R, waiting"]["runs"]
    assert servers["ratios"] == {str(a["concurrency"]): b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(alone, r2r)}


def test_the_llm_alone_is_the_llm_in_both_places_and_writes_what_it_writes_alone():
    import torch

    from benchmarks.synthetic import random_model
    from r2r_hf import R2RForCausalLM

    slm, llm = random_model("tiny", torch.float32, "cpu", 0), random_model("tiny-llm", torch.float32, "cpu", 1)
    model = R2RForCausalLM.from_models(slm, llm, router_hidden_dims=[16])
    alone = gpu_serve.llm_alone(model)
    assert alone.slm is llm and alone.llm is llm and alone.capture_store is not model.capture_store
    prompt = torch.randint(3, 1000, (1, 8), generator=torch.Generator().manual_seed(0))
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(alone.generate(prompt, **options, threshold=float("inf")), llm.generate(prompt, **options))


def test_the_llm_alone_reads_each_prompt_once():
    """The fair denominator (issue 49, item 6): the LLM alone reads each prompt once, in the one slot cache it decodes
    from. Built as R2R over (llm, llm), its second cache read every prompt again (chunked prefill reads a joining
    prompt with both models), a 32B forward that no LLM server pays."""
    import torch

    from benchmarks.synthetic import Letters, serving_shape
    from r2r_hf.serve.engine import Engine
    from r2r_hf.serve.settings import ServeSettings
    from r2r_hf.testing.graphs import emulated_store

    model = gpu_serve.build(True, "cpu", torch.float32)
    model.capture_store = emulated_store()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 900, (n,), generator=generator).tolist() for n in (16, 9, 23, 16, 12, 30)]
    max_tokens = 4
    with serving_shape(model), torch.inference_mode():
        alone = gpu_serve.llm_alone(model)
        settings = ServeSettings(max_batch_size=4, max_queue=64, batch_wait_ms=0, max_context=48,
                                 **gpu_serve.ALONE_OPTIONS)
        engine = Engine(alone, Letters(), settings)
        assert engine.capture_report["path"] == "graphs"
        engine.start()
        try:
            run = gpu_serve.load(engine, alone, prompts, 3, max_tokens, float("inf"), timeout=120)
        finally:
            engine.stop(0)
    counters = engine.counters
    assert run["tokens"] == max_tokens * len(prompts)
    assert counters.llm_forwards == counters.llm_rows_real == 0, "its second slot cache is never read"
    # the model reads each prompt once, and each answer token but the last (the answer ends there) once
    assert counters.slm_rows_real == sum(len(p) for p in prompts) + len(prompts) * (max_tokens - 1)
