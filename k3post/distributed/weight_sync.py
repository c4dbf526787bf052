"""Weight sync: the trainer's weights into rollout engines, in buckets, all or nothing.

    trainer.named_weights() → buckets (≤ bucket_mb each) → transfer → receiver stages every bucket
    → validate names / shapes / dtypes / QAT scheme against the engine's model → copy all
    → drop the engine's derived weights (its cache of fused / fake-quantized copies) → version = v

Backends (one ``push(named_tensors, version) -> SyncStats`` each, the ``WeightSync`` protocol):

* ``InProcessSync``: engines in the trainer's process; a tensor that already is the engine's
  parameter (co-located, shared storage) is not copied, so a shared model costs a version bump.
* ``DiskSync``: safetensors shards + ``manifest.json`` (version, QAT scheme, sha256 per shard) in
  ``<root>/v<version>``, written into a temporary folder and renamed, so a reader sees a whole
  version or none. ``load_from_disk`` / ``receive_from_disk`` read it back, naming the bad file
  or key on error (SGLang's ``/update_weights_from_disk`` is the server-side counterpart).
* ``DistributedSync`` / ``DistributedReceiver``: ``torch.distributed`` broadcast in a process
  group of its own (rendezvous on ``init_method`` tcp://host:port; gloo on CPU, NCCL on CUDA;
  the trainer is rank 0), like SGLang's ``/update_weights_from_distributed``. Wire protocol of
  one sync: header (op, manifest length) → manifest JSON → vote 1 (each receiver checks the
  manifest against its engine) → every bucket's flat buffers → vote 2 (all staged) → apply →
  vote 3 (all applied). A receiver applies only after vote 2 succeeded on every rank, so a sync
  interrupted by a dead sender, a timeout or a rejected manifest leaves every engine on its old
  version and weights; the next complete sync repairs it. Memory: the trainer holds one flat
  bucket at a time, a receiver one staged copy of the weights until it applies.
* ``CudaIPCSync`` / ``receive_ipc``: co-located GPU engines in another process; the flat CUDA
  buffers travel as ``torch.multiprocessing.reductions.reduce_tensor`` handles (no copy through
  the host).

The QAT scheme travels with the weights (``Manifest.qat``). A receiver REFUSES a scheme that
differs from the one its engine runs (``EmbeddedEngine(qat=...)``) instead of applying it: the
engine's numerics are fixed when it is built, and a silent switch would make its tokens' behaviour
log-probs disagree with the trainer's forward.

Dtypes: a tensor must have the engine's dtype, or both must be floating point (the engine casts
on copy, e.g. fp32 master weights into a bf16 engine). Bit-exact equality holds for equal dtypes.

MB here is 2**20 bytes. Shape legend: N elements of a flat bucket buffer.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from k3post.io import fsync_path
from k3post.quant import qat as qat_module
from k3post.quant.qat import QATConfig

__all__ = [
    "MB",
    "TensorSpec",
    "BucketSpec",
    "Bucket",
    "Manifest",
    "SyncStats",
    "WeightSync",
    "WeightSyncError",
    "named_weights",
    "plan_buckets",
    "buckets",
    "flatten",
    "unflatten",
    "empty_bucket",
    "engine_qat",
    "module_qat",
    "check_weights",
    "apply_weights",
    "InProcessSync",
    "DiskSync",
    "load_from_disk",
    "receive_from_disk",
    "latest_on_disk",
    "DistributedSync",
    "DistributedReceiver",
    "CudaIPCSync",
    "receive_ipc",
]

log = logging.getLogger("k3post.weight_sync")

MB = 2**20
MANIFEST = "manifest.json"
FORMAT = "k3post.weights/1"

Named = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class WeightSyncError(RuntimeError):
    """A sync that did not complete (interrupted, timed out, rejected by a receiver). The
    engines that raise or report it are still on their previous version and weights."""


# --------------------------------------------------------------------------- buckets


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a bucket: its elements are ``buffers[dtype][offset : offset + numel]``."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch." ("float32", "bfloat16", ...)
    offset: int  # first element in its bucket's buffer of this dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _dtype(self.dtype).itemsize


@dataclass(frozen=True)
class BucketSpec:
    """What a bucket holds: its tensors in order and the length (elements) of each dtype's buffer,
    dtypes in order of first appearance."""

    tensors: tuple[TensorSpec, ...]
    sizes: tuple[tuple[str, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(n * _dtype(d).itemsize for d, n in self.sizes)


@dataclass
class Bucket:
    """A bucket's flat buffers, one contiguous 1-D tensor [N] per dtype (keys of ``spec.sizes``)."""

    spec: BucketSpec
    buffers: dict[str, torch.Tensor]


