"""The router-building subcommands: ``label``, ``train``, ``calibrate``, ``push``, ``import-official``.

Each is a thin shell over the Python API (``r2r_hf.pipeline``, ``r2r_hf.training``, ``r2r_hf.model``).
"""

from __future__ import annotations

import argparse
import os
import sys

from ..pipeline.settings import LabelSettings
from ..pipeline.steps import NAMES as STEPS
from ..router_types import MLP, ROUTER_TYPES
from ..training.settings import DEFAULT_RECALL, TrainSettings
from .options import (
    add_settings_flags,
    add_threads_flag,
    device,
    dropout,
    fraction,
    positive_fraction,
    positive_int,
    require_dir,
    seed,
    settings_from,
    signal_names,
    widths,
)


# --------------------------------------------------------------- import-official
def _setup_import_official(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="official router: Hub repo id, folder, or .pt file (e.g. nics-efc/R2R_router)")
    p.add_argument("--out", required=True, help="folder to write the converted router to")
    p.add_argument("--subfolder", help="folder inside the repo, e.g. 'Qwen3-0.6B+Qwen3-8B'")
    p.add_argument("--slm", help="SLM Hub id or folder (default: from the published-router table)")
    p.add_argument("--llm", help="LLM Hub id or folder (default: from the published-router table)")
    p.add_argument("--revision", help="Hub revision of the router repo")
    _add_overwrite(p)


