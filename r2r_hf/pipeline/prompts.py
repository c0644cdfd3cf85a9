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


def read_prompts(path: str | os.PathLike, limit: int | None = None) -> list[Prompt]:
    """Parse a prompts file; any malformed line is an error naming the file and line.

    Args:
        path: a JSON-lines file.
        limit: keep only the first ``limit`` prompts.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Prompts file {path} does not exist.")
    prompts: list[Prompt] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
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
                if not isinstance(row["prompt"], str) or not row["prompt"]:
                    raise ValueError(f'{where}: "prompt" must be a non-empty string.')
                prompts.append(Prompt(pid, prompt=row["prompt"]))
            else:
                messages = row["messages"]
                if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages
                ):
                    raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} strings.')
                prompts.append(Prompt(pid, messages=tuple(messages)))
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"{path} holds no prompts.")
    return prompts
