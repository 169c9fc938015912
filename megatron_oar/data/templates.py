"""Prompt templates, selectable by name (``TEMPLATES``).

With a tokenizer that has a chat template the prompt is rendered by
``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``; otherwise
(no tokenizer, or none in it, like the tiny test tokenizer) by the template's plain-text form.

- ``answer_tag`` (default; the paper's format): reason, then the final answer alone inside
  ``<answer></answer>`` at the end. Pairs with ``rewards.format_style=answer_tag``.
- ``think_answer``: reasoning inside ``<think></think>``, then ``<answer></answer>``
  (``rewards.format_style=think_answer``).
- ``boxed``: Qwen2.5-Math's instruction, final answer in ``\\boxed{}``
  (``rewards.extractors`` with ``boxed``; ``rewards.format_style=boxed``).
- ``raw``: the prompt unchanged as the user message (for datasets such as DAPO-Math-17k whose
  prompts already carry their instruction).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptTemplate:
    """``system``: system message (None: none); ``user``: format string with ``{prompt}``;
    ``plain``: the text used without a chat template, format string with ``{system}``/``{prompt}``."""

    system: str | None
    user: str = "{prompt}"
    plain: str = "{system}\nUser: {prompt}\nAssistant:"


TEMPLATES: dict[str, PromptTemplate] = {
    "answer_tag": PromptTemplate(
        system=("You are a helpful assistant. Solve the problem by reasoning step by step. "
                "Then give the final answer, and only the final answer, inside <answer> </answer> "
                "tags at the very end of your response, for example: <answer>42</answer>.")),
    "think_answer": PromptTemplate(
        system=("You are a helpful assistant. First think about the problem step by step inside "
                "<think> </think> tags, then give only the final answer inside <answer> </answer> "
                "tags, for example: <think>reasoning here</think> <answer>42</answer>.")),
    "boxed": PromptTemplate(
        system="Please reason step by step, and put your final answer within \\boxed{}."),
    "raw": PromptTemplate(system=None, plain="{prompt}"),
}


def get_template(template: str | PromptTemplate) -> PromptTemplate:
    """The template called ``template`` (or ``template`` itself if it is a ``PromptTemplate``)."""
    if isinstance(template, PromptTemplate):
        return template
    try:
        return TEMPLATES[template]
    except KeyError:
        raise ValueError(f"unknown prompt template {template!r} (data.template); "
                         f"choose from {sorted(TEMPLATES)}") from None


def build_messages(prompt: str, template: str | PromptTemplate = "answer_tag") -> list[dict]:
    """The chat messages ``[{role, content}, ...]`` for ``prompt``."""
    t = get_template(template)
    messages = [{"role": "system", "content": t.system}] if t.system else []
    messages.append({"role": "user", "content": t.user.format(prompt=prompt)})
    return messages


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def render_prompt(prompt: str, template: str | PromptTemplate = "answer_tag", tokenizer=None) -> str:
    """The text the model sees: the tokenizer's chat template when it has one, else plain text."""
    t = get_template(template)
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(build_messages(prompt, t), add_generation_prompt=True,
                                             tokenize=False)
    user = t.user.format(prompt=prompt)
    return t.plain.format(system=t.system or "", prompt=user)
