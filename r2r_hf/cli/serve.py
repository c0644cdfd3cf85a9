"""``r2r-hf serve ROUTER``: an OpenAI-compatible server, one process or Ray Serve replicas.

Every server flag comes from ``ServeSettings`` (its defaults and help text); only the model
and scale-out flags are added here. Heavy modules are imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..serve.settings import ServeSettings
from .options import add_settings_flags, device, positive_int, settings_from, threads


def setup_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("router", help="router folder or Hub id")
    p.add_argument("--slm", help="SLM Hub id or folder (default: the one the router names)")
    p.add_argument("--llm", help="LLM Hub id or folder (default: the one the router names)")
    p.add_argument("--device", type=device(allow_auto=True), default="cpu",
                   help="cpu, cuda, cuda:1, or auto (accelerate device map)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    p.add_argument("--threads", type=threads, help="torch CPU threads (per replica)")
    add_settings_flags(p, ServeSettings)
    ray = p.add_argument_group("scale-out on Ray Serve (pip install r2r_hf[ray])")
    ray.add_argument("--ray", action="store_true", help="serve as a Ray Serve deployment")
    ray.add_argument("--replicas", type=positive_int, default=1, help="replicas, each holding the SLM, router and LLM")
    ray.add_argument("--ray-address", help="an existing cluster (ray start --head prints it); default: start one here")
    ray.add_argument("--gpus-per-replica", type=float, default=0.0, help="GPUs each replica reserves")
    ray.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs each replica reserves")
    ray.add_argument("--autoscaling", help="Ray Serve autoscaling_config as JSON (replaces --replicas), e.g. "
                                           "'{\"min_replicas\": 1, \"max_replicas\": 4}'")


def run_serve(args: argparse.Namespace) -> int:
    from ..serve import load_for_serving, require_extra, run_server, served_name

    require_extra("ray" if args.ray else "serve")
    settings = settings_from(args, ServeSettings)
    name = settings.model_name or served_name(args.router)
    if args.ray:
        from ..serve.ray_serve import ReplicaSpec, run_on_ray

        autoscaling = None
        if args.autoscaling:
            try:
                autoscaling = json.loads(args.autoscaling)
            except json.JSONDecodeError as err:
                raise ValueError(f"--autoscaling must be a JSON object ({err}).") from None
        spec = ReplicaSpec(router=args.router, slm=args.slm, llm=args.llm, device=args.device, dtype=args.dtype,
                           threads=args.threads, settings=settings, name=name)
        run_on_ray(spec, replicas=args.replicas, address=args.ray_address, gpus=args.gpus_per_replica,
                   cpus=args.cpus_per_replica, autoscaling=autoscaling)
        return 0
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer = load_for_serving(args.router, args.slm, args.llm, args.device, args.dtype)
    print(f"serving {name} on http://{settings.host}:{settings.port}/v1 (SLM {model.slm.name_or_path}, "
          f"LLM {model.llm.name_or_path}, threshold {settings.threshold or model.config.threshold:.4g})", file=sys.stderr)
    run_server(model, tokenizer, settings, name)
    return 0


COMMANDS = {
    "serve": ("serve the pair behind an OpenAI-compatible HTTP API (Ray Serve with --ray)", setup_serve, run_serve),
}
