"""What the engine, the runner and the layers exchange: below all three, importing none.

``Request`` (a request's tokens and progress), the step hand-off (``SchedulerOutput`` down to
the runner, ``RunnerOutput`` back) and the per-step ``ForwardContext`` the layers read.
"""

from attnserve.core.forward_context import ForwardContext, forward_context, get_forward_context
from attnserve.core.request import Request, RequestStatus
from attnserve.core.step import (
    GrammarBitmask,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)

__all__ = [
    "ForwardContext",
    "GrammarBitmask",
    "Request",
    "RequestStatus",
    "RunnerOutput",
    "ScheduledRequest",
    "SchedulerOutput",
    "TokenLogprobs",
    "forward_context",
    "get_forward_context",
]
