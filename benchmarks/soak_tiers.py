"""The soak's models and tiers (``soak.py --model``, ``--host-tier``, ``--remote``).

**Models.** ``--model NAME`` builds a bundled Hugging Face config
(:func:`kvforge.models.from_hf_config`) shrunk to a soak-sized layout: few layers, small heads,
small pools, with the group kinds of the full model kept:

- ``deepseek-v4`` (``deepseek-v4-tiny``): layers of compress ratios 0, 4 and 128, so a
  sliding-window group (``swa``), a full group of compressed entries (``compressed``) and two
  compressor state groups (``c4_state``, ``c128_state``);
- ``gpt-oss`` (``gpt-oss-20b``): one sliding-window and one full GQA layer (``swa``, ``kv``);
- ``qwen3-next`` (``qwen3-next-80b-a3b``): two linear-attention layers (a per-request state
  group, ``linear_state``, whose prefix reuse needs a snapshot taken at a 512-token boundary)
  and two full GQA layers (``kv``).

**Tiers.** ``--host-tier eviction|write_through`` attaches
:meth:`kvforge.CacheController.initialize_host_tier` (prefix caching on) with pages fewer than
the working set, so the host tier evicts too. ``--remote redis|mooncake`` starts a real server
on loopback inside a private network namespace (:func:`kvforge.store.servers.private_net`;
Redis falls back to the host's 127.0.0.1 where ``unshare`` is refused), attaches it behind the
host tier and stops the server by its pid at the end.

**Injected store faults** (:class:`Faults`): the adapter is subclassed at its client calls
(``_exists``, ``_get``, ``_write_encoded``, the calls a real client makes), so what a fault
does goes through the adapter's own handling, counters and back-off:

- an existence check or a get that times out or raises (``TimeoutError``,
  ``ConnectionResetError``): the adapter backs off for ``retry_after_s``;
- an existence check that says every key is there (a stale hint: the gets then miss);
- a get torn mid-read: the destination page is scribbled over and the value reported lost;
- a put that raises (the values are lost), or a value corrupted (one payload byte flipped) or
  truncated on its way to the server, so a later read of it fails its checksum or length;
- ``--remote redis``: the server killed and restarted now and then (it comes back empty).

A fault may only cost a miss or a dropped publish: every byte a hit brings to the device is
still verified, nothing may raise out of ``lookup`` or ``schedule``, a value read back
``corrupted`` or ``truncated`` must be one this wrapper damaged, and the counters must add up
(:meth:`RemoteRun.check_counters`): the tier's fetched and missed blocks are the store's hits
and misses, every page the tier published was written or counted failed, and every injected
get or put fault shows in the store's counters.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Mooncake logs every call, and every miss, through glog
os.environ.setdefault("GLOG_minloglevel", "3")

from kvforge import CacheController
from kvforge.models import from_hf_config
from kvforge.models.reading import load_model_config
from kvforge.verify import EntryCheck, entry_bytes_for, read_entries, write_entries

__all__ = [
    "HOST_TIER_POLICIES",
    "MODELS",
    "REMOTES",
    "Faults",
    "ModelSize",
    "RemoteRun",
    "check_snapshots",
    "counts",
    "model_arg",
    "model_backends",
    "model_config",
    "model_identity",
    "per_request_groups",
    "remote_line",
    "remote_run",
    "verify_state",
    "write_state",
]

HOST_TIER_POLICIES = ("eviction", "write_through")
REMOTES = ("redis", "mooncake")


@dataclass(frozen=True)
class ModelSize:
    """A bundled config shrunk to a soak-sized layout, and its pools.

    ``num_blocks``: device blocks per group without prefix caching; ``prefix_blocks``: with it
    (room for cached chains, window tails and snapshots); ``host_pages``: swap pages per group;
    ``tier_pages``: host tier pages per group (fewer than the working set, so it evicts)."""

    config: str
    overrides: dict[str, Any]
    num_blocks: dict[str, int]
    prefix_blocks: dict[str, int]
    host_pages: dict[str, int]
    tier_pages: dict[str, int]


MODELS: dict[str, ModelSize] = {
    "deepseek-v4": ModelSize(
        "deepseek-v4-tiny",
        {
            "num_hidden_layers": 3,
            "compress_ratios": [0, 4, 128],
            "num_nextn_predict_layers": 0,
            "head_dim": 64,
            "qk_rope_head_dim": 16,
            "index_head_dim": 16,
        },
        {"swa": 20, "compressed": 9, "c4_state": 60, "c128_state": 90},
        {"swa": 30, "compressed": 12, "c4_state": 100, "c128_state": 100},
        {"swa": 40, "compressed": 40, "c4_state": 40, "c128_state": 40},
        {"swa": 40, "compressed": 24, "c4_state": 80, "c128_state": 200},
    ),
    "gpt-oss": ModelSize(
        "gpt-oss-20b",
        {
            "num_hidden_layers": 2,
            "layer_types": ["sliding_attention", "full_attention"],
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "hidden_size": 16,
            "sliding_window": 48,
        },
        # the two groups' pages pair up (512 B): one pool, each group naming its count
        {"swa": 120, "kv": 120},
        {"swa": 160, "kv": 160},
        {"swa": 40, "kv": 120},
        {"swa": 64, "kv": 200},
    ),
    "qwen3-next": ModelSize(
        "qwen3-next-80b-a3b",
        {
            "num_hidden_layers": 4,
            "full_attention_interval": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "hidden_size": 16,
            "linear_key_head_dim": 8,
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 2,
            "linear_value_head_dim": 8,
        },
        {"linear_state": 8, "kv": 100},
        {"linear_state": 24, "kv": 140},
        {"linear_state": 12, "kv": 120},
        {"linear_state": 12, "kv": 200},
    ),
}
#: the bundled names are accepted too
ALIASES = {size.config: name for name, size in MODELS.items()}


def model_arg(text: str) -> str:
    """``--model``: a name of :data:`MODELS` or its bundled config's name."""
    name = ALIASES.get(text, text)
    if name not in MODELS:
        known = ", ".join(f"{n} ({s.config})" for n, s in MODELS.items())
        raise argparse.ArgumentTypeError(f"must be one of {known}, got {text!r}")
    return name


