"""Evaluation tests share the runtime tests' single-thread fixture."""

from tests.runtime.conftest import one_thread  # noqa: F401
