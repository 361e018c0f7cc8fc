"""OpenAI request validation, error bodies, and the text side of a choice (detokenisation, stop strings).

Errors are `APIError`s rendered as {"error": {"message", "type", "param", "code"}} with the status OpenAI and
vLLM use: 400 for malformed / invalid requests (bad JSON, wrong types, out-of-range values, prompts or
max_tokens over the context, unsupported options), 404 for an unknown model or path, 405 for a wrong method,
429 for a full queue, 503 while draining.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from typing import Any

from tokenizers import Tokenizer

MAX_STOP_STRINGS = 16


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_json_body(raw: bytes) -> dict:
    if not raw:
        raise APIError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


# --- typed getters --------------------------------------------------------------------------------
def _type_error(name: str, want: str, got: Any) -> APIError:
    return APIError(400, f"'{name}' must be {want}, got {json.dumps(got)[:80]}", param=name, code="invalid_type")


def get_int(body: dict, name: str, default=None, *, nullable: bool = True):
    v = body.get(name, default)
    if v is None and nullable:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise _type_error(name, "an integer", v)
    return int(v)


def get_number(body: dict, name: str, default=None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _type_error(name, "a number", v)
    return float(v)


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def get_str(body: dict, name: str, default=None):
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, str):
        raise _type_error(name, "a string", v)
    return v


@dataclasses.dataclass
class GenParams:
    max_tokens: int | None          # None: the endpoint's default
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool


def parse_common(body: dict, vocab_size: int, *, max_tokens_names: tuple[str, ...]) -> GenParams:
    """Fields shared by /v1/completions and /v1/chat/completions."""
    max_tokens = None
    for name in max_tokens_names:
        v = get_int(body, name)
        if v is not None:
            if v <= 0:
                raise APIError(400, f"'{name}' must be at least 1, got {v}", param=name, code="invalid_value")
            max_tokens = v
            break
    temperature = get_number(body, "temperature", 1.0)
    if temperature < 0:
        raise APIError(400, f"'temperature' must be >= 0, got {temperature}", param="temperature",
                       code="invalid_value")
    top_p = get_number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise APIError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p", code="invalid_value")
    top_k = get_int(body, "top_k", 0)
    if top_k == -1:      # vLLM's "disabled"
        top_k = 0
    if top_k < 0:
        raise APIError(400, f"'top_k' must be -1, 0 (disabled) or positive, got {top_k}", param="top_k",
                       code="invalid_value")
    n = get_int(body, "n", 1)
    if n != 1:
        raise APIError(400, f"'n' = {n} is not supported: this server returns one choice per prompt (n = 1)",
                       param="n", code="unsupported_value")
    best_of = get_int(body, "best_of", 1)
    if best_of != 1:
        raise APIError(400, "'best_of' other than 1 is not supported", param="best_of", code="unsupported_value")
    seed = get_int(body, "seed")
    if seed is None:
        seed = random.getrandbits(32)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise _type_error("stop", "a string or a list of strings", stop)
    if any(s == "" for s in stops):
        raise APIError(400, "'stop' strings must not be empty", param="stop", code="invalid_value")
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings", param="stop", code="invalid_value")
    sti = body.get("stop_token_ids")
    if sti is None:
        sti = []
    if not isinstance(sti, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in sti):
        raise _type_error("stop_token_ids", "a list of integers", sti)
    bad = [t for t in sti if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"'stop_token_ids' outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                       param="stop_token_ids", code="invalid_value")
    stream = get_bool(body, "stream", False)
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise _type_error("stream_options", "an object", so)
        if not stream:
            raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options",
                           code="invalid_value")
        include_usage = get_bool(so, "include_usage", False)
    for name in ("presence_penalty", "frequency_penalty"):
        v = get_number(body, name, 0.0)
        if v != 0.0:
            raise APIError(400, f"'{name}' is not supported (only 0)", param=name, code="unsupported_value")
    rp = get_number(body, "repetition_penalty", 1.0)
    if rp != 1.0:
        raise APIError(400, "'repetition_penalty' is not supported (only 1)", param="repetition_penalty",
                       code="unsupported_value")
    lb = body.get("logit_bias")
    if lb not in (None, {}):
        if not isinstance(lb, dict):
            raise _type_error("logit_bias", "an object", lb)
        raise APIError(400, "'logit_bias' is not supported", param="logit_bias", code="unsupported_value")
    return GenParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                     stop=stops, stop_token_ids=tuple(sti), ignore_eos=get_bool(body, "ignore_eos", False),
                     stream=stream, include_usage=include_usage,
                     return_token_ids=get_bool(body, "return_token_ids", False))


def check_model(body: dict, served: str) -> str:
    model = get_str(body, "model")
    if model is None:
        return served      # like vLLM: the one served model
    if model != served:
        raise APIError(404, f"The model '{model}' does not exist. This server serves '{served}'.", param="model",
                       code="model_not_found")
    return model


def parse_prompts(body: dict, tokenizer: Tokenizer, vocab_size: int) -> list[tuple[list[int], str | None]]:
    """/v1/completions `prompt`: a string, a list of strings, a list of token ids, or a list of such lists.
    Returns [(ids, text or None)]."""
    if "prompt" not in body or body["prompt"] is None:
        raise APIError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    p = body["prompt"]
    items: list = []
    if isinstance(p, str):
        items = [p]
    elif isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            items = list(p)
        elif all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            items = [p]
        elif all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x) for x in p):
            items = list(p)
        else:
            raise _type_error("prompt", "a string, a list of strings, a list of token ids or a list of such lists", p)
    elif isinstance(p, list):
        raise APIError(400, "'prompt' must not be an empty list", param="prompt", code="invalid_value")
    else:
        raise _type_error("prompt", "a string, a list of strings, a list of token ids or a list of such lists", p)
    out = []
    for item in items:
        if isinstance(item, str):
            ids = tokenizer.encode(item).ids
            text = item
        else:
            bad = [t for t in item if not 0 <= t < vocab_size]
            if bad:
                raise APIError(400, f"prompt token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                               param="prompt", code="invalid_value")
            ids, text = list(item), None
        if not ids:
            raise APIError(400, "the prompt is empty (0 tokens)", param="prompt", code="invalid_value")
        out.append((ids, text))
    return out


ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise APIError(400, "'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(msgs, list):
        raise _type_error("messages", "a list of message objects", msgs)
    if not msgs:
        raise APIError(400, "'messages' must contain at least one message", param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(where, "an object", m)
        role = m.get("role")
        if not isinstance(role, str):
            raise _type_error(f"{where}.role", "a string", role)
        if role not in ROLES:
            raise APIError(400, f"{where}.role must be one of {list(ROLES)}, got {role!r}", param=f"{where}.role",
                           code="invalid_value")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"{where}.content[{j}]: only text parts are supported",
                                   param=f"{where}.content", code="unsupported_value")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None:
            if role != "assistant":
                raise APIError(400, f"{where}.content is required for role {role!r}", param=f"{where}.content",
                               code="missing_required_parameter")
            content = ""
        elif not isinstance(content, str):
            raise _type_error(f"{where}.content", "a string or a list of text parts", content)
        msg = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


# --- the text of one choice -----------------------------------------------------------------------
class IncrementalDetokenizer:
    """Token ids -> text deltas whose concatenation equals decoding all ids at once: decodes a short window
    (prefix/read offsets, as text-generation-inference does) and holds back incomplete UTF-8."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, tid: int) -> str:
        self.ids.append(tid)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        new_text = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self.prefix, self.read = self.read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        new_text = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        self.prefix = self.read = len(self.ids)
        return new_text[len(prefix_text):]


