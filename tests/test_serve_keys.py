"""The API key: where it comes from (--api-key-file, R2R_API_KEY, --api-key; one source at a time), that an empty
key, or none on a non-loopback address, is refused unless --allow-unauthenticated, and that a key no HTTP client can
send is refused at start-up in one sentence naming where it came from.

From issue 34's third hostile probe (items 19-21) and issue 41 (item 8: a key file with a byte-order mark, two lines
or a NUL started the server, then every client got 401). Only the test of the key's sources starts servers: the
key is checked before the port is bound or a model is looked at."""

import os

import httpx
import pytest

from r2r_hf.cli import main as cli_main
from r2r_hf.serve import ServeSettings
from serving import posix_only, short_completion

BAD = {
    "bom": ("\ufeffsekrit\n", "starts with a UTF-8 byte-order mark"),
    "two-lines": ("sekrit\nother\n", "holds 2 lines"),
    "nul": ("sek\0rit\n", "holds a character no HTTP header can carry ('\\x00' at position 3)"),
    "non-ascii": ("clé\n", "holds a character no HTTP header can carry ('\\xe9' at position 2)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_key_file_no_client_can_send_is_refused_at_start(case, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("R2R_API_KEY", raising=False)
    text, message = BAD[case]
    keyfile = tmp_path / "key"
    keyfile.write_bytes(text.encode("utf-8"))
    # A router that does not exist: were the key accepted, the command would fail later, on the router instead.
    assert cli_main(["serve", str(tmp_path / "no-router"), "--port", "0", "--api-key-file", str(keyfile)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: The key file {keyfile} {message}") and len(err.strip().splitlines()) == 1, err
    assert "router" not in err


def test_a_key_from_the_flag_or_the_environment_is_checked_alike(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("R2R_API_KEY", "two\nlines")
    assert cli_main(["serve", str(tmp_path / "no-router"), "--port", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: $R2R_API_KEY holds 2 lines")
    monkeypatch.delenv("R2R_API_KEY")
    assert cli_main(["serve", str(tmp_path / "no-router"), "--port", "0", "--api-key", "a\x7fb"]) == 2
    assert capsys.readouterr().err.startswith("error: --api-key holds a character no HTTP header can carry")
    for key in ("\ufeffk", "a\nb", "a\0b", "tab\there"):
        with pytest.raises(ValueError, match="^api_key (starts with a UTF-8 byte-order mark|holds)"):
            ServeSettings(api_key=key)
    assert ServeSettings(api_key="printable ASCII with spaces ~!").api_key == "printable ASCII with spaces ~!"


# ------------------------------------------------------------------ issue 34, items 19-21
@posix_only
def test_an_empty_api_key_is_refused_not_read_as_none(router_dir, capsys, monkeypatch):
    monkeypatch.delenv("R2R_API_KEY", raising=False)
    for key, message in (("", "--api-key is empty (an unset variable?)"), ("  ", "--api-key is empty"),
                         (" sekrit", "starts or ends with whitespace")):
        assert cli_main(["serve", str(router_dir), "--api-key", key]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setenv("R2R_API_KEY", "")
    assert cli_main(["serve", str(router_dir)]) == 2
    assert "$R2R_API_KEY is empty" in capsys.readouterr().err
    with pytest.raises(ValueError, match="api_key is empty"):
        ServeSettings(api_key="")


@posix_only
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1"])
def test_a_network_address_without_a_key_is_refused_unless_asked_for(host, router_dir, capsys, monkeypatch):
    monkeypatch.delenv("R2R_API_KEY", raising=False)
    assert cli_main(["serve", str(router_dir), "--host", host]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {host!r} is not a loopback address and no API key is set, so anyone who can reach it "
                   "could use the server; set a key (R2R_API_KEY or --api-key-file on the command line) or "
                   "--allow-unauthenticated to serve openly.\n")
    assert ServeSettings(host=host, api_key="k").api_key == "k"
    assert ServeSettings(host=host, allow_unauthenticated=True).host == host
    for loopback in ("127.0.0.1", "127.0.0.2", "::1", "localhost", "::ffff:127.0.0.1"):
        assert ServeSettings(host=loopback).api_key is None


@posix_only
def test_the_key_comes_from_a_file_or_the_environment(serve_process, router_dir, tmp_path, monkeypatch):
    name = os.path.basename(str(router_dir))
    keyfile = tmp_path / "key"
    keyfile.write_text("from-the-file\n")  # echo's newline is no part of the key
    keyfile.chmod(0o600)
    s = serve_process("--port", "0", "--api-key-file", str(keyfile), env={"R2R_API_KEY": "from-the-environment"})
    url = s.url()
    assert "from-the-file" not in " ".join(open(f"/proc/{s.process.pid}/cmdline").read().split("\0"))
    assert short_completion(url, name).status_code == 401
    auth = {"Authorization": "Bearer from-the-file"}
    reply = httpx.post(url + "/v1/completions", headers=auth, timeout=60,
                       json={"model": name, "prompt": "x", "max_tokens": 2})
    assert reply.status_code == 200
    e = serve_process("--port", "0", env={"R2R_API_KEY": "from-the-environment"})
    assert httpx.get(e.url() + "/v1/models", timeout=10, headers={"Authorization": "Bearer from-the-environment"}) \
        .status_code == 200


@posix_only
def test_key_sources_are_checked_in_one_sentence(router_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("R2R_API_KEY", raising=False)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for flags, message in (
        (["--api-key", "a", "--api-key-file", str(empty)], "Give the API key once: --api-key or --api-key-file"),
        (["--api-key-file", str(empty)], f"The key file {empty} is empty"),
        (["--api-key-file", str(tmp_path / "none")], f"Cannot read the key file {tmp_path / 'none'}: No such file"),
    ):
        assert cli_main(["serve", str(router_dir), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


@posix_only
def test_help_says_which_key_source_to_prefer(capsys):
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "prefer --api-key-file or R2R_API_KEY" in out and "--allow-unauthenticated" in out
