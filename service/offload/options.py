"""Options and counters of one offloaded module (plain data, shared by runtime and callers)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Placement:
    """Where tensors live besides the two slots (all optional; defaults stream every block).

    ``resident_blocks``: keep this many blocks on the device (spread over the depth).
    ``device_memory_budget``: or keep as many as fit in this many bytes beside the slots,
    the non-block tensors and ``activation_bytes`` (a reserve the caller measured).
    ``tied``: alias key -> source key for tied weights a checkpoint stores once.
    ``host_modules``: ``nn.Embedding`` modules kept on the host (mmap view): a lookup is
    exact anywhere and a 256k-token table need not take device memory.
    ``pagecache``: rank-local on CUDA: None tries DMA from the registered page cache and
    falls back to the pack thread (logging why), True requires it, False packs.
    ``free_slots``: allocate the two slots at each forward's start and free them at its
    end (no collectives only): for a module run once per request (a text encoder), so its
    slots do not sit beside the transformer's for the whole request.
    ``fill_behind``: resident blocks fill on threads after the handle is made (a forward
    waits for the blocks it calls); the caller calls ``wait_resident`` before it serves:
    a compile warm-up then runs beside the copies (offload.fill.ResidentFill).
    """

    resident_blocks: int | None = None
    device_memory_budget: int | None = None
    activation_bytes: int = 0
    tied: dict[str, str] = field(default_factory=dict)
    host_modules: tuple[str, ...] = ()
    pagecache: bool | None = None
    free_slots: bool = False
    fill_behind: bool = False


@dataclass
class OffloadStats:
    """Counters of one offloaded module (per rank). Times in seconds, sizes in bytes."""

    mode: str
    rank: int
    world_size: int
    blocks: int
    resident_blocks: int = 0
    rank_local_source: str = ""  # "shards" (AllGather), "pagecache" or "pack" (rank-local)
    source_reason: str = ""
    forwards: int = 0
    idle_forwards: int = 0
    stall_s: float = 0.0  # time compute waited for weights, all forwards (CUDA: from events)
    last_forward_stall_s: float = 0.0  # CPU only; on CUDA events finish after the forward
    h2d_bytes: int = 0
    last_forward_h2d_bytes: int = 0
    gathered_bytes: int = 0
    last_forward_gathered_bytes: int = 0
    gather_s: float = 0.0  # time inside AllGathers (on a side stream/thread: overlaps compute)
    host_shard_bytes: int = 0
    host_pinned_bytes: int = 0
    host_registered_bytes: int = 0  # page cache registered for DMA (shared, not private)
    device_slot_bytes: int = 0
    device_resident_bytes: int = 0  # non-block tensors + resident blocks
    device_resident_block_bytes: int = 0
    device_budget_bytes: int = 0
    activation_bytes: int = 0
    device_peak_bytes: int = 0
    largest_block_bytes: int = 0
    block_bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    quantization: str = ""  # "" or "fp8" (block Linear weights)
    quantization_source: str = ""  # "online" (quantized at load) or "prequantized" (in the files)
    fp8_compute: str = ""  # "upcast" or "scaled_mm"
    # Step caches (``LayerwiseOffload.enable_skips``): what forwards that stopped early saved.
    fills: int = 0  # slot fills made (H2D copies, gathers or packs), whatever the device
    fill_bytes: int = 0  # bytes of the blocks filled into slots (whole blocks)
    skip_decisions: int = 0  # decision points passed (each an agreement in an AllGather group)
    skip_agree_s: float = 0.0  # time in those agreements
    skips: int = 0  # forwards that stopped at a decision point (the group agreed none needed more)
    skip_overruled: int = 0  # this rank needed no more but another rank did: it replayed
    blocks_skipped: int = 0  # streamed blocks not run and not filled
    blocks_reused: int = 0  # a forward's first block taken from its slot again after one stopped after it
    fill_bytes_skipped: int = 0  # bytes of the skipped and reused blocks: fills never made
    experts: int = 1  # modules with a forward of their own sharing the ring (Wan2.2: 2)
    expert_forwards: list[int] = field(default_factory=list)  # forwards begun per expert (experts > 1)
    prefetch_redirects: int = 0  # prefetched fills dropped: another expert came than expected

    def as_dict(self) -> dict:
        return asdict(self)
