"""Text in and out: prompt encoding, chat templates, and incremental detokenization for streaming.

Decoding a token on its own is wrong for byte-level BPE (a character can span tokens, and leading
spaces depend on the previous token), so each step decodes the whole output and emits what is new,
holding back a trailing U+FFFD until the rest of its bytes arrive.
"""

from __future__ import annotations

from minillm.request import Request
from minillm.validation import InvalidArgument, check_conversations


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    if tokenizer is None:
        raise InvalidArgument("prompt", "this model has no tokenizer (dummy weights): pass prompts as lists of "
                                        "token ids")
    return tokenizer.encode(prompt, add_special_tokens=True)


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Apply the model's chat template to one conversation (checked by ``validation.check_conversations``:
    roles, and content as a string or text parts) and return token ids ready for generation."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("messages", "this model has no chat template; use generate() with a plain prompt")
    from jinja2 import TemplateError  # transformers renders chat templates with jinja2

    [messages] = check_conversations([messages])
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as e:  # the template's own rules, e.g. roles that must alternate
        raise InvalidArgument("messages", f"the model's chat template refused these messages: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def detokenize_step(tokenizer, request: Request, final: bool = False) -> str:
    """Update ``request.text`` with the newest token and return the new characters. ``final``
    keeps a trailing incomplete character (the request ends there, nothing will complete it)."""
    if tokenizer is None:
        return ""
    text = tokenizer.decode(request.output_token_ids, skip_special_tokens=request.params.skip_special_tokens)
    if text.endswith("\ufffd") and not final:
        return ""  # an incomplete UTF-8 sequence: wait for the next token
    delta = text[len(request.text):]
    request.text = text
    return delta
