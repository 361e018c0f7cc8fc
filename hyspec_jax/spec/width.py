"""Moved to `hyspec_jax.runtime.width` (the width choice is host-side: `runtime/` holds it). This name stays only
for `spec/engine.py`'s import until that file moves out of `spec/`; nothing else imports it (tests/test_imports.py)."""

from hyspec_jax.runtime.width import *  # noqa: F401,F403
from hyspec_jax.runtime.width import __all__  # noqa: F401
