"""`compilation.tune_cpu_codegen`: the CPU's LLVM optimisation level is set before JAX starts, only where JAX will run
on the CPU, and never over a level the user chose."""

from __future__ import annotations

import os

import pytest

from hyspec_jax import compilation


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    return monkeypatch


def test_cpu_host_gets_the_level_after_the_users_flags(env):
    env.setattr(compilation, "_gpu_plugin_installed", lambda: False)
    env.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    assert compilation.tune_cpu_codegen()
    assert os.environ["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=2 "
                                       f"--xla_backend_optimization_level={compilation.CPU_BACKEND_OPT_LEVEL}")
    assert not compilation.tune_cpu_codegen()          # once only
    assert os.environ["XLA_FLAGS"].count("xla_backend_optimization_level") == 1


@pytest.mark.parametrize("platforms,plugin,expect", [("cpu", True, True), ("cuda", False, False), ("", True, False),
                                                     ("", False, True)])
def test_only_where_jax_runs_on_the_cpu(env, platforms, plugin, expect):
    env.setattr(compilation, "_gpu_plugin_installed", lambda: plugin)
    if platforms:
        env.setenv("JAX_PLATFORMS", platforms)
    assert compilation.tune_cpu_codegen() is expect
    assert ("xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "")) is expect


def test_a_level_the_user_set_stays(env):
    env.setattr(compilation, "_gpu_plugin_installed", lambda: False)
    env.setenv("XLA_FLAGS", "--xla_backend_optimization_level=3")
    assert not compilation.tune_cpu_codegen()
    assert os.environ["XLA_FLAGS"] == "--xla_backend_optimization_level=3"
