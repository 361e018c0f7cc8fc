"""Controls and studies run against the library, never imported by it (`hyspec_jax`, `serve/`, `train/` and
`bench/` do not import this package). Run from the repository root: `python -m experiments.<module> ...`."""
