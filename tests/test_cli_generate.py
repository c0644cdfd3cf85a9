"""`r2r-hf generate` / `chat`, the colouring streamer and the HTML view (checked in a real browser)."""

import io
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from r2r_hf.cli import main as cli_main
from r2r_hf.views import RoutingStreamer
from r2r_hf.views import LLM_COLOR, to_ansi, to_html


GREEDY = dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=True)


def _mixed(model, enc):
    probe = model.generate(**enc, **GREEDY, threshold=float("inf"))
    threshold = probe.router_scores[probe.generated_mask].median().item()
    return model.generate(**enc, **GREEDY, threshold=threshold)


def test_routing_streamer_colours_exactly_the_llm_tokens(model, tok, single):
    stream = io.StringIO()
    out = model.generate(**single, **{**GREEDY, "return_dict_in_generate": True}, threshold=0.0,
                         streamer=RoutingStreamer(tok, stream=stream, color=True))
    text = stream.getvalue()
    assert text.replace(LLM_COLOR, "").replace("\033[0m", "").rstrip("\n") == to_ansi(out, tok, color=False)
    assert text.count(LLM_COLOR) > 0
    plain = io.StringIO()
    model.generate(**single, **GREEDY, threshold=float("inf"), streamer=RoutingStreamer(tok, stream=plain, color=True))
    assert LLM_COLOR not in plain.getvalue()


def test_no_color_is_respected(monkeypatch, tok):
    monkeypatch.setenv("NO_COLOR", "1")
    assert RoutingStreamer(tok, stream=io.StringIO()).color is False


def test_ansi_and_html_mark_the_routed_tokens(model, tok, single):
    out = _mixed(model, single)
    page = to_html(out, tok)
    assert page.count('data-routed="1"') == int(out.routed.sum())
    assert page.count('class="tok ') == int(out.generated_mask.sum())
    assert "<script" not in page and "http" not in page.split("<body>")[1], "standalone page, no external assets"
    assert f"{out.llm_token_rate:.1%}" in page
    assert to_ansi(out, tok).count(LLM_COLOR) <= int(out.routed.sum())


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Chromium is not installed here")
def test_html_view_in_headless_chromium(model, tok, batch, tmp_path):
    out = _mixed(model, batch)
    probe = """<script>
    const rows = [...document.querySelectorAll('section')].map(s =>
      [...s.querySelectorAll('.tok')].map(t => getComputedStyle(t).backgroundColor !== 'rgba(0, 0, 0, 0)'));
    document.body.setAttribute('data-highlighted', JSON.stringify(rows));
    </script></body>"""
    path = tmp_path / "view.html"
    path.write_text(to_html(out, tok).replace("</body>", probe))
    result = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--dump-dom", f"file://{path}"], capture_output=True, text=True, timeout=120)
    marker = "data-highlighted=\""
    dom = result.stdout
    assert marker in dom, result.stderr[-2000:]
    highlighted = json.loads(dom.split(marker)[1].split('"')[0].replace("&quot;", '"'))
    for row in range(out.sequences.shape[0]):
        expected = out.routed[row][out.generated_mask[row]].tolist()
        assert highlighted[row] == expected
    assert any(any(r) for r in highlighted) and not all(all(r) for r in highlighted)


def _cli(*args):
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}
    return [sys.executable, "-m", "r2r_hf.cli", "--quiet", *args], env


def test_generate_command_streams_then_prints_stats_and_html(router_dir, tok, tmp_path):
    command, env = _cli("generate", "--router", str(router_dir), "--max-new-tokens", "12", "--threshold", "0",
                        "--html", str(tmp_path / "view.html"), "the old man")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "\033[" not in result.stdout, "no colour when stdout is not a terminal"
    assert "LLM token rate 100.0%" in result.stderr and "tokens/s" in result.stderr
    assert (tmp_path / "view.html").read_text().count('data-routed="1"') == 12


@pytest.mark.parametrize("args, message", [
    (["--router", "/no/such/router", "x"], "The router folder /no/such/router does not exist;"),
    (["--router", "ROUTER", "--max-new-tokens", "100000", "x"], "exceeds the models' context of 1024 tokens"),
    (["--router", "ROUTER", "--top-p", "2", "x"], "expected a number in (0, 1]"),
    (["--router", "ROUTER", "--llm-budget", "1.5", "x"], "expected a number between 0 and 1, got '1.5'"),
])
def test_generate_errors_are_one_sentence(router_dir, args, message):
    args = [str(router_dir) if a == "ROUTER" else a for a in args]
    command, env = _cli("generate", *args)
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("value", ["1.5", "-0.1", "nan", "much"])
def test_serve_refuses_a_bad_llm_budget_in_one_sentence_before_loading_anything(value, capsys):
    from r2r_hf.cli import main
    from r2r_hf.serve.settings import ServeSettings

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "/no/such/router", "--llm-budget", value])
    assert exit_.value.code == 2 and "--llm-budget: expected a number" in capsys.readouterr().err
    with pytest.raises(ValueError, match="llm_budget must be a share of the answer's tokens between 0 and 1"):
        ServeSettings(llm_budget=float(value) if value != "much" else value)


def test_missing_pair_error_names_the_model(router_dir, tmp_path, capsys):
    config = json.loads((router_dir / "config.json").read_text())
    broken = tmp_path / "broken"
    shutil.copytree(router_dir, broken)
    config["llm_name_or_path"] = str(tmp_path / "gone-llm")
    (broken / "config.json").write_text(json.dumps(config))
    assert cli_main(["generate", "--router", str(broken), "x"]) == 2
    err = capsys.readouterr().err
    assert "Could not load the LLM" in err and "gone-llm" in err and "pass --llm" in err, "the shell's terms: flags"


def test_chat_keeps_history_and_ctrl_c_stops_only_the_turn(router_dir):
    command, env = _cli("chat", "--router", str(router_dir), "--max-new-tokens", "500", "--no-chat-template")
    proc = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, bufsize=0)
    proc.stdin.write("the old man\n")
    proc.stdin.flush()
    seen = ""
    while not seen.endswith("you> ") or len(seen) < 6:  # the first prompt, then the first streamed characters
        seen += proc.stdout.read(1)
        if seen.startswith("you> ") and len(seen) > 5:
            break
    proc.send_signal(signal.SIGINT)  # mid-turn: stops the answer, not the program
    proc.stdin.write("water\n")
    proc.stdin.write("/exit\n")
    proc.stdin.flush()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert err.count("[stopped]") == 1 and err.count("LLM token rate") == 2
    assert (seen + out).count("you> ") == 3
