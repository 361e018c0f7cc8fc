"""Chat prompts: the model's chat template (Jinja, from `tokenizer_config.json` or `chat_template.jinja`), or
the documented fallback.

Fallback (no template shipped): ChatML, the format of the Qwen family and of our
own trained tokenizer —

    <|im_start|>{role}\n{content}<|im_end|>\n   (per message)
    <|im_start|>assistant\n                      (generation prompt)

and `<|im_end|>` (when it is a token of the vocabulary) ends the assistant's turn.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class TemplateError(ValueError):
    """The template rejected the messages (its raise_exception, or a rendering error)."""


def _token_str(v) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def chatml(messages: list[dict], add_generation_prompt: bool = True) -> str:
    out = "".join(f"{IM_START}{m['role']}\n{m.get('content') or ''}{IM_END}\n" for m in messages)
    return out + (f"{IM_START}assistant\n" if add_generation_prompt else "")


class ChatTemplate:
    def __init__(self, model_dir: str | Path, tokenizer: Tokenizer):
        model_dir = Path(model_dir)
        cfg = {}
        path = model_dir / "tokenizer_config.json"
        if path.is_file():
            try:
                cfg = json.loads(path.read_text())
            except json.JSONDecodeError:
                cfg = {}
        source = cfg.get("chat_template")
        if isinstance(source, list):   # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        jinja_file = model_dir / "chat_template.jinja"
        if not isinstance(source, str) and jinja_file.is_file():
            source = jinja_file.read_text()
        self.bos_token = _token_str(cfg.get("bos_token")) or ""
        self.eos_token = _token_str(cfg.get("eos_token")) or ""
        self.source = source if isinstance(source, str) else None
        self._compiled = None
        self.kind = "fallback ChatML"
        if self.source is not None:
            self._compiled = self._compile(self.source)
            self.kind = "model chat template"
        self.eos_token_id = tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        # tokens that end an assistant turn
        stops = set()
        for s in (self.eos_token, IM_END if self._compiled is None or IM_END in (self.source or "") else None):
            if s:
                tid = tokenizer.token_to_id(s)
                if tid is not None:
                    stops.add(tid)
        self.stop_token_ids = frozenset(stops)

    @staticmethod
    def _compile(source: str):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(str(message))

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if self._compiled is None:
            return chatml(messages, add_generation_prompt)
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
        except TemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - jinja errors are the caller's messages' fault or the template's
            raise TemplateError(f"chat template failed: {e}") from None
