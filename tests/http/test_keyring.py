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
    assert await ring.enabled()
    await ring.accounts.delete_key(record.id)
    assert await ring.enabled()


async def test_auth_stays_on_in_a_running_gateway_whose_store_forgot_everything():
    accounts = Forgetful()
    ring = KeyRing(accounts)
    _, record = mint("admin", "admin")
    await accounts.put_key(record)
    assert await ring.enabled()
    accounts.wipe()
    assert not await accounts.sealed() and await ring.enabled()


async def test_a_key_made_on_another_gateway_seals_this_ones_next_request():
    """Found by the simulator (seed 145): a gateway asked its accounts at most once a second whether they were
    sealed, so for up to a second after the first key was made on another gateway it served requests with no key
    or a made-up one. It asks at every request until it is sealed."""
    shared = MemoryAccounts()
    here, there = KeyRing(shared), KeyRing(shared)
    assert not await here.enabled()
    _, record = mint("admin", "admin")
    await there.accounts.put_key(record)
    assert await here.enabled()


async def test_keys_of_one_tenant_share_a_prompt_cache_scope_and_no_other_key_does():
    from types import SimpleNamespace

    from meshgate.gateway.http.routes.common import who

    accounts = MemoryAccounts()
    ring = KeyRing(accounts)
    made = [mint("ci", tenant="acme"), mint("laptop", tenant="acme"), mint("guest")]
    for _, record in made:
        await accounts.put_key(record)
    first, second, guest = [await ring._match(key) for key, _ in made]
    assert first.tenant == second.tenant == "tenant:acme"
    assert guest.tenant == f"key:{made[2][1].id}", "a key without a tenant shares with no other key"

    def scope(caller, sharing: str) -> str:
        state = SimpleNamespace(keyring=ring, settings=SimpleNamespace(kv_sharing=sharing))
        request = SimpleNamespace(app=SimpleNamespace(state=state), state=SimpleNamespace(caller=caller))
        return who(request)["cache_scope"]

    assert scope(first, "tenant") == "tenant:acme" and scope(guest, "tenant") != "tenant:acme"
    assert scope(guest, "all") == scope(first, "all") == ""
