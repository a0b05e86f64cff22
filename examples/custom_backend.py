"""A model author adds an attention variant by subclassing a backend and declaring one role.

The variant: GQA with a per-token key summary (one float32 per kv head, e.g. a key norm used
to pick which blocks a sparse decode step reads). Nothing in the controller changes: the new
role is sized, named, ordered, paged and offloaded like every other.

Run: ``python examples/custom_backend.py``
"""

from __future__ import annotations

from kvforge import CacheController, CacheRole, GQABackend
from kvforge.verify import verify_request, write_request


class GQAWithKeySummary(GQABackend):
    """GQA plus a ``key_summary`` role: float32 ``[num_kv_heads]`` per token."""

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int = 16) -> None:
        super().__init__(num_kv_heads, head_dim, block_size)
        summary = CacheRole(
            name="key_summary", group="kv", entry_shape=(num_kv_heads,), dtype="float32"
        )
        self.declare(self.cache_groups(), [*self.cache_roles(), summary])


def main() -> dict[str, object]:
    # Layers 0 and 2 use the new variant, layer 1 plain GQA: one controller serves both.
    custom, plain = GQAWithKeySummary(4, 64), GQABackend(4, 64, 16)
    ctl = CacheController({0: custom, 1: plain, 2: custom})
    ctl.initialize_kv_cache(memory_budget=8 << 20)
    ctl.initialize_host_cache(memory_budget=8 << 20)
    print("storage names:", *ctl.storage_names, sep="\n  ")
    print("index_of('key_summary', 2) =", ctl.index_of("key_summary", 2))
    print("key_summary cache shape:", tuple(ctl.get("key_summary", 2).shape))

    # Write every entry, swap out, overwrite the device, swap in, compare byte for byte.
    ctl.allocate("req", 100)
    written = write_request(ctl, "req", seed=1, positions=range(100))
    out = ctl.swap_out("req")
    for cache in ctl.kv_caches:
        cache.zero_()
    ctl.swap_in("req")
    check = verify_request(ctl, "req", seed=1)
    print(
        f"swapped {out.bytes_moved:,} bytes; verified {check.entries} entries, "
        f"{check.mismatched} mismatched"
    )
    result = {
        "names": ctl.storage_names,
        "written": written,
        "verified": check.entries,
        "mismatched": check.mismatched,
        "bytes_moved": out.bytes_moved,
    }
    ctl.free_request("req")
    ctl.free()
    return result


if __name__ == "__main__":
    main()
