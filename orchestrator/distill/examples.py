"""Training prompts for `specmesh distill`: where they come from and how they are split.

Four file forms are accepted, told apart by their first non-empty line:

- plain text: every non-empty line is one raw completion prompt;
- JSONL prompts: `{"prompt": ...}` or `{"messages": [...]}` per line, the format
  `specmesh bench --prompt-file` reads (messages go through the chat template);
- JSONL token ids: `{"prompt_token_ids": [...]}` per line, prompts already tokenized by the
  target's tokenizer (what `specmesh serve --online-distill` keeps of served requests);
- the target's disagreement log (`--disagreement-log`): records with `context_token_ids`
  (written when the target runs with `--disagreement-log-context`) become prompts that end
  exactly where the draft was rejected; records without them carry only a hash of the
  context, from which nothing can be trained, so such a log is refused with that reason.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.prompts.sets import PromptFileError, json_object, load_jsonl
from orchestrator.distill.defaults import HELD_OUT_MAX, VALIDATION_FRACTION, VALIDATION_MAX
from specmesh.loading.models import chat_token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class DistillInputError(ValueError):
    """A bad prompts file or model pairing; the message names the problem."""


@dataclass(frozen=True)
class Example:
    source: str  # "file:line", for messages that name a prompt
    prompt_token_ids: tuple[int, ...]


def load_examples(path: str | Path, tokenizer: PreTrainedTokenizerBase,
                  max_prompt_tokens: int) -> list[Example]:
    """Every prompt of `path` as token ids (the prompt's last `max_prompt_tokens` ids)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DistillInputError(f"cannot read prompts file {path}: {error}") from None
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise DistillInputError(f"prompts file {path} has no prompts (it is empty)")
    first = numbered[0][1].lstrip()
    if not first.startswith("{"):
        examples = [Example(f"{path}:{n}", tuple(tokenizer.encode(line))) for n, line in numbered]
    elif "context_hash" in (record := _json_object(first, f"{path}:{numbered[0][0]}")):
        examples = _from_disagreements(path, numbered)
    elif "prompt_token_ids" in record:
        examples = _from_token_ids(path, numbered)
    else:
        examples = _from_jsonl(path, tokenizer)
    examples = [Example(e.source, e.prompt_token_ids[-max_prompt_tokens:]) for e in examples]
    empty = [e.source for e in examples if not e.prompt_token_ids]
    if empty:
        raise DistillInputError(f"{empty[0]}: the prompt encodes to no tokens")
    return examples


def _json_object(line: str, where: str) -> dict:
    try:
        return json_object(line, where)
    except PromptFileError as error:
        raise DistillInputError(str(error)) from None


def _from_jsonl(path: Path, tokenizer: PreTrainedTokenizerBase) -> list[Example]:
    try:
        prompts = load_jsonl(path)
    except PromptFileError as error:
        raise DistillInputError(str(error)) from None
    examples = []
    for index, item in enumerate(prompts, 1):
        if item.messages is not None:
            try:
                ids = chat_token_ids(tokenizer, list(item.messages))
            except ValueError as error:
                raise DistillInputError(f"{path}: prompt {index} has messages but {error}") from None
        else:
            ids = tokenizer.encode(item.prompt)
        examples.append(Example(f"{path}: prompt {index}", tuple(ids)))
    return examples


def _token_ids(value, where: str, field_name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise DistillInputError(f"{where}: field {field_name!r}: must be a non-empty list of token ids")
    return tuple(value)


def _from_token_ids(path: Path, numbered: list[tuple[int, str]]) -> list[Example]:
    """One prompt per distinct `prompt_token_ids` list."""
    examples, seen = [], set()
    for number, line in numbered:
        where = f"{path}:{number}"
        ids = _token_ids(_json_object(line, where).get("prompt_token_ids"), where, "prompt_token_ids")
        if ids not in seen:
            seen.add(ids)
            examples.append(Example(where, ids))
    return examples


def _from_disagreements(path: Path, numbered: list[tuple[int, str]]) -> list[Example]:
    """One prompt per distinct rejected context: the ids before the rejected position."""
    examples, seen = [], set()
    for number, line in numbered:
        where = f"{path}:{number}"
        record = _json_object(line, where)
        context = record.get("context_token_ids")
        if context is None:
            raise DistillInputError(
                f"{where}: disagreement record has no 'context_token_ids' (only a hash of the context); "
                "run the target with --disagreement-log-context so the log can be distilled from")
        context = _token_ids(context, where, "context_token_ids")
        if record.get("context_hash") not in seen:
            seen.add(record.get("context_hash"))
            examples.append(Example(where, context))
    return examples


def check_token_ids(examples: list[Example], vocab_size: int) -> None:
    """Logged contexts come from another process: every id must exist in this vocabulary."""
    for example in examples:
        if max(example.prompt_token_ids) >= vocab_size:
            raise DistillInputError(f"{example.source}: token id {max(example.prompt_token_ids)} "
                                    f"is outside the vocabulary (size {vocab_size})")


def split_examples(examples: list[Example], held_out_fraction: float,
                   seed: int) -> tuple[list[Example], list[Example], list[Example]]:
    """(train, validation, held out), shuffled with `seed`; all three non-empty. The held-out prompts
    are only ever reported on; early stopping and the choice of k look at the validation prompts."""
    if len(examples) < 3:
        raise DistillInputError(f"need at least 3 prompts to split train/validation/held-out, got {len(examples)}")
    order = list(examples)
    random.Random(seed).shuffle(order)
    held = _share(len(order), held_out_fraction, HELD_OUT_MAX)
    validation = _share(len(order), VALIDATION_FRACTION, VALIDATION_MAX)
    held = min(held, len(order) - 2)
    validation = min(validation, len(order) - held - 1)
    return order[held + validation:], order[held:held + validation], order[:held]


def _share(total: int, fraction: float, most: int) -> int:
    return min(most, max(1, round(total * fraction)))
