"""The authorization decision and the secrets, without a server or a database."""

from __future__ import annotations

import hashlib

import pytest

from services.api.tokens import AuthRefusal, Caller, Role, authorize, digest, new_secret

ROLES = list(Role)


@pytest.mark.parametrize("needed", ROLES)
def test_no_token_and_unknown_token_are_401_naming_the_role(needed: Role) -> None:
    for presented in (False, True):
        out = authorize(needed=needed, presented=presented, caller=None)
        assert isinstance(out, AuthRefusal) and out.status == 401 and f"role {needed}" in out.detail


@pytest.mark.parametrize("has", ROLES)
@pytest.mark.parametrize("needed", ROLES)
def test_role_order_viewer_operator_admin(has: Role, needed: Role) -> None:
    caller = Caller("t", has)
    out = authorize(needed=needed, presented=True, caller=caller)
    if ROLES.index(has) >= ROLES.index(needed):
        assert out is caller
    else:
        assert isinstance(out, AuthRefusal) and out.status == 403
        assert out.detail == f"token 't' has role {has}; this call needs role {needed} or above"


def test_secrets_are_random_prefixed_and_stored_as_sha256() -> None:
    a, b = new_secret(), new_secret()
    assert a != b and a.startswith("pulse_") and len(a) == len("pulse_") + 43
    assert digest(a) == hashlib.sha256(a.encode()).hexdigest()
