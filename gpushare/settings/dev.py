"""Development and demo settings (`make run`): debug on, embedded defaults."""

from .base import *  # noqa: F403
from .base import env_bool

DEBUG = env_bool("DEBUG", True)