def model_backends(name: str) -> dict[int, Any]:
    """The backends of model ``name`` at soak size."""
    return from_hf_config(model_config(name))


def model_config(name: str | None) -> dict[str, Any]:
    """The effective config of model ``name`` at soak size (None: a description of the
    soak's default layout, which has no Hugging Face config)."""
    if name is None:
        return {"soak_layout": "default", "layers": "deepseek-v4 ratios 0, 4, 128 + gqa swa"}
    size = MODELS[name]
    config = load_model_config(size.config)
    config.update(size.overrides)
    return config


def model_identity(name: str | None) -> Any:
    """The :class:`kvforge.ModelIdentity` of model ``name`` at soak size, from the digest
    of its effective config: what the remote tier puts in every key and value header."""
    from kvforge.core.model_identity import ModelIdentity, config_digest

    config = model_config(name)
    return ModelIdentity(
        name=f"kvforge-soak/{name or 'default'}",
        config_digest=config_digest(config),
        dtype=str(config.get("torch_dtype", "bfloat16")),
    )


def per_request_groups(ctl: CacheController) -> list[str]:
    """Groups of a fixed number of slots per request (linear-attention state)."""
    return [g for g in ctl.groups if ctl.layout.group(g).rule.per_request]


def _state_slots(ctl: CacheController, rid: str, e: Any) -> torch.Tensor:
    """The state slots of ``rid`` in buffer ``e`` of a per-request group (its positions
    ``0 .. slots_per_request - 1`` map to them)."""
    slots = torch.as_tensor(
        np.asarray(
            ctl.slot_mapping(rid, e.group.name, range(e.group.slots_per_request), 1),
            dtype=np.int64,
        )
    )
    assert bool((slots >= 0).all()), (rid, e.group.name, slots)
    return slots


def write_state(ctl: CacheController, rid: str, seeds: Any, position: int) -> int:
    """Write the state after ``position`` into every per-request slot of ``rid``: the bytes
    :func:`kvforge.verify.entry_bytes_for` gives that position (a linear-attention state sums
    up every token, so it is the newest position's, and a snapshot at ``L`` holds position
    ``L - 1``'s). Returns the entries written."""
    groups = set(per_request_groups(ctl))
    written = 0
    for e in ctl.layout.buffers:
        if e.group.name not in groups:
            continue
        slots = _state_slots(ctl, rid, e)
        data = entry_bytes_for(seeds, e, torch.full((len(slots),), position), e.role.entry_bytes)
        write_entries(ctl.kv_caches[e.index], e, slots, data)
        written += len(slots)
    return written


