"""Reading ``prompts.jsonl`` and turning each prompt into token ids.

Each line is ``{"id": ..., "prompt": "..."}`` (used as is) or ``{"id": ..., "messages": [...]}``
(the tokenizer's chat template is applied with a generation prompt).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Prompt:
    """One labeling prompt."""

    id: str
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None

    def ids(self, tokenizer) -> list[int]:
        """Token ids of the prompt (chat template applied to ``messages``)."""
        if self.messages is not None:
            out = tokenizer.apply_chat_template(list(self.messages), add_generation_prompt=True, tokenize=True)
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        return tokenizer(self.prompt, add_special_tokens=False)["input_ids"]


def read_prompts(path: str | os.PathLike, limit: int | None = None, tokenizer=None) -> list[Prompt]:
    """Parse a prompts file; any malformed line is an error naming the file and line.

    Args:
        path: a JSON-lines file.
        limit: keep only the first ``limit`` prompts.
        tokenizer: when given, every prompt must become at least one token with it (and ``messages``
            need its chat template), so that nothing is written for a prompt that would fail later.
    """
    if os.path.isdir(path):
        raise IsADirectoryError(f"The prompts file {path} is a folder; pass the prompts file (JSON lines) itself.")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Prompts file {path} does not exist.")
    prompts: list[Prompt] = []
    seen: set[str] = set()
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid UTF-8 ({err.reason} at byte {err.start}); save the "
                                 "file as UTF-8.") from None
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg}).") from None
            if not isinstance(row, dict) or "id" not in row:
                raise ValueError(f'{where}: each line must be an object with an "id" and a "prompt" or "messages".')
            has_prompt, has_messages = "prompt" in row, "messages" in row
            if has_prompt == has_messages:
                raise ValueError(f'{where}: give exactly one of "prompt" (a string) or "messages" (a chat list).')
            pid = str(row["id"])
            if pid in seen:
                raise ValueError(f"{where}: id {pid!r} appears twice; ids must be unique.")
            seen.add(pid)
            if has_prompt:
                if not isinstance(row["prompt"], str) or not row["prompt"].strip():
                    raise ValueError(f'{where}: "prompt" must be a string with text in it (not only whitespace).')
                prompts.append(Prompt(pid, prompt=row["prompt"]))
            else:
                messages = row["messages"]
                if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages
                ):
                    raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} strings.')
                prompts.append(Prompt(pid, messages=tuple(messages)))
            if tokenizer is not None:
                _check_tokenizes(prompts[-1], tokenizer, where)
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"{path} holds no prompts.")
    return prompts


def _check_tokenizes(prompt: Prompt, tokenizer, where: str) -> None:
    if prompt.messages is not None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f'{where}: "messages" need a chat template, and the tokenizer has none; give the prompt '
                         'as "prompt" text instead.')
    if not prompt.ids(tokenizer):
        raise ValueError(f"{where}: the prompt {prompt.id!r} becomes no tokens at all (is it only whitespace?); "
                         "remove it or write a prompt.")


def check_context(prompts: list[Prompt], tokenizer, max_new_tokens: int, context: int | None, path) -> None:
    """Refuse a prompt that, with ``max_new_tokens`` of answer, exceeds the models' ``context`` (checked before a
    run writes anything)."""
    for prompt in prompts if context else ():
        length = len(prompt.ids(tokenizer))
        if length + max_new_tokens > context:
            fix = f"lower max_new_tokens (--max-new-tokens) to {context - length} or less, or " if length < context \
                else ""
            raise ValueError(f"The prompt {prompt.id!r} of {path} has {length} tokens; with max_new_tokens="
                             f"{max_new_tokens} (--max-new-tokens) it exceeds the models' context of {context} tokens: "
                             f"{fix}shorten or remove that prompt.")
