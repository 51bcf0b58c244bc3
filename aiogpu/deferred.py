"""Deferred operations (their code lives in ``aiogpu._core.deferred``): re-exported here."""
from ._core.deferred import Deferred, abandon, adopt, defer, finish_compile, new_compile, resolve  # noqa: F401
