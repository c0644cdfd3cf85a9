"""Serving R2R over HTTP: an OpenAI-compatible server (``r2r-hf serve``) and its Ray Serve deployment.

    from r2r_hf.serve import ServeSettings, build_app, run_server
    run_server(model, tokenizer, ServeSettings(port=8000), name="my-router")

Layers: ``settings`` (every default), ``protocol`` (the OpenAI bodies), ``rows`` (one answer's
settings, text and stop), ``engine`` (the decoding thread: continuous batching over the R2R loop),
``app`` (FastAPI routes), ``ray_serve`` (the same app as a Ray Serve deployment). Needs the
``serve`` extra (``pip install r2r_hf[serve]``; ``[ray]`` for Ray Serve).
"""

from __future__ import annotations

import logging

from .settings import ServeSettings

__all__ = ["ServeSettings", "build_app", "load_for_serving", "require_extra", "run_server", "served_name"]

DRAIN_GRACE_S = 5.0  # after the engine's drain ends the open answers, the seconds uvicorn gives them to flush
EXTRAS = {"serve": ("fastapi", "uvicorn"), "ray": ("fastapi", "uvicorn", "ray.serve")}


def require_extra(extra: str) -> None:
    """Refuse in one sentence when the packages of an optional extra are missing."""
    import importlib

    missing = []
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise RuntimeError(f"Serving{' on Ray' if extra == 'ray' else ''} needs {', '.join(missing)}: "
                           f"pip install 'r2r_hf[{extra}]'.")


def build_app(*args, **kwargs):
    """See ``app.build_app`` (imported on first use: FastAPI is an optional dependency)."""
    from .app import build_app as build

    return build(*args, **kwargs)


def served_name(router: str) -> str:
    """The model id a router is served as: a Hub id as is, a folder by its name."""
    import os

    if os.path.isdir(router):
        return os.path.basename(os.path.normpath(router))
    return router


def load_for_serving(router: str, slm: str | None = None, llm: str | None = None, device: str = "cpu",
                     dtype: str = "auto"):
    """The model (in eval mode) and the SLM's tokenizer for a router (``r2r-hf serve``, ``generate`` and ``chat``).

    Args:
        router, slm, llm: as ``R2RForCausalLM.from_pretrained``'s location, ``slm=`` and ``llm=``.
        device: ``cpu``, a device (``cuda:0``) or ``auto`` (an accelerate device map).
        dtype: ``auto`` (on an accelerator the checkpoints' dtype; on a CPU the checkpoints' bfloat16 or float16,
            or float32 where a decode step measured faster in it: ``model.loading.cpu_dtype_choice``, said in one
            line), ``bfloat16``, ``float16`` or ``float32``.
    """
    import torch

    from ..model.modeling import R2RForCausalLM
    from ..model.tokens import load_tokenizer

    kwargs = {}
    if dtype != "auto":
        kwargs["dtype"] = getattr(torch, dtype)
    if device != "cpu":
        kwargs["device_map"] = device
    model = R2RForCausalLM.from_pretrained(router, slm=slm, llm=llm, **kwargs).eval()
    if dtype == "auto":
        _faster_dtype_on_cpu(model)
    return model, load_tokenizer(model.slm)


def _faster_dtype_on_cpu(model) -> None:
    """``--dtype auto`` on a CPU: keep the checkpoints' low precision or cast to float32, whichever decodes faster
    here (measured once per machine). Casting after loading costs what loading in float32 would (the same cast), and
    lets the measurement use the SLM's own width and stored dtype. A float32 checkpoint is kept: auto never lowers
    precision."""
    import torch

    from ..model.loading import cpu_dtype_choice, hidden_size

    pair = (model.slm, model.llm)
    if any(p.device.type != "cpu" for m in pair for p in m.parameters()):
        return  # on an accelerator (or offloaded) auto keeps the checkpoints' dtype
    low = [m for m in pair if m.dtype in (torch.bfloat16, torch.float16)]
    log = logging.getLogger(__name__)
    if not low:
        log.warning("--dtype auto on this CPU: the checkpoints are float32, kept (auto never lowers precision; "
                    "--dtype bfloat16 loads them in bfloat16).")
        return
    choice = cpu_dtype_choice(hidden_size(model.slm), low[0].dtype)
    log.warning(choice.line)
    if choice.dtype == torch.float32:
        for m in low:
            m.to(torch.float32)


def default_threshold(model, settings: ServeSettings) -> float:
    """The threshold of a request that names none, resolved as its answer is (``resolve_row``: ``--threshold``, else
    the router's saved one, else its config's)."""
    from ..model.row_settings import resolve_row

    options = {} if settings.threshold is None else {"threshold": settings.threshold}
    return resolve_row(model, [0], max_new_tokens=1, **options).threshold


def run_server(model, tokenizer, settings: ServeSettings, name: str, sock=None) -> None:
    """Serve until SIGINT/SIGTERM; on either, in-flight requests finish (up to ``drain_seconds``) first.

    Args:
        sock: the socket to serve on, bound by ``listen.bind_listener`` (``r2r-hf serve`` binds it before loading
            the models, so a port in use is said at once); default: bound here.
    The line "serving NAME on http://HOST:PORT/v1 ..." goes to stderr once the server accepts connections, with the
    port it got (``--port 0``) and the threshold requests get.
    """
    import sys

    from .listen import bind_listener, serve_on, url_of
    from .settings import is_loopback

    sock = sock if sock is not None else bind_listener(settings.host, settings.port)
    try:
        app = build_app(model, tokenizer, settings, name)
    except BaseException:
        sock.close()
        raise
    engine = app.state.service.engine
    open_note = "" if settings.api_key or is_loopback(settings.host) else "; no API key: anyone who reaches it may call"

    def announce(port: int) -> None:
        print(f"serving {name} on {url_of(settings.host, port)}/v1 (SLM {model.slm.name_or_path}, LLM "
              f"{model.llm.name_or_path}, threshold {default_threshold(model, settings):.4g}{open_note})",
              file=sys.stderr, flush=True)

    # The engine's drain starts with the signal: answers in flight get drain_seconds, then each still open ends with
    # an error event and [DONE]; uvicorn's own deadline comes DRAIN_GRACE_S later, so it never cuts a stream mid-body.
    serve_on(app, sock, settings, announce, on_exit=lambda: engine.drain(settings.drain_seconds), grace=DRAIN_GRACE_S)
