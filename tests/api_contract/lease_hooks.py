"""Schemathesis hooks for the discovery API's contract run (tests/api_contract.rs).

Every built-in check runs. One of them, `ensure_resource_availability`, assumes that only a
DELETE frees a resource; this API frees a lease with `POST /v1/leases/{leaseId}/release`, so a
renew that follows a release in the same scenario is a correct 404 that the built-in check would
report. `lease_available_until_released` is that check made lease-aware: it runs the built-in
one unless the lease was released (2xx) earlier in the scenario or has expired (a scenario may
ask for a one-second TTL), and the built-in one is excluded on the command line.
"""

from datetime import datetime, timezone

import schemathesis
from schemathesis.specs.openapi.checks import ensure_resource_availability

RELEASE = "/v1/leases/{leaseId}/release"


def _released_before(ctx, case):
    recorder = ctx.internals.recorder
    lease_id = (case.path_parameters or {}).get("leaseId")
    if recorder is None or lease_id is None:
        return False
    for prior in recorder.find_all_cases():
        if prior.id == case.id or prior.path != RELEASE:
            continue
        if (prior.path_parameters or {}).get("leaseId") != lease_id:
            continue
        response = recorder.find_response(case_id=prior.id)
        if response is not None and 200 <= response.status_code < 300:
            return True
    return False


def _expired(ctx, case):
    parent = ctx.internals.find_parent(case_id=case.id)
    if parent is None:
        return False
    response = ctx.internals.find_response(case_id=parent.id)
    try:
        expires = response.json().get("expiresAt")
    except Exception:  # not JSON, or not an object: nothing says when it ends
        return False
    if not isinstance(expires, str):
        return False
    ends = datetime.fromisoformat(expires.replace("Z", "+00:00"))
    return datetime.now(timezone.utc) >= ends


@schemathesis.check
def lease_available_until_released(ctx, response, case):
    """A lease just granted is found by its renew and release links until it is released."""
    if response.status_code != 404 or _released_before(ctx, case) or _expired(ctx, case):
        return None
    return ensure_resource_availability(ctx, response, case)
