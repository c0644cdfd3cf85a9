"""Where names are read from without a network: one quick probe, the cache, registered local copies, one sentence."""

import logging
import socket
import time

import pytest

from r2r_hf import R2RForCausalLM
from r2r_hf.model import sources
from r2r_hf.model.sources import Unavailable, register_local_copy, registered_copies, resolve


@pytest.fixture
def unreachable(monkeypatch):
    """No HF_HUB_OFFLINE, and a Hub endpoint on a local port nothing listens on (refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    sources._probe.cache_clear()
    yield
    sources._probe.cache_clear()


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("R2R_HF_CACHE", str(tmp_path / "home"))
    return tmp_path / "home"


def test_an_unreachable_hub_is_one_probe_and_one_sentence(unreachable, home):
    start = time.monotonic()
    with pytest.raises(Unavailable, match="nor in the Hugging Face cache, and the Hub cannot be reached"):
        resolve("org/not-cached", "the SLM")
    assert time.monotonic() - start < 1.0
    assert not sources.hub_reachable()


def test_a_router_that_cannot_be_fetched_fails_fast_in_the_callers_terms(unreachable, home):
    start = time.monotonic()
    with pytest.raises(OSError, match=r"^Could not load the router 'org/no-such-router': not a local folder"):
        R2RForCausalLM.from_pretrained("org/no-such-router")
    assert time.monotonic() - start < 5.0, "no retried requests"


def test_the_cli_says_it_with_its_flags(unreachable, home, router_dir, capsys):
    import json
    import shutil

    from r2r_hf.cli import main

    broken = home.parent / "router"
    shutil.copytree(router_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["slm_name_or_path"] = "org/not-cached-slm"
    (broken / "config.json").write_text(json.dumps(config))
    assert main(["generate", "--router", str(broken), "x"]) == 2
    err = capsys.readouterr().err
    assert "Could not load the SLM 'org/not-cached-slm': not a local folder" in err and "pass --slm" in err


def test_offline_mode_is_named_and_needs_no_probe(monkeypatch, home):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sources, "_probe", lambda *a: pytest.fail("no probe under HF_HUB_OFFLINE"))
    with pytest.raises(Unavailable, match=r"\(HF_HUB_OFFLINE is set\)"):
        resolve("org/not-cached", "the LLM")


def test_a_registered_copy_serves_a_hub_id_the_hub_cannot_and_says_so(unreachable, home, tmp_path, caplog):
    folder = tmp_path / "converted"
    folder.mkdir()
    register_local_copy("org/model", folder, "dequantised from a GGUF file")
    with caplog.at_level(logging.WARNING, logger="r2r_hf.model.sources"):
        found, hub = resolve("org/model", "the SLM", {"revision": "main", "cache_dir": "x"})
    assert found == str(folder.resolve()) and hub == {"cache_dir": "x"}
    assert "The SLM org/model: using the local copy" in caplog.text and "dequantised from a GGUF file" in caplog.text


def test_a_registered_copy_of_a_hub_model_is_only_a_fallback(home, tmp_path, monkeypatch):
    folder = tmp_path / "converted"
    folder.mkdir()
    register_local_copy("org/model", folder, "a conversion")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "hub_reachable", lambda: True)
    assert resolve("org/model", "the SLM") == ("org/model", {}), "the Hub's own files when the Hub can serve them"


def test_a_registered_name_that_is_no_hub_repo_is_served_from_anywhere(home, tmp_path, monkeypatch):
    folder = tmp_path / "router"
    folder.mkdir()
    register_local_copy("hub_cards/some-router", folder, "the shipped router", fallback=False)
    monkeypatch.setattr(sources, "hub_reachable", lambda: True)
    assert resolve("hub_cards/some-router", "the router")[0] == str(folder.resolve())


def test_a_cached_hub_id_is_read_from_the_cache_alone_when_the_hub_cannot_be_reached(unreachable, home, monkeypatch):
    monkeypatch.setattr(sources, "in_hf_cache", lambda name, filename=None, **hub: name == "org/cached")
    assert resolve("org/cached", "the SLM", {"revision": "v1"}) == ("org/cached", {"revision": "v1",
                                                                                   "local_files_only": True})


def test_registering_keeps_the_other_entries_and_a_damaged_registry_counts_as_empty(home, tmp_path):
    for name in ("a/one", "b/two"):
        (tmp_path / name).mkdir(parents=True)
        register_local_copy(name, tmp_path / name, name)
    assert set(registered_copies()) == {"a/one", "b/two"}
    (home / "local_models.json").write_text("{ damaged")
    assert registered_copies() == {}
    with pytest.raises(Unavailable, match="no such folder"):
        resolve("./not/here", "the SLM")
