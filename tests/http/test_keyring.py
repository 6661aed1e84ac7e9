"""``KeyRing.enabled``: auth fails closed (issue 37, 1). Once the accounts are sealed (a key was made), no later
state of the key store turns auth off in a running gateway: not the last key revoked, not the store emptied."""

from __future__ import annotations

from meshgate.gateway.auth.guard import KeyRing, mint
from meshgate.gateway.auth.keys import MemoryAccounts


class Forgetful(MemoryAccounts):
    """Accounts that lose everything, seal included (a Redis restarted empty with no copy anywhere)."""

    def wipe(self) -> None:
        self._keys.clear()
        self._sealed = False


async def test_auth_stays_on_when_the_last_key_is_revoked(tmp_path):
    ring = KeyRing(MemoryAccounts(tmp_path / "keys.json"))
    assert not await ring.enabled()  # a fresh gateway on loopback: open until the first key
    _, record = mint("admin", "admin")
    await ring.accounts.put_key(record)
    ring.forget()
    assert await ring.enabled()
    await ring.accounts.delete_key(record.id)
    ring.forget()
    assert await ring.enabled()


async def test_auth_stays_on_in_a_running_gateway_whose_store_forgot_everything():
    accounts = Forgetful()
    ring = KeyRing(accounts)
    _, record = mint("admin", "admin")
    await accounts.put_key(record)
    ring.forget()
    assert await ring.enabled()
    accounts.wipe()
    ring.forget()
    assert not await accounts.sealed() and await ring.enabled()
