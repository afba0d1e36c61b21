"""Errors the CLI turns into one-line messages and exit codes (2 = bad input, 1 = a failed check)."""


class LlmoptError(Exception):
    """Base class: a problem we can explain to the user in one line."""

    exit_code = 2


class InputError(LlmoptError):
    """The user gave us something we cannot read or do not support."""

    exit_code = 2


class CheckFailed(LlmoptError):
    """A quality gate or verification failed (the input was fine; the result was not)."""

    exit_code = 1
