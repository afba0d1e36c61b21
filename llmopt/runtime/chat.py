"""`--chat`: render the model's own chat template (tokenizer_config.json or GGUF metadata).

Templates are Jinja2, rendered in a sandbox with the variables and helpers that HF templates use
(`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`).
"""

from __future__ import annotations

from datetime import date

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmopt.errors import OptionError
from llmopt.model.tokenizer import TokenizerInfo


def _raise(message: str) -> None:
    raise TemplateError(message)


def apply_chat_template(tok: TokenizerInfo, prompt: str, system: str | None = None) -> str:
    """The prompt text for one user turn (and an optional system turn), ready for the assistant."""
    if not tok.chat_template:
        raise OptionError("<chat>: this model has no chat template (none in tokenizer_config.json or GGUF metadata)")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: date.today().strftime(fmt)
    try:
        return env.from_string(tok.chat_template).render(
            messages=messages, add_generation_prompt=True, bos_token=tok.bos_token or "", eos_token=tok.eos_token or "")
    except TemplateError as e:
        raise OptionError(f"<chat>: the model's chat template failed: {e}") from None
