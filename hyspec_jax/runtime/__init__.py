"""The request loop: one host loop (`scheduler.Scheduler`) over a backend of batch slots (`backend`), whose device
programs are the prefill and plain decoding step (`programs`) and the speculative round (`hyspec_jax.spec.round`).
The server runs it on a thread; `hyspec generate` and `engine.Engine.generate` drive it to completion
(`scheduler.run_batch`). `engine` holds the host side of every mode: the options (`engine.SpecConfig`), the backend
built from them, the synchronous driver."""
