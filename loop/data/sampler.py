"""The resumable data order and the DataLoader built on it.

The order of training samples is a pure function of (seed, epoch, index): global sample g is
`order(seed, g // n)[g % n]`. Position is g, counted in samples consumed by *optimizer steps*
(the trainer's counter), not what the DataLoader prefetched; starting a fresh stream at g gives
exactly the samples the uninterrupted run saw from there on, for any `num_workers`, and each is
fetched with its random draws seeded from g (loop/data/seeded.py).
"""
from __future__ import annotations

import hashlib
import itertools

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from loop.data.bundle import IGNORE_INDEX, unstackable
from loop.data.seeded import SeededSamples
from loop.errors import BadInput


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    mixed = hashlib.sha256(f"{seed}/{epoch}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(mixed[:8], "little") >> 1)
    return torch.randperm(n, generator=g)  # (n,)


class StreamSampler(Sampler[tuple[int, int]]):
    """Endless `(position, dataset index)` pairs from global sample `start` on, epoch after epoch,
    the position counting global samples (what loop/data/seeded.py seeds from). With several
    processes, each global micro-batch of `batch * world` samples is cut in `world` slices and
    rank r takes slice r, so the samples of a step do not depend on how many processes share it."""

    def __init__(self, n: int, seed: int, start: int = 0, batch: int = 1, rank: int = 0, world: int = 1):
        self.n, self.seed, self.start = n, seed, start
        self.batch, self.rank, self.world = batch, rank, world

    def _indices(self):
        epoch, i = divmod(self.start, self.n)
        while True:
            # Handed out a slice at a time: one list of an epoch's ids took 46 bytes a sample
            # (4.6 GB and 15 s for 100M token windows, per process); its tensor takes 8.
            for ids in epoch_order(self.n, self.seed, epoch)[i:].split(1 << 16):
                yield from ids.tolist()
            epoch, i = epoch + 1, 0

    def __iter__(self):
        stream = enumerate(self._indices(), self.start)
        if self.world == 1:
            yield from stream  # endless: never falls through
        lo = self.rank * self.batch
        while True:
            yield from list(itertools.islice(stream, self.batch * self.world))[lo : lo + self.batch]


def collate(samples: list[dict]) -> dict:
    """Stack samples; count the real targets here, on the CPU, so the loop needs no device sync."""
    keys = samples[0].keys()
    if any(s.keys() != keys for s in samples):  # default_collate takes the first's keys: a key only
        raise ValueError(f"data: {unstackable(samples)}.")  # in later samples would be dropped unsaid
    try:
        batch = default_collate(samples)
    except RuntimeError:
        if why := unstackable(samples):  # torch's message names neither the samples nor the shape
            raise ValueError(f"data: {why}.") from None
        raise
    batch["n_targets"] = int((batch["y"] != IGNORE_INDEX).sum())
    return batch


def split_batch(batch: dict, parts: int) -> list[dict]:
    """Cut a batch into `parts` smaller ones along dim 0 (OOM recovery), recounting targets."""
    if parts == 1:
        return [batch]
    keys = [k for k, v in batch.items() if torch.is_tensor(v)]
    chunks = zip(*(torch.tensor_split(batch[k], parts) for k in keys))
    out = [dict(zip(keys, c)) for c in chunks]
    for b in out:
        b["n_targets"] = int((b["y"] != IGNORE_INDEX).sum())
    return [b for b in out if len(b["idx"])]


def holding_targets(batch: dict) -> dict:
    """The batch's samples that hold a real target, its tensors cut alike (others, as split_batch
    does, left out); the batch itself where every sample holds one."""
    held = (batch["y"] != IGNORE_INDEX).reshape(len(batch["y"]), -1).any(1)
    if held.all():
        return batch
    return {**{k: v[held] for k, v in batch.items() if torch.is_tensor(v)}, "n_targets": batch["n_targets"]}


def target_halves(batch: dict) -> list[dict] | None:
    """`batch` twice, each with one half of its real targets, the other half set to -100 (not
    counted); None where they cannot be halved (one target, or float targets, which a model need
    not mask)."""
    y = batch["y"]
    real = (y != IGNORE_INDEX).flatten().nonzero().flatten()
    if y.is_floating_point() or len(real) < 2:
        return None
    out = []
    for keep in (real[: len(real) // 2], real[len(real) // 2 :]):
        half = torch.full_like(y, IGNORE_INDEX).flatten()
        half[keep] = y.flatten()[keep]
        out.append({**batch, "y": half.view_as(y), "n_targets": len(keep)})
    return out


def to_device(batch: dict, device: torch.device, non_blocking: bool = False) -> dict:
    """The batch's tensors on `device`; its other values (a list of texts, say) as they are."""
    return {k: v.to(device, non_blocking=non_blocking) if torch.is_tensor(v) else v for k, v in batch.items()}


def train_loader(ds: Dataset, batch_size: int, seed: int, start: int, num_workers: int,
                 prefetch_factor: int, pin_memory: bool, worker_init_fn=None, rank: int = 0,
                 world: int = 1) -> DataLoader:
    sampler = StreamSampler(len(ds), seed, start, batch_size, rank, world)
    return DataLoader(
        SeededSamples(ds, seed), batch_size=batch_size, sampler=sampler, collate_fn=collate,
        num_workers=num_workers, pin_memory=pin_memory, persistent_workers=num_workers > 0,
        prefetch_factor=prefetch_factor if num_workers > 0 else None, worker_init_fn=worker_init_fn,
        # Without its own generator the DataLoader draws a worker seed from the global torch RNG
        # each time an iterator starts, and a resumed run would see different dropout masks.
        generator=torch.Generator().manual_seed(seed),
    )


def close_loader(batches) -> None:
    """Stop a train_loader iterator's worker processes now. Dropping the last reference does it
    too, but an error raised through the iterator (a Dataset that fails in a worker) keeps it
    referenced by the traceback until the interpreter exits, and there multiprocessing's
    terminate cannot stop workers that ignore SIGTERM (loop.guards.preemption.worker_ignores_stop_signals):
    the process would hang instead of exiting. torch's own exit-time cleanup covers pinned-memory
    loaders only. `_shutdown_workers` is what the iterator's `__del__` calls; it runs once."""
    shutdown = getattr(batches, "_shutdown_workers", None)  # none without workers
    if shutdown:
        shutdown()


def val_batches(ds: Dataset, batch_size: int, n_batches: int, seed: int | None, rank: int = 0,
                world: int = 1) -> list[dict]:
    """A fixed validation set drawn by its own generator: the same batches at every evaluation, and
    the same set whatever the process count when the split holds `n_batches` global batches (rank r
    evaluates the r-th of `world` equal parts). Every rank gets as many samples, so as many batches:
    under FSDP each forward is a collective, and a rank with one batch more would wait forever.
    seed=None draws from the global torch RNG, which training also draws from: only the lab
    switch eval_consumes_train_rng does that, to show why it must not be done."""
    g = None if seed is None else torch.Generator().manual_seed(seed + 1)
    share = min(batch_size * world * n_batches, len(ds)) // world  # samples per rank
    if share == 0:  # every rank sees it, so none waits in a collective for the others
        raise BadInput(f"data: the validation split holds {len(ds)} samples; expected at least one per "
                       f"process ({world}).")
    idx = torch.randperm(len(ds), generator=g)[: share * world].tolist()
    mine = idx[rank * share : (rank + 1) * share]
    chunks = [mine[k : k + batch_size] for k in range(0, share, batch_size)]
    if seed is None:
        return [collate([ds[i] for i in chunk]) for chunk in chunks]
    # A split that augments draws from streams seeded by each sample's index (as the text sample's
    # prompt does): the set is the same at any train.eval_batches and process count, and drawing it
    # leaves the training streams (dropout) as they were.
    seeded = SeededSamples(ds, seed)
    return [collate(seeded.__getitems__([(i, i) for i in chunk])) for chunk in chunks]
