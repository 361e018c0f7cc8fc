"""The speculative engine: propose, select (budget), verify, accept, commit (docs/design.md §2), and its memory model.

Submodules are imported explicitly (`from hyspec_jax.spec import memory`); nothing heavy is imported here.
"""
