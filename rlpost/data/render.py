"""Prompts as the model will see them: chat template, system prompt, context budget.

With ``chat_template="auto"`` a tokenizer that ships a chat template gets each
prompt as a user message (after an optional system message), rendered with the
generation prompt appended, as TRL and verl do for chat models; ``"none"`` (or a
tokenizer without a template) keeps the plain text, with the system prompt, if
any, as a first paragraph. A prompt whose tokens leave less than
``rollout.max_tokens`` of the model's positions is a bad row (``prompt_too_long``,
verl's overlong-prompt filter): refused or skipped and counted, never truncated.
"""

from __future__ import annotations

from rlpost.data.files import DataError, LoadReport, refuse_or_skip
from rlpost.types import Prompt


def render_prompt(
    text: str, tokenizer, *, chat_template: str = "auto", system_prompt: str | None = None
) -> str:
    """``text`` with the chat template and system prompt applied as configured."""
    if chat_template == "auto" and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": text})
        try:
            return tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # jinja raises its own types from inside the template
            raise DataError(
                f"the tokenizer's chat template cannot render a prompt ({exc}); "
                "set data.chat_template=none or drop data.system_prompt"
            ) from None
    return f"{system_prompt}\n\n{text}" if system_prompt else text


def prepare_prompts(
    prompts: list[Prompt],
    tokenizer,
    *,
    max_prompt_tokens: int,
    budget_note: str,
    on_bad_row: str,
    report: LoadReport,
    chat_template: str = "auto",
    system_prompt: str | None = None,
) -> list[Prompt]:
    """Render every prompt and keep those of at most ``max_prompt_tokens`` tokens.

    A longer one is refused (``on_bad_row="error"``) or skipped and counted in
    ``report`` as ``prompt_too_long``; ``budget_note`` says where the limit comes from.
    """
    for p in prompts:
        p.text = render_prompt(
            p.text, tokenizer, chat_template=chat_template, system_prompt=system_prompt
        )
    if not prompts:
        return prompts
    ids = tokenizer([p.text for p in prompts], add_special_tokens=False)["input_ids"]
    kept = []
    for p, tokens in zip(prompts, ids, strict=True):
        if len(tokens) <= max_prompt_tokens:
            kept.append(p)
            continue
        problem = ("prompt_too_long", f"prompt is {len(tokens)} tokens; {budget_note}")
        refuse_or_skip(p.uid or "prompt", problem, on_bad_row, report)
        report.rows -= 1
    return kept
