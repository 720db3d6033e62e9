"""What the live-settings tests ask of a router's key table (services/router/live_settings.py)."""
from __future__ import annotations

from services.router.errors import AuthenticationError
from services.router.live_settings import RouterLiveSettings


def knows(live: RouterLiveSettings, key: str) -> bool:
    """Whether ``live``'s router accepts ``key`` now."""
    try:
        live.keys.authenticate(key)
    except AuthenticationError:
        return False
    return True