def verify_state(ctl: CacheController, rid: str, seeds: Any, position: int) -> EntryCheck:
    """Compare every per-request slot of ``rid`` with the state after ``position``."""
    groups = set(per_request_groups(ctl))
    result = EntryCheck()
    for e in ctl.layout.buffers:
        if e.group.name not in groups:
            continue
        slots = _state_slots(ctl, rid, e)
        got = read_entries(ctl.kv_caches[e.index], e, slots).cpu()
        want = entry_bytes_for(seeds, e, torch.full((len(slots),), position), e.role.entry_bytes)
        result.entries += len(slots)
        result.mismatched += int((got != want).any(dim=1).sum())
    return result


def check_snapshots(ctl: CacheController, rid: str, hit: int, seeds: Any) -> int:
    """After ``schedule`` adopted a prefix hit of ``hit`` tokens for ``rid`` and before the
    step's kernels wrote anything: every per-request state slot holds the snapshot at ``hit``,
    the state after position ``hit - 1`` of this prompt (copied from a device snapshot or one
    the tiers brought back). Returns the entries compared; raises AssertionError on a
    mismatch."""
    if hit == 0:
        return 0
    got = verify_state(ctl, rid, seeds, hit - 1)
    assert got.mismatched == 0, (
        f"{rid}: {got.mismatched} of {got.entries} state entries restored at {hit} are not "
        "the prompt's snapshot"
    )
    return got.entries


def counts(counter: Any) -> str:
    """``a 1, b 2`` of a counter or dict, or ``none``."""
    return ", ".join(f"{k} {v}" for k, v in sorted(dict(counter).items())) or "none"


def remote_line(r: dict[str, Any]) -> str:
    """One line of a remote run's final counters (:meth:`RemoteRun.counters`)."""
    return (
        f"remote tier: published {r['published']} (written {r['puts_ok']}, failed "
        f"{r['puts_failed']}; dropped before queueing {r['puts_dropped']}); fetched "
        f"{r['fetched']}, missed {r['fetch_misses']} ({counts(r['misses'])}); reach "
        f"{r['reach_tokens']} tokens; client errors {r['errors']} ({r['real_errors']} not "
        f"injected; last: {r['last_real_error']})"
    )


# ---------------------------------------------------------------------- faults


@dataclass
class Faults:
    """What to inject and what was injected (shared by the adapter's threads: locked)."""

    rate: float
    seed: int
    injected: Counter = field(default_factory=Counter)
    #: server names of values written damaged (a read of any other must not fail its checks)
    damaged: set[str] = field(default_factory=set)
    #: reads that failed their checksum or length for a value never damaged (must stay empty)
    unexplained: list[str] = field(default_factory=list)
    #: client calls that raised without an injected fault (a server restart, a timeout under
    #: load), ``Type: message``: each costs misses like an injected one
    real_errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.lock = threading.Lock()

    def roll(self, scale: float = 1.0) -> float | None:
        """A uniform draw when a fault fires (probability ``rate * scale``), else None."""
        with self.lock:
            if self.rate and self.rng.random() < self.rate * scale:
                return self.rng.random()
            return None

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.injected[what] += n

    def call(self, fn: Any, *args: Any) -> Any:
        """Run a real client call, noting an exception it raises (then re-raised)."""
        try:
            return fn(*args)
        except Exception as exc:
            with self.lock:
                self.real_errors.append(f"{type(exc).__name__}: {exc}"[:200])
            raise


