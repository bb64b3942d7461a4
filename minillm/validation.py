"""Checking arguments where they enter minillm, so bad input fails at the door and never inside a step.

A value that gets past the public API (``SamplingParams``, ``LLM.generate`` / ``chat`` / ``stream``,
``Engine.add_request``) and fails deep inside the engine would take every other request of its
batch with it, or worse, run as something it is not (``b"hi"`` as token ids 104, 105). So each
argument is checked here when it arrives: its type, its range, its length. The error names the
argument, the bad value and what would be valid.

Both errors are ``ValueError``\\ s, so one ``except ValueError`` catches every rejection; a value of
the wrong type is also a ``TypeError``. Each carries ``param``, the argument's name, which an HTTP
server puts into OpenAI's error envelope (``{"error": {"param": "temperature", ...}}``).
"""

from __future__ import annotations

import math
import numbers

CHAT_ROLES = ("system", "user", "assistant", "tool")


class InvalidArgument(ValueError):
    """A public argument with a bad value; ``param`` names the argument."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class InvalidArgumentType(InvalidArgument, TypeError):
    """A public argument of the wrong type: a ``TypeError``, and an ``InvalidArgument`` like the rest."""


def describe(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, then its type: enough to recognise a bad value
    without printing a million-element list into an error message."""
    return f"{short_repr(value, limit)} ({type(value).__name__})"


