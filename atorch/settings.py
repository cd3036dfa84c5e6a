"""atorch's environment variables (``ATORCH_*``), read in one place with pydantic-settings.

``settings()`` reads the environment at each call: a test or a launcher that sets a variable after
``import atorch`` is heard. An empty variable counts as unset.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Every ``ATORCH_*`` variable that atorch reads (the field name in upper case, after ``ATORCH_``)."""

    model_config = SettingsConfigDict(env_prefix="ATORCH_", env_ignore_empty=True, extra="ignore")

    cache_dir: Path = Field(default_factory=lambda: Path.home() / ".cache" / "atorch", description=(
        "where searches (search.db) and hardware profiles (profiles/) are kept"))
    strategy_server: str | None = Field(default=None, description=(
        "the strategy server's URL, when auto_accelerate's strategy_server is not given"))
    server_token: str | None = Field(default=None, description="bearer token of the strategy server (client and serve)")
    server_retry_s: float = Field(default=120.0, ge=0, allow_inf_nan=False, description=(
        "how long the strategy server's client retries a server that is unreachable or restarting (refused or "
        "dropped connections, time-outs, 429/502/503/504) before the search fails (seconds; 0: no retry)"))
    server_busy_timeout_s: float = Field(default=5.0, gt=0, description=(
        "the strategy server's SQLite busy timeout (seconds): a request waiting longer for the lock is a 503"))

    rendezvous_timeout_s: float = Field(default=300.0, gt=0, description=(
        "how long a process waits for all WORLD_SIZE processes to join the rendezvous before it raises"))
    rendezvous_report_s: float = Field(default=30.0, gt=0, description=(
        "how often a process waiting at the rendezvous says which processes it waits for"))


def settings() -> Settings:
    return Settings()


def cache_dir() -> Path:
    """The directory atorch keeps its caches in: ``$ATORCH_CACHE_DIR``, else ``~/.cache/atorch``."""
    return settings().cache_dir
