"""Errors the engine raises about a request's parameters."""

from __future__ import annotations


class ParameterError(ValueError):
    """A ValueError about one request parameter, named by `param` (a SamplingParams field, or `priority`), so
    that a server can tell its client which field was wrong."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
