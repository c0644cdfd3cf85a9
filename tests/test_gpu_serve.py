"""The device check's serving phase, rehearsed on this CPU (tiny shapes, emulated graphs): every server runs,
the captured ones on captured steps, and the forced share routes."""

import json

from benchmarks import gpu_serve


def test_the_serving_phase_dry_run_measures_every_server(tmp_path):
    gpu_serve.main(["--dry-run", "--out", str(tmp_path), "--no-peer", "--budget-s", "300"])
    servers = json.loads((tmp_path / "gpu_serve.json").read_text())["servers"]
    assert set(servers) == {"captured, waiting", "captured, m = 1", "eager, m = 1", "LLM alone, captured"}
    for name, server in servers.items():
        assert [r["concurrency"] for r in server["runs"]] == [1, 2], name
        assert all(r["tokens"] == 4 * r["requests"] and r["tokens_per_s"] > 0 for r in server["runs"]), name
        assert server["capture"]["path"] == ("eager" if name.startswith("eager") else "graphs"), name
    assert all(r["llm_token_rate"] == 1.0 for r in servers["LLM alone, captured"]["runs"])
    assert 0 < sum(r["llm_token_rate"] for r in servers["captured, m = 1"]["runs"]) < 2
