"""The rollout client library: `from raylane.client import RolloutClient`.

One async API over HTTP (`RolloutClient(base_url, ...)`) and inside the Ray cluster
(`RolloutClient.in_cluster()`): generate (token ids, logprobs, per-token weight versions,
routed experts, kept mass), pause/resume, bucketed weight updates, abort, multi-turn sessions,
and fan-out (fork / release / gather / aggregate).
"""

from raylane.client.errors import BadRequest, Busy, ClientError, Unauthorized
from raylane.client.fanout import Branch, aggregate
from raylane.client.rollout import Rollout, SessionTurn
from raylane.client.rollout_client import RolloutClient
from raylane.client.session import Session

__all__ = [
    "BadRequest",
    "Branch",
    "Busy",
    "ClientError",
    "Rollout",
    "RolloutClient",
    "Session",
    "SessionTurn",
    "Unauthorized",
    "aggregate",
]
