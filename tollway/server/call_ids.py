"""Call ids a fleet's ingress gives: it names each API call once, and every replica it tries
gives the call that id. A call the ingress retries after its replica billed it (and then failed
before answering) is so billed once: the ledger has its row already (Budgets.settle).

A replica takes a call's id only beside the fleet's secret, which only the ingress holds: a
client that could name ids could have its later calls taken for an earlier, billed one."""
from __future__ import annotations

import hmac
import re
import uuid
from collections.abc import Mapping

CALL_ID = "x-tollway-call-id"
FLEET_SECRET = "x-tollway-fleet-secret"
_FORM = re.compile(r"[0-9a-f]{24}")


def new_call_id() -> str:
    return uuid.uuid4().hex[:24]


def trusted_call_id(headers: Mapping[str, str], secret: str | None) -> str | None:
    """The call's id from the ingress, or None: not a fleet replica, no or a wrong secret, or
    not an id the ingress makes."""
    given = headers.get(FLEET_SECRET)
    if secret is None or given is None or not hmac.compare_digest(given.encode(), secret.encode()):
        return None
    call = headers.get(CALL_ID, "")
    return call if _FORM.fullmatch(call) else None