class ChoiceText:
    """Text of one choice: detokenises, applies stop strings, and holds back what could still become one."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], skip_ids: frozenset[int]):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.skip_ids = skip_ids
        self.text = ""
        self.sent = 0
        self.token_ids: list[int] = []
        self.sent_ids = 0
        self.finish: str | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def _check_stop(self, new_len: int) -> bool:
        start = max(0, len(self.text) - new_len - self.hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.finish = "stop"
            return True
        return False

    def feed(self, ids: list[int], finish: str | None) -> bool:
        """Add engine tokens; True when this choice has just ended because of a stop string."""
        if self.finish is not None:
            return False
        for t in ids:
            self.token_ids.append(t)
            if t in self.skip_ids:
                continue
            delta = self.detok.push(t)
            if delta:
                self.text += delta
                if self.stop and self._check_stop(len(delta)):
                    return True
        if finish is not None:
            tail = self.detok.flush()
            if tail:
                self.text += tail
                if self.stop and self._check_stop(len(tail)):
                    return True
            self.finish = finish
        return False

    def take(self) -> tuple[str, list[int]]:
        """The text (and token ids) not sent yet that can be sent now."""
        limit = len(self.text) if self.finish is not None else max(self.sent, len(self.text) - self.hold)
        delta = self.text[self.sent:limit]
        self.sent = limit
        ids = self.token_ids[self.sent_ids:]
        self.sent_ids = len(self.token_ids)
        return delta, ids
