"""GPU futures and their hub (the code lives in ``aiogpu._core``): re-exported here, where the
names have always been importable from."""
from ._core.futures import (DONE, FAILED, PENDING, GPUFuture, _CallbackAwaiter, cause_chain,  # noqa: F401
                            add_preds, completed_future, log, mark_retrieved, submission_scope, was_retrieved)
from ._core.hub import FutureHub  # noqa: F401