def _add_overwrite(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out folder that holds no r2r router (nothing there is deleted)")


def _run_import_official(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from ..model.hub import check_output_folder
    from ..model.loading import check_router_sizes
    from ..model.modeling import R2RForCausalLM

    check_output_folder(args.out, args.overwrite)
    hub = {"revision": args.revision} if args.revision else {}
    model = R2RForCausalLM.from_official(args.source, subfolder=args.subfolder, slm=args.slm, llm=args.llm, **hub)
    config = model.config
    try:
        slm_config = AutoConfig.from_pretrained(config.slm_name_or_path).get_text_config()
    except (OSError, ValueError):
        print(f"note: could not read the config of {config.slm_name_or_path!r} here; sizes are checked when the "
              "router is loaded with its SLM", file=sys.stderr)
    else:
        check_router_sizes(config, slm_config.hidden_size, slm_config.hidden_size, slm_config.vocab_size,
                           config.slm_name_or_path)
    model.save_pretrained(args.out)
    print(f"wrote {args.out}: SLM {config.slm_name_or_path}, LLM {config.llm_name_or_path}, "
          f"threshold {config.threshold:.4g}, router {sum(p.numel() for p in model.parameters()):,} parameters")
    return 0


# --------------------------------------------------------------- label / train / calibrate / push
def _setup_label(p: argparse.ArgumentParser) -> None:
    add_settings_flags(p, LabelSettings)  # the models, lengths and verifier chain (pipeline/settings.py)
    p.add_argument("--prompts", required=True, help='JSON lines: {"id", "prompt"} or {"id", "messages"}')
    p.add_argument("--out", required=True, help="run folder (an existing one with the same settings is resumed)")
    p.add_argument("--limit", type=positive_int, help="label only the first N prompts")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    add_threads_flag(p)


def _run_label(args: argparse.Namespace) -> int:
    import torch

    from ..pipeline import label

    if args.threads:
        torch.set_num_threads(args.threads)
    verifiers, judge = args.verifiers, args.judge
    if judge is None and _names_a_model(verifiers):  # the shorthand of r2r_hf 0.1: --verifier MODEL
        verifiers, judge = "llm", verifiers
    settings = settings_from(args, LabelSettings, verifiers=verifiers, judge=judge)
    steps = tuple(s.strip() for s in args.steps.split(",") if s.strip())
    summary = label(settings, args.prompts, args.out, limit=args.limit, steps=steps, progress=not args.quiet)
    if summary is not None:
        shares = summary["shares"]
        print(f"{summary['tokens']} tokens labelled in {args.out} (label set {summary['label_set']}): identical "
              f"{shares['identical']:.1%}, neutral {shares['neutral']:.1%}, divergent {shares['divergent']:.1%} "
              f"({summary['neutral_share_of_mismatches']:.1%} of mismatches neutral), excluded {summary['excluded']}")
    return 0


def _names_a_model(text: str) -> bool:
    return "/" in text or os.path.isdir(text)


def _add_target(p: argparse.ArgumentParser, default_recall: float | None) -> None:
    target = p.add_mutually_exclusive_group(required=default_recall is None)
    target.add_argument("--recall", type=positive_fraction, default=default_recall,
                        help="divergent-class recall to calibrate for" + (f" (default {default_recall})" if default_recall else ""))
    target.add_argument("--llm-rate", type=fraction, help="calibrate for this LLM token rate instead")


def _setup_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="a finished `r2r-hf label` folder")
    p.add_argument("--labels", help="its label set (default: the only one)")
    p.add_argument("--out", required=True, help="folder for the trained router")
    _add_target(p, DEFAULT_RECALL)
    add_settings_flags(p, TrainSettings)  # the optimisation settings (training/settings.py)
    p.add_argument("--router-type", choices=ROUTER_TYPES, default=MLP)
    p.add_argument("--hidden-dims", type=widths,
                   help="residual block widths, e.g. 512,512,512 (default: sized to the data)")
    p.add_argument("--expansion", type=positive_int, default=4, help="MLP expansion inside each block")
    p.add_argument("--signals", type=signal_names, default=[],
                   help="free signals of the SLM's top-k logits the router also reads, starting from the entropy "
                        "baseline: entropy, margin (default: none, the paper's router)")
    p.add_argument("--dropout", type=dropout, default=0.1)
    p.add_argument("--device", type=device(), default="cpu", help="where to train: cpu, cuda, cuda:N, mps")
    _add_overwrite(p)


def _run_train(args: argparse.Namespace) -> int:
    from ..training import train_router

    settings = settings_from(args, TrainSettings)
    extra = {"router_type": args.router_type, "router_expansion": args.expansion, "router_dropout": args.dropout,
             "router_signals": args.signals}
    if args.hidden_dims:
        extra["router_hidden_dims"] = args.hidden_dims
    model = train_router(args.data, args.out, settings, recall=args.recall, llm_rate=args.llm_rate,
                         device=args.device, progress=not args.quiet, overwrite=args.overwrite, labels=args.labels,
                         **extra)
    _print_calibration(args.out, model)
    return 0


def _setup_calibrate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", required=True, help="router folder to calibrate (updated in place)")
    p.add_argument("--data", required=True, help="a finished `r2r-hf label` folder")
    p.add_argument("--labels", help="its label set (default: the only one)")
    p.add_argument("--split", choices=("validation", "train", "all"), default="validation")
    p.add_argument("--seed", type=seed, default=0, help="the split seed used in training")
    _add_target(p, None)


def _run_calibrate(args: argparse.Namespace) -> int:
    from ..model.hub import check_output_folder
    from ..model.modeling import R2RForCausalLM
    from ..pipeline import load_labels
    from ..training import calibrate_router

    check_output_folder(args.router, update=True)  # before loading anything: the router is updated in place
    model = R2RForCausalLM.from_pretrained(args.router, load_pair=False)
    data = load_labels(args.data, seed=args.seed, labels=args.labels)
    if args.split != "all":
        data = data.split_of(args.split)
    calibrate_router(model, data, recall=args.recall, llm_rate=args.llm_rate, out_dir=args.router)
    _print_calibration(args.router, model)
    return 0


def _setup_push(p: argparse.ArgumentParser) -> None:
    p.add_argument("router", help="router folder (config.json, model.safetensors, README.md...)")
    p.add_argument("repo_id", help="Hub repo, e.g. org/my-router (created if missing)")
    p.add_argument("--private", action="store_true")
    p.add_argument("--revision", help="branch to push to")


def _run_push(args: argparse.Namespace) -> int:
    from ..model.hub import push_folder

    require_dir(args.router, "router")
    url = push_folder(args.router, args.repo_id, private=args.private or None, revision=args.revision)
    print(f"pushed {args.router} to {args.repo_id} {url or ''}".rstrip())
    return 0


def _print_calibration(folder: str, model) -> None:
    from ..model.record import RECALL_NOT_MEASURED

    record = model.record
    rate, calibration = record.llm_token_rate, record.calibration
    recall = calibration.get("recall")
    # An unmet recall target is also logged as a warning by calibrate_router (on stderr).
    missed = "" if record.target_met else f" (target {record.recall_target:.1%} not reached)"
    recall_text = "" if "recall" not in calibration else \
        f", divergent recall {RECALL_NOT_MEASURED if recall is None else f'{recall:.1%}{missed}'}"
    print(f"router in {folder}: threshold {model.config.threshold:.4g}, expected LLM token rate {rate:.1%}{recall_text}")


COMMANDS = {
    "label": ("label which SLM/LLM differences are divergent (resumable)", _setup_label, _run_label),
    "train": ("train and calibrate a router on a labeling run", _setup_train, _run_train),
    "calibrate": ("re-calibrate a router's threshold on labelled data", _setup_calibrate, _run_calibrate),
    "push": ("upload a router folder to the Hugging Face Hub", _setup_push, _run_push),
    "import-official": ("convert an official R2R .pt router into an r2r_hf router folder", _setup_import_official,
                        _run_import_official),
}
