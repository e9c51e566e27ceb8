"""gpushare-client: the Python SDK of the gpushare GPU platform (docs/sdk.md).

    from gpushare_client import Client
    client = Client()                       # GPUSHARE_URL / GPUSHARE_TOKEN or the config file
    job = client.submit(["python", "train.py"], gpus=1).job
    print(client.wait(job.id).state)

It needs only urllib3, click and PyYAML: it never imports the platform's Django code.
"""

__version__ = "0.2.0"

from .client import Client, JobWatch, array_body
from .config import Config, config_load
from .errors import (
    ApiError,
    BadRequest,
    BudgetExceeded,
    BudgetExhausted,
    ConfigError,
    Conflict,
    Forbidden,
    GpushareError,
    MethodNotAllowed,
    NotFound,
    QuotaExceeded,
    RateLimited,
    ServerError,
    TooLarge,
    Unauthenticated,
    Unreachable,
    WaitTimeout,
)
from .models import (
    Endpoint,
    Finished,
    Job,
    JobArray,
    JobUsage,
    LogPage,
    LogText,
    Outage,
    Recovered,
    Replica,
    StateChanged,
    Submission,
    Usage,
    UsageRow,
    WatchEvent,
)

__all__ = [
    "ApiError",
    "BadRequest",
    "BudgetExceeded",
    "BudgetExhausted",
    "Client",
    "Config",
    "ConfigError",
    "Conflict",
    "Endpoint",
    "Finished",
    "Forbidden",
    "GpushareError",
    "Job",
    "JobArray",
    "JobUsage",
    "JobWatch",
    "LogPage",
    "LogText",
    "MethodNotAllowed",
    "NotFound",
    "Outage",
    "QuotaExceeded",
    "RateLimited",
    "Recovered",
    "Replica",
    "ServerError",
    "StateChanged",
    "Submission",
    "TooLarge",
    "Unauthenticated",
    "Unreachable",
    "Usage",
    "UsageRow",
    "WaitTimeout",
    "WatchEvent",
    "__version__",
    "array_body",
    "config_load",
]
