"""The prefix-reuse part of ``kvforge demo``: multi-turn conversations over a shared system
prompt, with the prefix cache on, every reused byte verified.

Each turn's prompt is the conversation so far (system prompt, earlier user messages and
replies) plus a new user message. The turn looks its prompt up, starts at the matched
boundary sharing the cached blocks, prefills the rest in chunks and decodes its reply one
token a step, writing every token through the step's slots. Entry contents are seeded by the
key of the prefix up to each position (:func:`kvforge.verify.token_seeds`), so a block shared
from an earlier turn or another conversation holds exactly what recomputing it would write;
every live entry of every turn, reused ones included, is compared before the turn is freed.

With ``tier="host"`` the device pools hold about one conversation, so conversations evict
each other's prefixes, and a host tier (:meth:`CacheController.initialize_host_tier`) keeps
what the device evicts: later turns are served partly from host pages, brought back byte for
byte before they are read, and verified like every other entry.

With ``tier="redis"`` or ``"mooncake"`` the conversations run twice, on two controllers in this
process that share one store server (``address``): engine A (a host tier with
``policy="write_through"`` and a remote tier) runs them and publishes every completed block;
engine B, a fresh controller with its own device pools, host tier and remote tier, then runs
the same conversations, and its hits come from its device, its host pages and the store (fetched
into host pages, then brought to the device). Engine A stays up until B is done: a Mooncake
client's segment holds the values it put. Every entry of both engines is verified.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from kvforge.attn_backends.base import AttentionBackend
from kvforge.cli.remotes import REMOTES, StoreUnavailable, check_available
from kvforge.controller import CacheController
from kvforge.core.values import PrefixQuery
from kvforge.verify import EntryCheck, token_seeds, verify_request, write_step

__all__ = [
    "REMOTE_TIERS",
    "TIERS",
    "PrefixDemoResult",
    "StoreUnavailable",
    "run_prefix_demo",
    "store_server",
]

PREFILL_CHUNK = 256
#: where cached prefixes may live in the demo: the device alone, the device and host pages,
#: or those and a remote store
TIERS: tuple[str, ...] = ("device", "host", "redis", "mooncake")
REMOTE_TIERS: tuple[str, ...] = REMOTES
#: how long a store may take to answer before the demo gives up on it
READY_TIMEOUT_S = 15.0
#: how long engine A's queued puts may take to reach the store
FLUSH_TIMEOUT_S = 60.0


class PrefixDemoResult(BaseModel):
    """What the prefix-reuse phase measured.

    Attributes:
        conversations: conversations run.
        turns: turns (requests) run.
        prompt_tokens: prompt tokens of every turn.
        hit_tokens: prompt tokens served from cache.
        boundary: the alignment of every reusable prefix (LCM of the groups' block sizes).
        entries_verified: live entries compared at the end of every turn.
        entries_mismatched: of those, entries whose bytes differ (0 when nothing is lost).
        tier: ``"device"`` or ``"host"`` (a host tier behind a device that holds about one
            conversation).
        host_hit_tokens: of ``hit_tokens``, those served past what the device held alone
            (brought back from host pages).
        host_blocks: blocks brought back from host pages.
        host_demotions: device blocks kept in host pages when the device evicted them
            (with a remote tier, the host tier writes through: blocks as they complete).
        backend: the remote tier's store (``"redis"``, ``"mooncake"``), else ``""``.
        server: ``"started"`` (by the demo) or the address given, else ``""``.
        engines: controllers that ran the conversations (2 with a remote tier: A publishes,
            B reuses; the hit fields above are B's, ``turns``/``prompt_tokens`` one engine's,
            ``entries_*`` both engines').
        remote_hit_tokens: of ``host_hit_tokens``, those engine B fetched from the store into
            host pages first (the remote tier's ``reach_tokens``).
        remote_fetched: values engine B read from the store whole.
        remote_fetch_misses: values engine B asked for that did not arrive whole.
        remote_published: values engine A queued for the store.
        remote_stored: of those, values the store accepted (``puts_ok``).
        writer_hit_tokens: engine A's own hits (device and host pages; its store was empty).
        notes: how the server ran (a private network namespace, or the host's 127.0.0.1 and
            why).
    """

    model_config = ConfigDict(frozen=True)

    conversations: int
    turns: int
    prompt_tokens: int
    hit_tokens: int
    boundary: int
    entries_verified: int
    entries_mismatched: int
    tier: str = "device"
    host_hit_tokens: int = 0
    host_blocks: int = 0
    host_demotions: int = 0
    backend: str = ""
    server: str = ""
    engines: int = 1
    remote_hit_tokens: int = 0
    remote_fetched: int = 0
    remote_fetch_misses: int = 0
    remote_published: int = 0
    remote_stored: int = 0
    writer_hit_tokens: int = 0
    notes: tuple[str, ...] = ()

    @property
    def hit_rate(self) -> float:
        """Display only: ``hit_tokens / prompt_tokens``."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _one_engine(
    backends: Mapping[int, AttentionBackend], conversations: int, seed: int, device: str, tier: str
) -> PrefixDemoResult:
    """The conversations on one controller, its prefixes on the device (and the host tier)."""
    ctl = CacheController(backends, device=device, enable_prefix_caching=True)
    try:
        boundary = _size(ctl, tier)
        run = _Conversations(conversations, seed, boundary).run(ctl)
        stats = ctl.host_tier.stats if ctl.host_tier is not None else None
        return run.result(
            tier=tier,
            host_hit_tokens=stats.hit_tokens if stats else 0,
            host_blocks=sum(stats.hits.values()) if stats else 0,
            host_demotions=sum(stats.demotions.values()) if stats else 0,
        )
    finally:
        ctl.free()


def run_prefix_demo(
    backends: Mapping[int, AttentionBackend],
    conversations: int,
    seed: int,
    device: str = "cpu",
    tier: Literal["device", "host", "redis", "mooncake"] = "device",
    address: str | None = None,
) -> PrefixDemoResult:
    """Run ``conversations`` multi-turn conversations (2 to 4 turns, interleaved) through a
    controller with prefix caching, and verify every entry of every turn. With a remote
    ``tier``, run them on engine A then on engine B, sharing the store at ``address``
    (``HOST:PORT``; see the module docstring).

    Raises:
        ValueError: ``tier`` is not one of :data:`TIERS`, or a remote tier without
            ``address``.
        StoreUnavailable: the store at ``address`` did not answer.
    """
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {list(TIERS)}, got {tier!r}")
    if tier not in REMOTE_TIERS:
        return _one_engine(backends, conversations, seed, device, tier)
    if not address:
        raise ValueError(f"tier {tier!r} needs the store's address (HOST:PORT)")
    engines: list[CacheController] = []
    try:
        for _ in range(2):
            ctl = CacheController(backends, device=device, enable_prefix_caching=True)
            engines.append(ctl)
            boundary = _size(ctl, tier)
            _remote(ctl, tier, address)
        writer, reader = engines
        first = _Conversations(conversations, seed, boundary).run(writer)
        store = writer.remote_tier.store  # type: ignore[union-attr]
        if not store.flush(FLUSH_TIMEOUT_S):
            raise StoreUnavailable(
                f"{tier} at {address}: engine A's puts did not reach the store within "
                f"{FLUSH_TIMEOUT_S:.0f} s ({store.stats()})"
            )
        second = _Conversations(conversations, seed, boundary).run(reader)
        return _two_engines(first, second, writer, reader, tier, address)
    finally:
        for ctl in reversed(engines):
            ctl.free()


def _two_engines(
    first: _Conversations,
    second: _Conversations,
    writer: CacheController,
    reader: CacheController,
    tier: str,
    address: str,
) -> PrefixDemoResult:
    """The result of engine B's run (``second``) after engine A's (``first``) published."""
    host = reader.host_tier.stats  # type: ignore[union-attr]
    remote = reader.remote_tier.stats  # type: ignore[union-attr]
    store = writer.remote_tier.store  # type: ignore[union-attr]
    return second.result(
        tier=tier,
        engines=2,
        entries_verified=first.verified + second.verified,
        entries_mismatched=first.mismatched + second.mismatched,
        host_hit_tokens=host.hit_tokens,
        host_blocks=sum(host.hits.values()),
        host_demotions=sum(host.demotions.values()),
        backend=tier,
        server=address,
        remote_hit_tokens=remote.reach_tokens,
        remote_fetched=remote.fetched,
        remote_fetch_misses=remote.fetch_misses,
        remote_published=writer.remote_tier.stats.published,  # type: ignore[union-attr]
        remote_stored=store.stats().puts_ok,
        writer_hit_tokens=first.hit_tokens,
    )


@contextlib.contextmanager
def store_server(tier: str, address: str | None) -> Iterator[tuple[str, list[str]]]:
    """The address of ``tier``'s server and notes on how it runs: ``address`` when given,
    else a server started here (in a private network namespace where ``unshare`` is allowed,
    else on 127.0.0.1), stopped by its pid on exit. The calling thread stays in that namespace
    until exit, so run the engines inside. Shares :func:`kvforge.cli.bench_tiers.servers`.

    Raises:
        StoreUnavailable: the client or the server binary is missing, the server did not
            start, or nothing accepts a connection at ``address``.
    """
    from kvforge.cli.bench_tiers import servers

    if tier not in REMOTE_TIERS:
        raise ValueError(f"tier must be one of {list(REMOTE_TIERS)}, got {tier!r}")
    # before the serving loop runs: a missing client or binary, an address nothing answers on
    check_available(tier, address)
    notes: list[str] = []
    with servers([tier], {tier: address} if address else {}, notes) as found:
        if tier not in found:
            said = [n.replace(f"{tier}: skipped, ", f"{tier}: ") for n in notes]
            raise StoreUnavailable("; ".join(said) or f"{tier}: its server did not start", tier)
        if address is None and not notes:
            notes.append(f"{tier} started in a private network namespace")
        yield found[tier], notes


def _remote(ctl: CacheController, tier: str, address: str) -> None:
    """A remote tier on ``address`` behind ``ctl``'s host tier, answering (else
    :class:`StoreUnavailable`)."""
    from kvforge.store import StoreConfig

    host, _, port = address.rpartition(":")
    common: dict[str, Any] = dict(connect_timeout_s=5.0, op_timeout_s=10.0, close_timeout_s=5.0)
    common["max_inflight_puts"] = 4096  # a burst of completed blocks is queued, never dropped
    if tier == "redis":
        config = StoreConfig(backend="redis", redis_host=host, redis_port=int(port), **common)
    else:
        config = StoreConfig(backend="mooncake", mooncake_master=address, **common)
    from kvforge.core.model_identity import ModelIdentity, config_digest

    # the demo's engines write synthetic KV, a function of the tokens (kvforge.verify): one
    # "model" for both, in every key and value header as a real engine's identity would be
    model = ModelIdentity(
        name="kvforge-demo/synthetic-kv",
        config_digest=config_digest({"kv": "kvforge.verify.token_seeds", "version": 1}),
        dtype="synthetic",
    )
    try:
        store = ctl.initialize_remote_tier(config, model=model).store
    except ModuleNotFoundError as exc:
        raise StoreUnavailable(str(exc)) from None
    if not store.wait_ready(READY_TIMEOUT_S):
        why = store.stats().last_error or "no answer"
        raise StoreUnavailable(
            f"{tier} at {address} did not answer within {READY_TIMEOUT_S:.0f} s: {why}"
        )


class _Conversations:
    """The conversations of one seed, run on one controller; the same tokens on every run."""

    def __init__(self, conversations: int, seed: int, boundary: int) -> None:
        self.conversations, self.seed, self.boundary = conversations, seed, boundary
        self.turns = self.prompt_tokens = self.hit_tokens = self.verified = self.mismatched = 0

    def run(self, ctl: CacheController) -> _Conversations:
        rng, boundary, conversations = random.Random(self.seed), self.boundary, self.conversations
        system = _tokens(rng, 3 * boundary // 2)
        history = {c: list(system) for c in range(conversations)}
        turns = {c: rng.randint(2, 4) for c in range(conversations)}
        while any(turns.values()):
            for c in range(conversations):
                if not turns[c]:
                    continue
                turns[c] -= 1
                prompt = history[c] + _tokens(rng, rng.randint(boundary // 8, boundary))
                reply = _tokens(rng, rng.randint(8, 48))
                hits, check = _turn(ctl, f"conv{c}-turn{self.turns}", prompt, reply)
                self.prompt_tokens += len(prompt)
                self.hit_tokens += hits
                self.verified += check.entries
                self.mismatched += check.mismatched
                history[c] = prompt + reply
                self.turns += 1
        return self

    def result(self, **fields: Any) -> PrefixDemoResult:
        base: dict[str, Any] = dict(
            conversations=self.conversations,
            turns=self.turns,
            prompt_tokens=self.prompt_tokens,
            hit_tokens=self.hit_tokens,
            boundary=self.boundary,
            entries_verified=self.verified,
            entries_mismatched=self.mismatched,
        )
        return PrefixDemoResult(**(base | fields))


def _size(ctl: CacheController, tier: str = "device") -> int:
    """Pools that hold a few whole conversations (``tier="device"``), or about one, with a
    host tier of a few conversations behind them (``"host"``, and a remote tier's); returns
    the reuse boundary (LCM)."""
    import math

    boundary = math.lcm(*(g.block_size for g in ctl.layout.groups if g.block_size > 1))
    longest = 24 * boundary
    # with a host tier, room for about one conversation (a turn's prompt reaches about 6
    # boundaries), so conversations evict each other's prefixes into host pages
    if tier == "device":
        blocks = {g.name: 4 * g.blocks_for(longest) + 2 for g in ctl.layout.groups}
    else:
        # the longest turn (a system prompt, 4 messages of at most a boundary, 4 replies of
        # at most 48 tokens) and a few blocks: conversations evict each other's prefixes
        turn = 3 * boundary // 2 + 4 * (boundary + 48)
        layout = ctl.layout
        blocks = {}
        for members in layout.pool_sets:  # groups whose pages pair up draw on one pool
            n = sum(layout.group(m).blocks_for(turn) for m in members) + 1
            blocks.update(dict.fromkeys(members, n))
    ctl.initialize_kv_cache(num_blocks=blocks, max_num_seqs=8, max_model_len=longest)
    if tier != "device":
        pages = {g.name: 4 * g.blocks_for(longest) + 2 for g in ctl.layout.groups}
        # a remote tier publishes what the host tier holds: write through, so every completed
        # block reaches the store at once, not only what the device evicts
        policy = "eviction" if tier == "host" else "write_through"
        ctl.initialize_host_tier(num_pages=pages, policy=policy)
    return boundary


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(n)]


def _turn(
    ctl: CacheController, rid: str, prompt: list[int], reply: list[int]
) -> tuple[int, EntryCheck]:
    """One turn: look up, prefill from the match, decode the reply, verify, free."""
    [match] = ctl.lookup([PrefixQuery(prompt)])
    sequence = np.array(prompt + reply, dtype=np.int64)
    seeds = token_seeds(sequence)
    done, first = match.num_tokens, True
    while done < len(sequence):
        n = min(PREFILL_CHUNK, len(prompt) - done) if done < len(prompt) else 1
        step = ctl.schedule(
            [rid],
            [n],
            new_token_ids=[sequence[done : done + n]],
            prefix_matches=[match] if first else None,
        )
        if step.allocation.refused:
            raise RuntimeError(step.allocation.refused[0].message)
        n = int(step.allocation.num_new[0])
        write_step(ctl, step, {rid: seeds})
        ctl.end_step(step)
        done += n
        first = False
    check = verify_request(ctl, rid, seeds)
    ctl.free_request(rid)
    return match.num_tokens, check
