"""Prompts as the model will see them: chat template, system prompt, context budget.

``chat_template="auto"``: a user message with the generation prompt, where the tokenizer has a
template; else plain text. A prompt leaving under ``rollout.max_tokens`` positions is a bad
row (``prompt_too_long``), never truncated.
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
    """Render every prompt and keep those of at most ``max_prompt_tokens`` tokens
    (``budget_note``: where the limit comes from)."""
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
