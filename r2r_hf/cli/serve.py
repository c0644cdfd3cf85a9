"""``r2r-hf serve ROUTER``: an OpenAI-compatible server, one process or Ray Serve replicas.

Every server flag comes from ``ServeSettings`` (its defaults and help text), the model flags from
``options.add_model_flags``; only the scale-out flags are added here. Heavy modules are imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
import os

from ..serve.settings import ServeSettings, key_problem
from .options import add_model_flags, add_settings_flags, load_models, positive_int, positive_seconds, settings_from

KEY_VARIABLE = "R2R_API_KEY"


def setup_serve(p: argparse.ArgumentParser) -> None:
    add_model_flags(p, router_flag=False, threads_help="torch CPU threads (per replica)")
    add_settings_flags(p, ServeSettings)
    p.add_argument("--api-key-file", metavar="PATH",
                   help=f"read the API key from this file (preferred, with {KEY_VARIABLE}: a key given with --api-key "
                        f"is visible to every local user in ps); without either flag the key is ${KEY_VARIABLE}")
    ray = p.add_argument_group("scale-out on Ray Serve (pip install r2r_hf[ray])")
    ray.add_argument("--ray", action="store_true", help="serve as a Ray Serve deployment")
    ray.add_argument("--replicas", type=positive_int, default=1, help="replicas, each holding the SLM, router and LLM")
    ray.add_argument("--ray-address", help="an existing cluster (ray start --head prints it); default: start one here")
    ray.add_argument("--gpus-per-replica", type=float, default=0.0, help="GPUs each replica reserves")
    ray.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs each replica reserves")
    ray.add_argument("--autoscaling", help="Ray Serve autoscaling_config as JSON (replaces --replicas), e.g. "
                                           "'{\"min_replicas\": 1, \"max_replicas\": 4}'")
    ray.add_argument("--ray-start-timeout", type=positive_seconds, default=1800.0,
                     help="seconds the deployment may take to be placed and loaded before the command gives up "
                          "(default: 1800; on a Ray started here, replicas that cannot fit are refused at once)")


def api_key(args: argparse.Namespace) -> str | None:
    """The API key: ``--api-key-file``, else ``--api-key``, else ``$R2R_API_KEY``; an empty one is refused by name
    (an unset variable in a script would otherwise turn authentication off)."""
    if args.api_key is not None and args.api_key_file:
        raise ValueError("Give the API key once: --api-key or --api-key-file, not both.")
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key, source = f.read().strip(), f"The key file {args.api_key_file}"  # its newline is no part of it
        except (OSError, UnicodeDecodeError) as err:
            raise OSError(f"Cannot read the key file {args.api_key_file}: {getattr(err, 'strerror', None) or err}.") \
                from None
    elif args.api_key is not None:
        key, source = args.api_key, "--api-key"
    elif KEY_VARIABLE in os.environ:
        key, source = os.environ[KEY_VARIABLE], f"${KEY_VARIABLE}"
    else:
        return None
    if not key.strip():
        raise ValueError(f"{source} is empty (an unset variable?); give a key, or no key at all to serve without one.")
    if problem := key_problem(key):
        raise ValueError(f"{source} {problem}.")
    return key


def run_serve(args: argparse.Namespace) -> int:
    from ..serve import require_extra, run_server, served_name

    if args.ray and not args.ray_address:
        from ..serve.ray_local import loopback_ray_environment

        loopback_ray_environment()  # before Ray is imported: it reads this once
    require_extra("ray" if args.ray else "serve")
    from ..serve.listen import bind_listener  # uvicorn's: after the check that it is installed

    args.api_key = api_key(args)
    settings = settings_from(args, ServeSettings)
    name = settings.model_name or served_name(args.router)
    if args.ray:
        from ..serve.ray_serve import ReplicaSpec, run_on_ray

        if settings.port == 0:
            raise ValueError("--port 0 cannot be used with --ray: Ray Serve's proxy listens on a fixed port.")
        bind_listener(settings.host, settings.port).close()  # Ray's proxy binds it later: say a port in use now
        autoscaling = None
        if args.autoscaling:
            try:
                autoscaling = json.loads(args.autoscaling)
            except json.JSONDecodeError as err:
                raise ValueError(f"--autoscaling must be a JSON object ({err}).") from None
        spec = ReplicaSpec(router=args.router, slm=args.slm, llm=args.llm, device=args.device, dtype=args.dtype,
                           threads=args.threads, settings=settings, name=name)
        run_on_ray(spec, replicas=args.replicas, address=args.ray_address, gpus=args.gpus_per_replica,
                   cpus=args.cpus_per_replica, autoscaling=autoscaling, start_timeout=args.ray_start_timeout)
        return 0
    sock = bind_listener(settings.host, settings.port)  # before loading: a port in use is said at once
    try:
        model, tokenizer = load_models(args)
    except BaseException:
        sock.close()
        raise
    run_server(model, tokenizer, settings, name, sock=sock)  # announces itself once it accepts connections
    return 0


COMMANDS = {
    "serve": ("serve the pair behind an OpenAI-compatible HTTP API (Ray Serve with --ray)", setup_serve, run_serve),
}