def _named_list(named_tensors: Named) -> list[tuple[str, torch.Tensor]]:
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    seen: set[str] = set()
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)):
            raise ValueError(f"named tensors: item {i} is not a (name, tensor) pair")
        if item[0] in seen:
            raise ValueError(f"named tensors: {item[0]!r} appears twice")
        seen.add(item[0])
    return items


def named_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a trainer syncs: every parameter once (a tied weight under its first name) and the
    persistent buffers, detached, in module order."""
    out = [(n, p.detach()) for n, p in model.named_parameters()]
    for mod_name, mod in model.named_modules():
        for n, b in mod._buffers.items():
            if b is not None and n not in mod._non_persistent_buffers_set:
                out.append((f"{mod_name}.{n}" if mod_name else n, b.detach()))
    return out


def plan_buckets(named_tensors: Named, bucket_mb: float) -> list[BucketSpec]:
    """Split (name, tensor) pairs into buckets of at most ``bucket_mb`` MB, keeping their order.

    Greedy: a tensor joins the open bucket while the bucket stays within the limit, else it opens
    the next one; a tensor larger than the limit is a bucket of its own. Offsets count elements in
    the bucket's buffer of the tensor's dtype."""
    if not (isinstance(bucket_mb, (int, float)) and not isinstance(bucket_mb, bool) and bucket_mb > 0):
        raise ValueError(f"bucket_mb must be a number > 0, got {bucket_mb!r}")
    limit = bucket_mb * MB
    groups: list[list[tuple[str, torch.Tensor]]] = []
    size = 0.0
    for name, t in _named_list(named_tensors):
        nbytes = t.numel() * t.element_size()
        if not groups or (groups[-1] and size + nbytes > limit):
            groups.append([])
            size = 0
        groups[-1].append((name, t))
        size += nbytes
    specs = []
    for group in groups:
        sizes: dict[str, int] = {}
        tensors = []
        for name, t in group:
            d = _dtype_name(t.dtype)
            tensors.append(TensorSpec(name, tuple(int(s) for s in t.shape), d, sizes.get(d, 0)))
            sizes[d] = sizes.get(d, 0) + t.numel()
        specs.append(BucketSpec(tuple(tensors), tuple(sizes.items())))
    return specs


def flatten(spec: BucketSpec, tensors: Mapping[str, torch.Tensor], device: torch.device | str | None = None) -> Bucket:
    """Copy the tensors ``spec`` names into one contiguous buffer per dtype (on ``device``, default:
    the first tensor's)."""
    first = tensors[spec.tensors[0].name]
    dev = torch.device(device) if device is not None else first.device
    buffers = {d: torch.empty(n, dtype=_dtype(d), device=dev) for d, n in spec.sizes}
    with torch.no_grad():
        for ts in spec.tensors:
            buffers[ts.dtype][ts.offset: ts.offset + ts.numel].copy_(tensors[ts.name].reshape(-1))
    return Bucket(spec, buffers)


def buckets(named_tensors: Named, bucket_mb: float) -> list[Bucket]:
    """``plan_buckets`` then ``flatten`` each bucket (all at once; the senders flatten one bucket
    at a time, so a sync holds one extra bucket of memory, not a copy of the model)."""
    items = _named_list(named_tensors)
    lookup = dict(items)
    return [flatten(spec, lookup) for spec in plan_buckets(items, bucket_mb)]


def unflatten(bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a bucket, as views into its buffers (no copy)."""
    return [(ts.name, bucket.buffers[ts.dtype][ts.offset: ts.offset + ts.numel].view(ts.shape)) for ts in bucket.spec.tensors]


def empty_bucket(spec: BucketSpec, device: torch.device | str = "cpu") -> Bucket:
    """Uninitialised buffers for ``spec``: what a receiver fills."""
    return Bucket(spec, {d: torch.empty(n, dtype=_dtype(d), device=device) for d, n in spec.sizes})


# --------------------------------------------------------------------------- manifest and stats


def _qat_json(cfg: QATConfig | None) -> dict[str, Any] | None:
    return None if cfg is None or not cfg.enabled else dataclasses.asdict(cfg)


@dataclass(frozen=True)
class Manifest:
    """What a sync carries besides the tensor bytes: the version, the QAT scheme the weights were
    trained under (None: no QAT), and every bucket's layout."""

    version: int
    qat: QATConfig | None
    buckets: tuple[BucketSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def tensors(self) -> list[TensorSpec]:
        return [t for b in self.buckets for t in b.tensors]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
            "qat": _qat_json(self.qat),
            "buckets": [
                {"sizes": [list(s) for s in b.sizes],
                 "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "offset": t.offset} for t in b.tensors]}
                for b in self.buckets
            ],
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "manifest") -> Manifest:
        """Parse and check a manifest; ValueError naming ``source`` and the bad key."""

        def need(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
            if not isinstance(obj, dict) or key not in obj:
                raise ValueError(f"{source}: missing key {where}{key!r}")
            value = obj[key]
            if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
                raise ValueError(f"{source}: key {where}{key!r} has a wrong type ({type(value).__name__})")
            return value

        if need(data, "format", str, "") != FORMAT:
            raise ValueError(f"{source}: format {data['format']!r} is not {FORMAT!r}")
        version = need(data, "version", int, "")
        qat_raw = data.get("qat")
        qat = None
        if qat_raw is not None:
            try:
                qat = QATConfig(**qat_raw)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{source}: key 'qat' is not a QATConfig: {e}") from None
        specs = []
        for i, b in enumerate(need(data, "buckets", list, "")):
            where = f"buckets[{i}]."
            try:
                sizes = tuple((str(d), int(n)) for d, n in need(b, "sizes", list, where))
                for d, _ in sizes:
                    _dtype(d)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{source}: key {where}'sizes' is malformed: {e}") from None
            tensors = []
            for j, t in enumerate(need(b, "tensors", list, where)):
                tw = f"{where}tensors[{j}]."
                name = need(t, "name", str, tw)
                shape = tuple(need(t, "shape", list, tw))
                if not all(isinstance(s, int) and s >= 0 for s in shape):
                    raise ValueError(f"{source}: key {tw}'shape' of {name!r} is not a list of sizes")
                dtype = need(t, "dtype", str, tw)
                if dtype not in dict(sizes):
                    raise ValueError(f"{source}: tensor {name!r} has dtype {dtype!r}, not one of the bucket's buffers")
                ts = TensorSpec(name, shape, dtype, need(t, "offset", int, tw))
                if ts.offset < 0 or ts.offset + ts.numel > dict(sizes)[dtype]:
                    raise ValueError(f"{source}: tensor {name!r} (key {tw}'offset') lies outside its {dtype} buffer")
                tensors.append(ts)
            specs.append(BucketSpec(tuple(tensors), sizes))
        names = [t.name for s in specs for t in s.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"{source}: a tensor name appears twice")
        return cls(version, qat, tuple(specs))


@dataclass
class SyncStats:
    """What one sync moved and how long it took (``seconds``: the whole sync, transfer and apply)."""

    backend: str
    version: int
    bytes: int
    buckets: int
    tensors: int
    seconds: float
    location: str | None = None  # DiskSync: the version folder

    @property
    def mb_per_s(self) -> float:
        return self.bytes / MB / self.seconds if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "mb_per_s": self.mb_per_s}


@runtime_checkable
class WeightSync(Protocol):
    """A sender: hands the trainer's weights to its engines as policy ``version``."""

    def push(self, named_tensors: Named, version: int) -> SyncStats:
        """Transfer and apply all tensors (all or nothing); returns the sync's stats."""
        ...

    def close(self) -> None:
        """Release what the backend holds (process group, handles)."""
        ...


# --------------------------------------------------------------------------- receiver side


def module_qat(model: nn.Module) -> QATConfig | None:
    """The QAT scheme a model runs (``apply_qat`` config), None without QAT."""
    cfgs = [getattr(m, qat_module._CFG_ATTR) for m in model.modules() if hasattr(m, qat_module._CFG_ATTR)]
    return cfgs[0] if cfgs and cfgs[0].enabled else None


def engine_qat(engine: Any) -> QATConfig | None:
    """The QAT scheme an engine's model runs (`module_qat` of ``engine.model``)."""
    return module_qat(engine.model)


def _engine_tensors(engine: Any) -> dict[str, torch.Tensor]:
    model = getattr(engine, "model", None)
    if not isinstance(model, nn.Module):
        raise ValueError(f"{type(engine).__name__} has no in-process model to load weights into")
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    return targets


def check_weights(engine: Any, specs: Iterable[tuple[str, Sequence[int], torch.dtype | str]], version: int,
                  *, qat: QATConfig | None) -> None:
    """Check a sync against an engine before anything is touched: every name is one of the model's
    parameters / buffers, shapes equal, dtypes equal (or both floating point), ``version`` exceeds
    the engine's, and ``qat`` is the scheme the engine runs. ValueError listing the problems."""
    targets = _engine_tensors(engine)
    problems = []
    for name, shape, dtype in specs:
        dt = _dtype(dtype) if isinstance(dtype, str) else dtype
        t = targets.get(name)
        if t is None:
            problems.append(f"{name}: not a parameter or buffer of the engine's model")
        elif tuple(shape) != tuple(t.shape):
            problems.append(f"{name}: shape {tuple(shape)}, the engine's model has {tuple(t.shape)}")
        elif dt != t.dtype and not (dt.is_floating_point and t.dtype.is_floating_point):
            problems.append(f"{name}: dtype {_dtype_name(dt)}, the engine's model has {_dtype_name(t.dtype)}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError("weights do not fit the engine: " + "; ".join(problems[:5]) + more)
    if not isinstance(version, int) or version <= engine.version:
        raise ValueError(f"version {version!r} must exceed the engine's current version {engine.version}")
    own, incoming = _qat_json(engine_qat(engine)), _qat_json(qat)
    if own != incoming:
        raise ValueError(f"QAT scheme mismatch: the weights were trained with {incoming}, the engine runs {own}; "
                         f"build the engine with the trainer's QATConfig (qat=...)")


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()


def apply_weights(engine: Any, named_tensors: Named, version: int, *, qat: QATConfig | None = None) -> int:
    """Load weights into an in-process engine, atomically: ``check_weights`` first (nothing is
    touched when it fails), then copy every tensor (one that already is the engine's tensor is
    skipped), drop the engine's derived weights (``flush_cache`` when the engine has one, else
    ``refresh_weights``) and set the engine's version to ``version``. Returns the version."""
    items = _named_list(named_tensors)
    check_weights(engine, ((n, t.shape, t.dtype) for n, t in items), version, qat=qat)
    targets = _engine_tensors(engine)
    copies = [(n, t) for n, t in items if not _shares_storage(t, targets[n])]
    new_version = int(engine.update_weights(copies, version=version))
    flush = getattr(engine, "flush_cache", None) or getattr(engine, "refresh_weights", None)
    if flush is not None:
        flush()
    return new_version


class InProcessSync:
    """Engines living in the trainer's process (today's co-located setup)."""

    def __init__(self, engines: Any | Sequence[Any], *, qat: QATConfig | None = None) -> None:
        self.engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
        if not self.engines:
            raise ValueError("InProcessSync needs at least one engine")
        self.qat = qat

    def push(self, named_tensors: Named, version: int) -> SyncStats:
        """Check every engine, then apply to each (all engines or none when a check fails)."""
        t0 = time.perf_counter()
        items = _named_list(named_tensors)
        for engine in self.engines:
            check_weights(engine, ((n, t.shape, t.dtype) for n, t in items), version, qat=self.qat)
        copied = 0
        for engine in self.engines:
            targets = _engine_tensors(engine)
            copied += sum(t.numel() * t.element_size() for n, t in items if not _shares_storage(t, targets[n]))
            apply_weights(engine, items, version, qat=self.qat)
        return SyncStats("in_process", version, copied, 0, len(items), time.perf_counter() - t0)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- disk


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _version_folders(root: Path) -> list[tuple[int, Path]]:
    out = []
    for p in root.glob("v*") if root.is_dir() else []:
        if p.name[1:].isdigit() and (p / MANIFEST).is_file():
            out.append((int(p.name[1:]), p))
    return sorted(out)


def latest_on_disk(root: str | Path) -> Path | None:
    """The newest complete version folder under ``root`` (None when there is none)."""
    found = _version_folders(Path(root))
    return found[-1][1] if found else None


class DiskSync:
    """Writes each version to ``<root>/v<version:08d>/``: ``shard-<i>.safetensors`` (one per bucket
    of ``shard_mb``) and ``manifest.json`` (``Manifest.to_json`` plus, per shard, its file name,
    size and sha256). Written into ``<root>/.tmp-*`` and renamed once complete; the newest
    ``keep`` versions are kept."""

    def __init__(self, root: str | Path, *, shard_mb: float = 512, qat: QATConfig | None = None, keep: int = 2) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        self.root = Path(root)
        self.shard_mb = shard_mb
        self.qat = qat
        self.keep = keep

    def push(self, named_tensors: Named, version: int) -> SyncStats:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        items = _named_list(named_tensors)
        lookup = dict(items)
        specs = plan_buckets(items, self.shard_mb)
        final = self.root / f"v{version:08d}"
        if final.exists():
            raise ValueError(f"{final} already exists: versions must increase")
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-v{version:08d}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            files = []
            for i, spec in enumerate(specs):
                path = tmp / f"shard-{i:05d}.safetensors"
                save_file({t.name: lookup[t.name].detach().to("cpu").contiguous() for t in spec.tensors}, str(path),
                          metadata={"format": FORMAT, "version": str(version)})
                fsync_path(path)
                files.append({"file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)})
            data = Manifest(version, self.qat, tuple(specs)).to_json()
            data["files"] = files
            (tmp / MANIFEST).write_text(json.dumps(data, indent=1), encoding="utf-8")
            fsync_path(tmp / MANIFEST)
            fsync_path(tmp)
            os.rename(tmp, final)
            fsync_path(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for _, old in _version_folders(self.root)[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        nbytes = sum(s.nbytes for s in specs)
        return SyncStats("disk", version, nbytes, len(specs), len(items), time.perf_counter() - t0, str(final))

    def close(self) -> None:
        pass


def load_from_disk(folder: str | Path) -> tuple[Manifest, list[tuple[str, torch.Tensor]]]:
    """Read a ``DiskSync`` version folder, checking the manifest, every shard's size and sha256, and
    that each shard holds exactly the manifest's tensors with their shapes and dtypes. ValueError
    naming the file (and the key) at fault."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    mpath = folder / MANIFEST
    if not mpath.is_file():
        raise ValueError(f"{mpath}: missing (not a complete weight version)")
    try:
        data = json.loads(mpath.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{mpath}: not valid JSON ({e})") from None
    manifest = Manifest.from_json(data, str(mpath))
    files = data.get("files")
    if not isinstance(files, list) or len(files) != len(manifest.buckets):
        raise ValueError(f"{mpath}: key 'files' must list one shard per bucket ({len(manifest.buckets)})")
    items: list[tuple[str, torch.Tensor]] = []
    for i, (entry, spec) in enumerate(zip(files, manifest.buckets)):
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), t) for k, t in (("file", str), ("bytes", int), ("sha256", str))):
            raise ValueError(f"{mpath}: key files[{i}] needs 'file', 'bytes' and 'sha256'")
        path = folder / entry["file"]
        if path.parent != folder:
            raise ValueError(f"{mpath}: key files[{i}].file {entry['file']!r} is not a file of the folder")
        if not path.is_file():
            raise ValueError(f"{path}: missing")
        if path.stat().st_size != entry["bytes"]:
            raise ValueError(f"{path}: {path.stat().st_size} bytes, the manifest says {entry['bytes']} (partially written?)")
        if _sha256(path) != entry["sha256"]:
            raise ValueError(f"{path}: sha256 differs from the manifest's (corrupted)")
        try:
            shard = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
        extra = sorted(set(shard) - {t.name for t in spec.tensors})
        if extra:
            raise ValueError(f"{path}: holds {extra[0]!r}, which the manifest does not list for this shard")
        for t in spec.tensors:
            got = shard.get(t.name)
            if got is None:
                raise ValueError(f"{path}: tensor {t.name!r} listed in the manifest is missing")
            if tuple(got.shape) != t.shape or _dtype_name(got.dtype) != t.dtype:
                raise ValueError(f"{path}: tensor {t.name!r} is {_dtype_name(got.dtype)}{list(got.shape)}, "
                                 f"the manifest says {t.dtype}{list(t.shape)}")
            items.append((t.name, got))
    return manifest, items


def receive_from_disk(engine: Any, folder: str | Path) -> SyncStats:
    """``load_from_disk`` then ``apply_weights`` (the engine is untouched when either fails)."""
    t0 = time.perf_counter()
    manifest, items = load_from_disk(folder)
    apply_weights(engine, items, manifest.version, qat=manifest.qat)
    return SyncStats("disk", manifest.version, manifest.nbytes, len(manifest.buckets), len(items),
                     time.perf_counter() - t0, str(folder))


# --------------------------------------------------------------------------- torch.distributed


_OP_SYNC, _OP_CLOSE = 1, 0


def _new_group(init_method: str, rank: int, world_size: int, device: torch.device, timeout_s: float) -> Any:
    """A process group of its own (not the default group, which a trainer may use for FSDP):
    rendezvous on ``init_method``, then gloo (CPU) or NCCL (CUDA)."""
    import torch.distributed as dist

    if not dist.is_available():
        raise ValueError("torch.distributed is not available in this torch build")
    if not init_method.startswith("tcp://"):
        raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
    store = dist.PrefixStore("k3post.weight_sync", store)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


class _Group:
    """The collectives one sync uses, over a group made by ``_new_group``."""

    def __init__(self, init_method: str, rank: int, world_size: int, device: torch.device, timeout_s: float) -> None:
        if not isinstance(world_size, int) or world_size < 2:
            raise ValueError(f"world_size must be an int >= 2 (the trainer and at least one engine), got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        self.rank, self.world_size, self.device = rank, world_size, device
        self.pg = _new_group(init_method, rank, world_size, device, timeout_s)

    def broadcast(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()

    def allgather_text(self, text: str) -> list[str]:
        """Every rank's ``text`` (UTF-8), in rank order."""
        data = torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        lens = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world_size)]
        self.pg.allgather([lens], [n]).wait()
        m = max(int(x) for x in lens)
        if m == 0:
            return [""] * self.world_size
        buf = torch.zeros(m, dtype=torch.uint8, device=self.device)
        buf[: data.numel()] = data.to(self.device)
        outs = [torch.empty(m, dtype=torch.uint8, device=self.device) for _ in range(self.world_size)]
        self.pg.allgather([outs], [buf]).wait()
        return [bytes(o[: int(k)].cpu().numpy()).decode("utf-8") for o, k in zip(outs, lens)]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat buffer as a uint8 view: every dtype travels bit for bit (gloo lacks some dtypes)."""
    return t.view(torch.uint8)


class DistributedSync:
    """The trainer's side (rank 0) of a broadcast sync to ``world_size - 1`` receiver ranks
    (``DistributedReceiver``, one per engine process). The constructor blocks until every receiver
    has joined the group. ``device`` cuda selects NCCL; cpu selects gloo."""

    def __init__(self, init_method: str, world_size: int, *, bucket_mb: float = 256, qat: QATConfig | None = None,
                 device: torch.device | str = "cpu", timeout_s: float = 300.0) -> None:
        plan_buckets([], bucket_mb)  # validates bucket_mb
        self.bucket_mb = bucket_mb
        self.qat = qat
        self.group = _Group(init_method, 0, world_size, torch.device(device), timeout_s)
        self._closed = False
        self._broken: str | None = None

    def _check_votes(self, votes: list[str], stage: str, version: int) -> None:
        bad = [f"rank {r}: {v}" for r, v in enumerate(votes) if v]
        if bad:
            raise WeightSyncError(f"sync to version {version} abandoned {stage}; every engine keeps its weights. " + " | ".join(bad))

    def _send_bucket(self, bucket: Bucket) -> None:
        for d, _ in bucket.spec.sizes:
            self.group.broadcast(_as_bytes(bucket.buffers[d]))

    def push(self, named_tensors: Named, version: int) -> SyncStats:
        """Send all buckets; returns once every receiver applied them (WeightSyncError otherwise)."""
        if self._closed:
            raise ValueError("DistributedSync is closed")
        if self._broken is not None:
            raise WeightSyncError(f"the process group broke earlier ({self._broken}); create a new DistributedSync")
        t0 = time.perf_counter()
        items = _named_list(named_tensors)
        lookup = dict(items)
        manifest = Manifest(version, self.qat, tuple(plan_buckets(items, self.bucket_mb)))
        payload = json.dumps(manifest.to_json()).encode("utf-8")
        g = self.group
        try:
            g.broadcast(torch.tensor([_OP_SYNC, len(payload)], dtype=torch.int64, device=g.device))
            g.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(g.device))
            self._check_votes(g.allgather_text(""), "(manifest rejected)", version)
            for spec in manifest.buckets:
                self._send_bucket(flatten(spec, lookup, g.device))
            self._check_votes(g.allgather_text(""), "(a receiver failed to stage)", version)
            self._check_votes(g.allgather_text(""), "(a receiver failed to apply; the others applied)", version)
        except RuntimeError as e:
            if isinstance(e, WeightSyncError):
                raise
            self._broken = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise WeightSyncError(f"sync to version {version} interrupted ({self._broken}); engines apply only once every "
                                  f"receiver staged every bucket; create a new DistributedSync") from e
        return SyncStats("distributed", version, manifest.nbytes, len(manifest.buckets), len(items), time.perf_counter() - t0)

    def close(self, notify: bool = True) -> None:
        """Tell the receivers no more syncs come (their ``receive`` returns None) and drop the group.
        ``notify=False``: drop it without telling them (servers whose group is destroyed over HTTP,
        ``/destroy_weights_update_group``, are not waiting in ``receive``)."""
        if not self._closed:
            self._closed = True
            if self._broken is not None or not notify:
                del self.group
                return
            try:
                self.group.broadcast(torch.tensor([_OP_CLOSE, 0], dtype=torch.int64, device=self.group.device))
            except RuntimeError as e:  # a receiver already gone: nothing left to tell it
                log.warning("DistributedSync.close: %s", str(e).splitlines()[0] if str(e) else type(e).__name__)
            finally:
                del self.group


class DistributedReceiver:
    """One engine's side (rank >= 1) of ``DistributedSync``. Call ``receive()`` once per sync (a
    server does it from its ``/update_weights_from_distributed`` handler, between engine steps).
    ``device``: where buckets are staged (default: the engine's device)."""

    def __init__(self, engine: Any, init_method: str, rank: int, world_size: int, *,
                 device: torch.device | str | None = None, timeout_s: float = 300.0) -> None:
        if rank == 0:
            raise ValueError("rank 0 is the trainer (DistributedSync); receivers are ranks 1..world_size-1")
        self.engine = engine
        dev = torch.device(device) if device is not None else torch.device(getattr(engine, "device", "cpu"))
        self.group = _Group(init_method, rank, world_size, dev, timeout_s)
        self._broken: str | None = None

    @property
    def broken(self) -> bool:
        """True after an interrupted sync: this group is unusable, join a new one."""
        return self._broken is not None

    def receive(self, check: Callable[[Manifest], None] | None = None) -> SyncStats | None:
        """Take part in one sync: returns its stats after the engine applied it, None when the
        sender closed the group. WeightSyncError when the sync was abandoned or interrupted; the
        engine then keeps its version and weights. After an interruption (sender gone, timeout)
        the group is unusable: build a new receiver for the next sync. ``check(manifest)``: a
        further test of the received manifest (e.g. against what a server was told to expect); its
        ValueError is this rank's vote against the manifest, so no engine applies the sync."""
        if self._broken is not None:
            raise WeightSyncError(f"the process group broke earlier ({self._broken}); join a new one")
        g = self.group
        old = self.engine.version
        try:
            t0 = time.perf_counter()
            header = torch.zeros(2, dtype=torch.int64, device=g.device)
            g.broadcast(header)
            op, length = (int(x) for x in header.tolist())
            if op == _OP_CLOSE:
                return None
            raw = torch.empty(length, dtype=torch.uint8, device=g.device)
            g.broadcast(raw)
            verdict = ""
            try:
                manifest = Manifest.from_json(json.loads(bytes(raw.cpu().numpy()).decode("utf-8")), "received manifest")
                check_weights(self.engine, ((t.name, t.shape, t.dtype) for t in manifest.tensors), manifest.version, qat=manifest.qat)
                if check is not None:
                    check(manifest)
            except ValueError as e:
                verdict = str(e)
            votes = g.allgather_text(verdict)
            if any(votes):
                bad = " | ".join(f"rank {r}: {v}" for r, v in enumerate(votes) if v)
                raise WeightSyncError(f"rank {g.rank}: sync abandoned (manifest rejected), engine stays on version {old}: {bad}")
            staged = []
            for spec in manifest.buckets:
                bucket = empty_bucket(spec, g.device)
                for d, _ in spec.sizes:
                    g.broadcast(_as_bytes(bucket.buffers[d]))
                staged.append(bucket)
            if any(g.allgather_text("")):
                raise WeightSyncError(f"rank {g.rank}: sync abandoned (a receiver failed to stage), engine stays on version {old}")
            verdict = ""
            try:
                apply_weights(self.engine, [x for b in staged for x in unflatten(b)], manifest.version, qat=manifest.qat)
            except Exception as e:  # reported to the trainer, then raised here
                verdict = f"{type(e).__name__}: {e}"
            g.allgather_text(verdict)
            if verdict:
                raise WeightSyncError(f"rank {g.rank}: applying version {manifest.version} failed: {verdict}")
        except RuntimeError as e:
            if isinstance(e, WeightSyncError):
                raise
            self._broken = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise WeightSyncError(f"rank {g.rank}: sync interrupted ({self._broken}); engine stays on version {old}") from e
        return SyncStats("distributed", manifest.version, manifest.nbytes, len(manifest.buckets), len(manifest.tensors),
                         time.perf_counter() - t0)

    def close(self) -> None:
        del self.group


# --------------------------------------------------------------------------- CUDA IPC


class CudaIPCSync:
    """Co-located GPU engines in other processes: each sync flattens the CUDA weights into buckets
    and calls ``send(payload)`` with the manifest and a ``reduce_tensor`` handle per flat buffer;
    ``send`` delivers the payload to the engine process (a pipe, a queue, an RPC), whose
    ``receive_ipc(engine, payload)`` applies it, and must return only once that is done (the
    buffers are freed after it returns). Memory: one flat copy of the weights during a sync."""

    def __init__(self, send: Callable[[dict[str, Any]], Any], *, bucket_mb: float = 512, qat: QATConfig | None = None) -> None:
        plan_buckets([], bucket_mb)
        self.send = send
        self.bucket_mb = bucket_mb
        self.qat = qat

    def push(self, named_tensors: Named, version: int) -> SyncStats:
        from torch.multiprocessing.reductions import reduce_tensor

        t0 = time.perf_counter()
        items = _named_list(named_tensors)
        not_cuda = [n for n, t in items if not t.is_cuda]
        if not_cuda:
            raise ValueError(f"CudaIPCSync needs CUDA tensors; {not_cuda[0]!r} is on {dict(items)[not_cuda[0]].device}")
        flat = buckets(items, self.bucket_mb)
        manifest = Manifest(version, self.qat, tuple(b.spec for b in flat))
        torch.cuda.synchronize()
        payload = {"manifest": manifest.to_json(), "handles": [{d: reduce_tensor(b.buffers[d]) for d, _ in b.spec.sizes} for b in flat]}
        self.send(payload)
        return SyncStats("cuda_ipc", version, manifest.nbytes, len(flat), len(items), time.perf_counter() - t0)

    def close(self) -> None:
        pass


def receive_ipc(engine: Any, payload: Mapping[str, Any]) -> SyncStats:
    """The engine process's side of ``CudaIPCSync``: open the handles, check, apply (all or nothing)."""
    t0 = time.perf_counter()
    manifest = Manifest.from_json(payload["manifest"], "CUDA IPC manifest")
    check_weights(engine, ((t.name, t.shape, t.dtype) for t in manifest.tensors), manifest.version, qat=manifest.qat)
    handles = payload["handles"]
    if len(handles) != len(manifest.buckets):
        raise ValueError(f"CUDA IPC payload: {len(handles)} handle sets for {len(manifest.buckets)} buckets")
    staged = [Bucket(spec, {d: fn(*args) for d, (fn, args) in h.items()}) for spec, h in zip(manifest.buckets, handles)]
    apply_weights(engine, [x for b in staged for x in unflatten(b)], manifest.version, qat=manifest.qat)
    torch.cuda.synchronize()
    return SyncStats("cuda_ipc", manifest.version, manifest.nbytes, len(staged), len(manifest.tensors), time.perf_counter() - t0)