def short_repr(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_integer(value) -> bool:
    """Python and numpy integers; never ``bool`` (``True`` is an int to Python, not a count or a token)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(param: str, value, *, minimum: int | None = None, below: int | None = None,
              valid: str | None = None) -> int:
    """``value`` as a Python int in [minimum, below); ``valid`` says what would be valid, in words."""
    valid = valid or _int_range(minimum, below)
    if not is_integer(value):
        raise InvalidArgumentType(param, f"{param} must be {valid}, got {describe(value)}")
    if (minimum is not None and value < minimum) or (below is not None and value >= below):
        raise InvalidArgument(param, f"{param} must be {valid}, got {value!r}")
    return int(value)


def _int_range(minimum: int | None, below: int | None) -> str:
    if below is None:
        return "an integer" if minimum is None else f"an integer >= {minimum}"
    return f"an integer in [{minimum}, {below})"


def check_float(param: str, value, *, minimum: float | None = None, above: float | None = None,
                maximum: float | None = None, valid: str | None = None) -> float:
    """A finite real number (Python or numpy, never ``bool``) as a Python float, in its bounds."""
    valid = valid or "a finite number"
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise InvalidArgumentType(param, f"{param} must be {valid}, got {describe(value)}")
    number = float(value)
    if not math.isfinite(number) or (minimum is not None and number < minimum) \
            or (above is not None and number <= above) or (maximum is not None and number > maximum):
        raise InvalidArgument(param, f"{param} must be {valid}, got {value!r}")
    return number


def check_bool(param: str, value) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentType(param, f"{param} must be True or False, got {describe(value)}")
    return value


def check_text(param: str, value, what: str = "a string") -> str:
    """A ``str`` that UTF-8 can encode: a lone surrogate ("\\ud800") is no character, and the tokenizer
    would fail on it."""
    if not isinstance(value, str):
        raise InvalidArgumentType(param, f"{param} must be {what}, got {describe(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(param, f"{param} holds {value[e.start]!r} at position {e.start}, a lone surrogate "
                                     f"that is no Unicode character; give valid text") from None
    return value


def check_list(param: str, value, what: str) -> list:
    """A list or a tuple (ordered, finite) as a list: never a set (unordered), a string, bytes or a
    generator (which a second look would find empty)."""
    if not isinstance(value, (list, tuple)):
        raise InvalidArgumentType(param, f"{param} must be a list of {what}, got {describe(value)}")
    return list(value)


def check_token_ids(param: str, value, vocab_size: int | None = None, label: str | None = None) -> list[int]:
    """A list or tuple of token ids: integers in [0, vocab_size). ``label`` names them in the message."""
    label = label or param
    tokens = check_list(param, value, "token ids (integers)")
    valid = "integers >= 0" if vocab_size is None else f"integers in [0, {vocab_size})"
    for index, token in enumerate(tokens):
        if not is_integer(token):
            raise InvalidArgumentType(param, f"{label} must be {valid}; position {index} holds {describe(token)}, "
                                             f"in {short_repr(value)}")
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise InvalidArgument(param, f"{label} must be {valid}; position {index} holds {token!r}, "
                                         f"in {short_repr(value)}")
    return [int(t) for t in tokens]


def check_strings(param: str, value) -> tuple[str, ...]:
    """None, one string, or a list / tuple of non-empty strings (stop strings) as a tuple."""
    if value is None:
        return ()
    valid = "None, a non-empty string or a list of them"
    if not isinstance(value, (str, list, tuple)):
        raise InvalidArgumentType(param, f"{param} must be {valid}, got {describe(value)}")
    items = [value] if isinstance(value, str) else list(value)
    for item in items:
        check_text(param, item, valid)
        if not item:
            raise InvalidArgument(param, f"{param} must hold non-empty strings, got {value!r}")
    return tuple(items)


# -- prompts ---------------------------------------------------------------------------------------------


def is_single_prompt(value) -> bool:
    """A string, a dict, or a list / tuple that is one prompt's token ids rather than a list of prompts
    (anything in it that is not itself a prompt makes it token ids, which then say what is wrong)."""
    if isinstance(value, (str, dict)):
        return True
    return isinstance(value, (list, tuple)) and any(not isinstance(v, (str, dict, list, tuple)) for v in value)


def as_prompt_list(prompts) -> list:
    """``generate``'s first argument as a list of prompts (a single prompt becomes a list of one)."""
    if is_single_prompt(prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidArgumentType("prompts", f"prompts must be a prompt (a string, a list of token ids, a dict) or a "
                                             f"list of prompts, got {describe(prompts)}")
    prompts = list(prompts)
    if not prompts:
        raise InvalidArgument("prompts", "no prompts given; pass a string, a list of token ids, a dict, "
                                         "or a non-empty list of them")
    return prompts


def prompt_value(prompt) -> str | list[int]:
    """One prompt as the engine takes it: a string or token ids. Dicts take vLLM's two forms,
    ``{"prompt": str}`` and ``{"prompt_token_ids": [...]}``."""
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"}:
            return check_text("prompt", prompt["prompt"])
        if keys == {"prompt_token_ids"}:
            return check_list("prompt", prompt["prompt_token_ids"], "token ids (integers)")
        raise InvalidArgument("prompt", f"a dict prompt has exactly one key, 'prompt' (text) or 'prompt_token_ids' "
                                        f"(a list of ints), got keys {sorted(map(str, keys))}")
    if isinstance(prompt, str):
        return check_text("prompt", prompt)
    if isinstance(prompt, (list, tuple)):
        return list(prompt)  # the engine checks the ids against its vocabulary
    raise InvalidArgumentType("prompt", f"a prompt must be a string, a list or tuple of token ids (ints), or a dict "
                                        f"with 'prompt' or 'prompt_token_ids', got {describe(prompt)}")


def per_prompt(param: str, value, n: int, entry_is_list: bool = False) -> list:
    """One value per prompt: a list / tuple of exactly ``n``, or one value for all (not when the
    value itself is a list, as ``priority``'s is)."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InvalidArgument(param, f"{param} has {len(value)} entries for {n} prompts; give one per prompt")
        return list(value)
    if entry_is_list:
        raise InvalidArgumentType(param, f"{param} must be a list with one entry per prompt, got {describe(value)}")
    return [value] * n


# -- chat messages -------------------------------------------------------------------------------------


def check_conversations(messages) -> list[list[dict]]:
    """``chat``'s first argument, one conversation (a list of messages) or a list of them, as a list of
    conversations whose messages are ``{"role": str, "content": str}``. Content may be a string or
    OpenAI-style text parts, ``[{"type": "text", "text": "..."}]``, joined with newlines as vLLM does.
    Errors point at the message: ``messages[2]['content']`` (``messages[1][0]...`` in a list of them)."""
    items = check_list("messages", messages, "messages (dicts), or a list of such lists")
    if not items:
        raise InvalidArgument("messages", "messages is empty; chat() needs at least one message")
    if isinstance(items[0], dict):
        return [_check_conversation(items, "messages")]
    return [_check_conversation(c, f"messages[{i}]") for i, c in enumerate(items)]


def _check_conversation(conversation, where: str) -> list[dict]:
    messages = check_list("messages", conversation, "messages (dicts with 'role' and 'content')")
    if not messages:
        raise InvalidArgument("messages", f"{where} is an empty conversation; give at least one message")
    return [_check_message(m, f"{where}[{i}]") for i, m in enumerate(messages)]


def _check_message(message, where: str) -> dict:
    if not isinstance(message, dict):
        raise InvalidArgumentType("messages", f"{where} must be a dict with 'role' and 'content', "
                                              f"got {describe(message)}")
    if set(message) != {"role", "content"}:
        raise InvalidArgument("messages", f"{where} must have exactly the keys 'role' and 'content', "
                                          f"got {describe(message)}")
    role = message["role"]
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise InvalidArgument("messages", f"{where}['role'] must be one of {CHAT_ROLES}, got {describe(role)}")
    return {"role": role, "content": _message_text(message["content"], f"{where}['content']")}


def _message_text(content, where: str) -> str:
    valid = "a string or a list of text parts [{'type': 'text', 'text': '...'}]"
    if not isinstance(content, (str, list, tuple)):
        raise InvalidArgumentType("messages", f"{where} must be {valid}, got {describe(content)}")
    if isinstance(content, str):
        return _check_message_text(content, where)
    for index, part in enumerate(content):
        if not isinstance(part, dict) or set(part) != {"type", "text"} or part["type"] != "text":
            raise InvalidArgument("messages", f"{where} must be {valid}; part {index} is {describe(part)}")
        _check_message_text(part["text"], f"{where}[{index}]['text']")
    return "\n".join(part["text"] for part in content)


def _check_message_text(text, where: str) -> str:
    if not isinstance(text, str):
        raise InvalidArgumentType("messages", f"{where} must be a string, got {describe(text)}")
    try:
        return check_text("messages", text)
    except InvalidArgument as e:
        raise InvalidArgument("messages", f"{where}: {e}") from None
