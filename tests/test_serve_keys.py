"""The API key: a key no HTTP client can send is refused at start-up, in one sentence naming where it came from
(issue 41, item 8: a key file with a byte-order mark, two lines or a NUL started the server, then every client got
401). Nothing here starts a server: the key is checked before the port is bound or a model is looked at."""

import pytest

from r2r_hf.cli import main as cli_main
from r2r_hf.serve import ServeSettings

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
