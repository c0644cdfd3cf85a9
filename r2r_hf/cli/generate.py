"""``r2r-hf generate`` and ``r2r-hf chat``: stream an answer with the LLM's tokens in colour."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from .options import (
    add_model_flags,
    fraction,
    load_models,
    non_negative,
    non_negative_int,
    positive_fraction,
    positive_int,
    seed,
)


def add_generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=non_negative)
    p.add_argument("--top-p", type=positive_fraction)
    p.add_argument("--top-k", type=non_negative_int)
    p.add_argument("--seed", type=seed, help="random seed for sampling")
    p.add_argument("--threshold", type=non_negative, help="routing threshold for this run (default: the router's)")
    p.add_argument("--llm-budget", type=fraction, metavar="SHARE",
                   help="the LLM writes at most this share of the answer's tokens (e.g. 0.1), where the router is surest")
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    p.add_argument("--system", help="system message (chat template only)")


def encode(tokenizer, messages: list[dict], raw: bool, model, max_new_tokens: int) -> dict:
    """Token ids for a turn; refuses prompts that do not fit the models' context."""
    from ..model.loading import context_length

    if raw or not getattr(tokenizer, "chat_template", None):
        ids = tokenizer("\n".join(m["content"] for m in messages if m["role"] != "system"), return_tensors="pt")
    else:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    limit = context_length(model.slm, model.llm)
    length = ids["input_ids"].shape[1]
    if limit and length + max_new_tokens > limit:
        raise ValueError(
            f"The prompt has {length} tokens; with --max-new-tokens {max_new_tokens} it exceeds the models' context "
            f"of {limit} tokens. Shorten it or lower --max-new-tokens."
        )
    device = model.device
    return {k: v.to(device) for k, v in ids.items()}


def generation_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample, "return_dict_in_generate": True}
    for name in ("temperature", "top_p", "top_k", "threshold", "llm_budget"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    if args.seed is not None:
        import torch

        torch.manual_seed(args.seed)
    return kwargs


def stats_line(out, seconds: float) -> str:
    n = int(out.generated_mask.sum())
    budget = "" if out.llm_budget is None else f" (budget {out.llm_budget:.1%})"
    return (f"[{n} tokens, LLM token rate {out.llm_token_rate:.1%}{budget}, {n / max(seconds, 1e-9):.1f} tokens/s, "
            f"{seconds:.1f} s]")


def run_generate(args: argparse.Namespace) -> int:
    if not args.prompt.strip():
        raise ValueError("The prompt is empty; pass the text to answer as the last argument (or use `r2r-hf chat`).")
    from ..views import RoutingStreamer, to_html

    model, tokenizer = load_models(args)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}]
    inputs = encode(tokenizer, messages, args.no_chat_template, model, args.max_new_tokens)
    streamer = RoutingStreamer(tokenizer)
    start = time.perf_counter()
    out = model.generate(**inputs, **generation_kwargs(args), streamer=streamer)
    seconds = time.perf_counter() - start
    print(stats_line(out, seconds), file=sys.stderr)
    if args.html:
        Path(args.html).write_text(to_html(out, tokenizer, title="R2R: " + args.prompt[:60]), encoding="utf-8")
        print(f"[wrote {args.html}]", file=sys.stderr)
    return 0


def _stop_flag():
    """A stopping criterion that ends generation at the next step once its ``stop`` is set (Ctrl-C in a chat)."""
    import torch
    from transformers import StoppingCriteria

    class StopFlag(StoppingCriteria):
        def __init__(self) -> None:
            self.stop = False

        def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
            return torch.full((input_ids.shape[0],), self.stop, dtype=torch.bool, device=input_ids.device)

    return StopFlag()


def run_chat(args: argparse.Namespace) -> int:
    from transformers import StoppingCriteriaList

    from ..views import RoutingStreamer

    model, tokenizer = load_models(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("r2r chat: LLM-written tokens are coloured. Ctrl-C stops a turn; Ctrl-D or /exit quits.", file=sys.stderr)
    while True:
        try:
            text = input("you> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /exit to quit)", file=sys.stderr)
            continue
        if text.strip() in ("/exit", "/quit"):
            return 0
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        try:
            inputs = encode(tokenizer, messages, args.no_chat_template, model, args.max_new_tokens)
        except ValueError as err:  # the conversation outgrew the context: say so, keep the chat alive
            messages.pop()
            print(f"error: {err} Start a new chat to reset the history.", file=sys.stderr)
            continue
        flag = _stop_flag()
        previous = signal.signal(signal.SIGINT, lambda *_: setattr(flag, "stop", True))
        try:
            start = time.perf_counter()
            out = model.generate(**inputs, **generation_kwargs(args), streamer=RoutingStreamer(tokenizer),
                                 stopping_criteria=StoppingCriteriaList([flag]))
            seconds = time.perf_counter() - start
        finally:
            signal.signal(signal.SIGINT, previous)
        prompt_length = inputs["input_ids"].shape[1]
        reply = tokenizer.decode(out.sequences[0, prompt_length:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        print(("[stopped] " if flag.stop else "") + stats_line(out, seconds), file=sys.stderr)


def setup_generate(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    add_generation_options(p)
    p.add_argument("--html", help="also write a standalone HTML view of the routing to this file")
    p.add_argument("prompt", help="the prompt (the chat template is applied unless --no-chat-template)")


def setup_chat(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    add_generation_options(p)


COMMANDS = {
    "generate": ("stream an answer; the LLM's tokens are coloured", setup_generate, run_generate),
    "chat": ("interactive multi-turn chat with routing colours", setup_chat, run_chat),
}