def _faulty(base: type) -> type:
    """A subclass of the adapter ``base`` whose client calls fail as :class:`Faults` says."""
    from kvforge.store.value import MissReason

    bad_reads = {MissReason.CORRUPTED, MissReason.TRUNCATED, MissReason.OTHER_LENGTH}

    class Faulty(base):  # type: ignore[misc, valid-type]
        faults: Faults

        def _exists(self, names: list[str]) -> list[bool]:
            draw = self.faults.roll()
            if draw is not None and draw < 0.5:
                self.faults.count("exists_raised")
                raise TimeoutError("injected: existence check timed out")
            flags = self.faults.call(super()._exists, names)
            if draw is not None:
                self.faults.count("exists_lied")
                return [True] * len(flags)
            return flags

        def _get(self, items: list[Any]) -> list[Any]:
            draw = self.faults.roll()
            if draw is not None and draw < 0.4:
                self.faults.count("gets_raised")
                self.faults.count("get_keys_raised", len(items))
                raise ConnectionResetError("injected: connection reset during a get")
            reasons = list(self.faults.call(super()._get, items))
            # an item is (name, key, ..., destination span): the fields between vary by
            # format version (a proof of the stored tokens)
            for item, reason in zip(items, reasons, strict=True):
                name = item[0]
                if reason in bad_reads and name not in self.faults.damaged:
                    with self.faults.lock:
                        self.faults.unexplained.append(f"{name}: {reason.value}")
            if draw is not None:
                torn = self.faults.rng.randrange(len(items))
                span = items[torn][-1]
                view = np.frombuffer(span.view, dtype=np.uint8)
                view[:] = np.random.default_rng(torn).integers(0, 256, view.size, np.uint8)
                reasons[torn] = MissReason.STORE_ERROR
                self.faults.count("gets_torn")
            return reasons

        def _write_encoded(self, items: list[tuple[str, np.ndarray]]) -> list[bool]:
            draw = self.faults.roll()
            if draw is not None and draw < 0.3:
                self.faults.count("puts_raised")
                self.faults.count("put_values_raised", len(items))
                raise TimeoutError("injected: put timed out")
            if draw is not None:
                i = self.faults.rng.randrange(len(items))
                name, value = items[i]
                bad = np.array(value, copy=True)
                if draw < 0.65:
                    bad[-1 - self.faults.rng.randrange(min(64, bad.size - 80))] ^= 0x5A
                    self.faults.count("values_corrupted")
                else:
                    bad = bad[: max(1, bad.size - 1 - self.faults.rng.randrange(bad.size // 2))]
                    self.faults.count("values_truncated")
                with self.faults.lock:
                    self.faults.damaged.add(name)
                items = [*items[:i], (name, bad), *items[i + 1 :]]
            return self.faults.call(super()._write_encoded, items)

    Faulty.__name__ = Faulty.__qualname__ = f"Faulty{base.__name__}"
    return Faulty


# ---------------------------------------------------------------------- servers


@dataclass
class RemoteRun:
    """One remote tier of a soak: its server, the store attached to the controller, the
    faults and what the counters said at the end."""

    kind: str
    server: Any
    faults: Faults
    log_dir: Path
    restart_every: int = 0
    store: Any = None
    ctl: CacheController | None = None
    restarts: int = 0
    ticks: int = 0
    final: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def config(self, **fields: Any) -> Any:
        from kvforge.store import StoreConfig

        if self.kind == "redis":
            base = dict(
                backend="redis",
                redis_port=self.server.port,
                op_timeout_s=2.0,
                connect_timeout_s=1.0,
                retry_after_s=0.02,
                close_timeout_s=5.0,
            )
        else:
            base = dict(
                backend="mooncake",
                mooncake_master=self.server.address,
                mooncake_global_segment_bytes=64 << 20,
                mooncake_local_buffer_bytes=16 << 20,
                op_timeout_s=5.0,
                retry_after_s=0.02,
                close_timeout_s=5.0,
            )
        return StoreConfig(**{**base, **fields})

    def attach(self, ctl: CacheController, model: str | None = None) -> None:
        """Open the faulty adapter for ``ctl``'s layout and the identity of ``model`` (a
        name of :data:`MODELS`, None: the soak's default layout) and put it behind ``ctl``'s
        host tier."""
        from kvforge.remote_tier import layout_fingerprint

        if self.kind == "redis":
            from kvforge.store.redis_store import RedisStore as base
        else:
            from kvforge.store.mooncake_store import MooncakeStore as base
        try:
            identity = model_identity(model)
        except ImportError:  # a kvforge before model identities: the fingerprint had a rank
            identity = None
        cls = _faulty(base)
        fingerprint = layout_fingerprint(ctl.layout, 0 if identity is None else identity)
        store = cls(self.config(), fingerprint)
        store.faults = self.faults
        if not store.wait_ready(60.0):
            store.close()
            raise RuntimeError(f"the {self.kind} store is not ready: {store.stats()}")
        if identity is None:
            ctl.initialize_remote_tier(store)
        else:
            ctl.initialize_remote_tier(store, identity)
        self.store, self.ctl = store, ctl

    def tick(self) -> None:
        """After an operation: restart a Redis server now and then (it comes back empty)."""
        with self.lock:
            self.ticks += 1
            due = self.restart_every and self.ticks % self.restart_every == 0
        if due and self.kind == "redis":
            self.server.kill()
            self.server.start()
            self.restarts += 1

    def counters(self) -> dict[str, Any]:
        """The tier's and the store's counters now."""
        assert self.ctl is not None
        tier, store = self.ctl.remote_tier.stats, self.store.stats()
        return {
            "published": tier.published,
            "fetched": tier.fetched,
            "fetch_misses": tier.fetch_misses,
            "reach_tokens": tier.reach_tokens,
            "puts_ok": store.puts_ok,
            "puts_failed": store.puts_failed,
            "puts_dropped": store.puts_dropped,
            "gets_hit": store.gets_hit,
            "misses": dict(store.misses),
            "errors": store.errors,
            "real_errors": len(self.faults.real_errors),
            "last_real_error": self.faults.real_errors[-1] if self.faults.real_errors else None,
        }

    def check_counters(self, flushed: bool = False) -> dict[str, Any]:
        """The counters add up: blocks the tier fetched are the store's hits, its misses the
        store's misses (by any reason); every injected fault shows; no value was read back
        damaged unless this run damaged it. ``flushed``: the put queue is idle, so every page
        published was written or counted failed."""
        c = self.counters()
        inj = self.faults.injected
        assert not self.faults.unexplained, f"values read damaged: {self.faults.unexplained[:5]}"
        assert c["fetched"] == c["gets_hit"], c
        assert c["fetch_misses"] == sum(c["misses"].values()), c
        # a raised get fails every key of its round trip; a torn one fails one key
        torn_or_raised = inj["get_keys_raised"] + inj["gets_torn"]
        assert c["misses"].get("store_error", 0) >= torn_or_raised, (c, inj)
        assert c["errors"] >= inj["gets_raised"] + inj["exists_raised"], (c, inj)
        if flushed:
            assert c["puts_ok"] + c["puts_failed"] == c["published"], c
            assert c["puts_failed"] >= inj["put_values_raised"], (c, inj)
        return c

    def finish(self) -> dict[str, Any]:
        """Wait for the queued puts, check the counters; the controller closes the store."""
        flushed = self.store.flush(60.0)
        assert flushed, f"queued puts did not drain: {self.store.stats()}"
        self.final = self.check_counters(flushed=True)
        return self.final


def _server(kind: str, private: bool, log_dir: Path) -> Any:
    from kvforge.store.servers import MooncakeMaster, RedisServer, free_port

    if kind == "redis":
        return RedisServer(6379 if private else free_port(), log_dir / "redis.log")
    return MooncakeMaster(50051, 50052, log_dir / "master.log")


def missing(kind: str) -> str | None:
    """Why the ``kind`` server cannot run here, or None."""
    import importlib.util

    binary, module = ("redis-server", "redis")
    if kind == "mooncake":
        binary, module = "mooncake_master", "mooncake"
    if shutil.which(binary) is None:
        return f"{binary} is not installed"
    if importlib.util.find_spec(module) is None:
        return f"the {module} client is not installed"
    return None


@contextlib.contextmanager
def remote_run(
    kind: str | None, fault_rate: float, seed: int, restart_every: int = 0
) -> Iterator[RemoteRun | None]:
    """Start a ``kind`` server on loopback in a private network namespace (the calling
    thread's, for the whole run: the store's client threads are created in it), yield the
    run, stop the server by its pid at the end. ``None``: no remote tier."""
    if kind is None:
        yield None
        return
    from kvforge.store.servers import private_net

    why_not = missing(kind)
    if why_not is not None:
        raise RuntimeError(f"--remote {kind}: {why_not}")
    with private_net() as why, tempfile.TemporaryDirectory(prefix="kvforge-soak-") as tmp:
        if why and kind == "mooncake":
            raise RuntimeError(f"--remote mooncake needs a private network namespace: {why}")
        server = _server(kind, not why, Path(tmp))
        server.start()
        run = RemoteRun(kind, server, Faults(fault_rate, seed), Path(tmp), restart_every)
        try:
            yield run
        finally:
            if run.store is not None and not run.store.stats().closed:
                run.store.close()
            server.stop()
