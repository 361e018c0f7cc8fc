"""OpenAI request bodies as pydantic v2 models, and the error bodies vLLM sends.

Models are strict (a string is not a number, a float not an integer, as the OpenAI API) and keep fields they do
not know (`extra="allow"`): the handler logs them as ignored rather than dropping them silently. Range checks
that need the served model (vocabulary, context length, `logprobs` limit) are the handler's.

Errors are `{"error": {"message", "type", "param", "code"}}` as vLLM sends them: `code` is the HTTP status and
`type` its error name (`BadRequestError`, `NotFoundError`, ...). 400 for malformed or invalid requests (bad JSON,
wrong types, out-of-range values, prompts or max_tokens over the context, unsupported options), 401 without the
API key, 404 for an unknown model or path, 405 for a wrong method, 413 for a body over the limit, 429 for a full
queue, 503 while draining or over the connection limit.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP_STRINGS = 16
MAX_N = 16                 # choices per prompt

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
               413: "PayloadTooLargeError", 422: "UnprocessableEntityError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def unsupported(name: str, why: str = "") -> APIError:
    return APIError(400, f"'{name}' is not supported{why}", param=name)


# --- validation errors -> one OpenAI error ------------------------------------------------------------
_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def param_of(loc: tuple) -> str | None:
    """The request field a pydantic error location names, as `messages[0].role`: the body prefix, union member
    tags (`str`, `list[int]`, `function-after[...]`, model names) dropped."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            if out:
                out += f"[{part}]"
        elif isinstance(part, str) and _FIELD.match(part) and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out or None


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic error as a 400 with its field as `param` (JSON that does not parse: param None)."""
    if not errors:
        return APIError(400, "invalid request")
    e = errors[0]
    loc = tuple(e.get("loc", ()))
    if e.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {e.get('msg', '')}")
    param = param_of(loc)
    if param is None:
        if e.get("type") == "missing":
            return APIError(400, "request body is empty; expected a JSON object")
        return APIError(400, f"request body must be a JSON object: {e.get('msg', '')}")
    got = e.get("input")
    shown = "" if got is None or e.get("type") == "missing" else f", got {str(got)[:80]!r}"
    return APIError(400, f"'{param}': {e.get('msg', 'invalid value')}{shown}", param=param)


# --- request models ---------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


PositiveInt = Annotated[int, Field(ge=1)]
TokenIds = list[Annotated[int, Field(ge=0)]]


class _Sampling(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool | None = False
    min_tokens: Annotated[int, Field(ge=0)] | None = 0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool | None = False
    user: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0)] | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool | None = False
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds


def unknown_fields(req: BaseModel) -> list[str]:
    """Top-level fields of a request that no model field takes (logged by the handler as ignored)."""
    return sorted(req.model_extra or {})
