"""Weight sync (k3post.distributed.weight_sync): buckets, the receiver's all-or-nothing apply, the
disk backend and its corrupt folders, the gloo broadcast to two engine processes with an interrupted
sync in between, and CUDA IPC (gpu)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from k3post.distributed.weight_sync import (
    MB,
    BucketSpec,
    CudaIPCSync,
    DiskSync,
    DistributedReceiver,
    DistributedSync,
    InProcessSync,
    Manifest,
    TensorSpec,
    WeightSyncError,
    apply_weights,
    buckets,
    empty_bucket,
    engine_qat,
    latest_on_disk,
    load_from_disk,
    named_weights,
    plan_buckets,
    receive_from_disk,
    receive_ipc,
    unflatten,
)
from k3post.quant.qat import QATConfig
from k3post.rollout.embedded import EmbeddedEngine

sys.path.insert(0, str(Path(__file__).parent))
from weight_sync_peer import CRASH_CODE, digest, greedy, trainer_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _engine(seed: int = 0, qat: QATConfig | None = QATConfig()) -> EmbeddedEngine:
    if qat is None:
        from k3post.models import build_tiny_moe

        return EmbeddedEngine(build_tiny_moe(256, seed=seed), max_batch_size=2, max_model_len=64)
    return EmbeddedEngine(trainer_model(seed), qat=qat, max_batch_size=2, max_model_len=64)


# --------------------------------------------------------------------------- buckets


def test_plan_buckets_golden():
    # limit 1024 bytes. a, b: 100 fp32 = 400 B each; c: 64 bf16 = 128 B -> a+b+c = 928 B fit one bucket;
    # d: 300 fp32 = 1200 B > 1024 goes alone; e: 10 int64 = 80 B opens the next; f: 240 fp32 = 960 B
    # would make e+f = 1040 B > 1024 -> a bucket of its own.
    named = [("a", torch.zeros(100)), ("b", torch.zeros(10, 10)), ("c", torch.zeros(64, dtype=torch.bfloat16)),
             ("d", torch.zeros(300)), ("e", torch.zeros(10, dtype=torch.int64)), ("f", torch.zeros(240))]
    specs = plan_buckets(named, 1024 / MB)
    assert specs == [
        BucketSpec((TensorSpec("a", (100,), "float32", 0), TensorSpec("b", (10, 10), "float32", 100),
                    TensorSpec("c", (64,), "bfloat16", 0)), (("float32", 200), ("bfloat16", 64))),
        BucketSpec((TensorSpec("d", (300,), "float32", 0),), (("float32", 300),)),
        BucketSpec((TensorSpec("e", (10,), "int64", 0),), (("int64", 10),)),
        BucketSpec((TensorSpec("f", (240,), "float32", 0),), (("float32", 240),)),
    ]
    assert [s.nbytes for s in specs] == [928, 1200, 80, 960]
    # an oversize tensor first, then small ones: the small ones share the next bucket
    specs = plan_buckets([("big", torch.zeros(1000)), ("x", torch.zeros(8)), ("y", torch.zeros(8))], 1024 / MB)
    assert [[t.name for t in s.tensors] for s in specs] == [["big"], ["x", "y"]]
    # everything fits: one bucket, order kept
    assert [[t.name for t in s.tensors] for s in plan_buckets(named, 1)] == [["a", "b", "c", "d", "e", "f"]]


def test_flatten_unflatten_bit_exact():
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, -3.5])  # nan, infs, -0, subnormal
    named = [
        ("w", torch.randn(6, 4, generator=g).t()),  # non-contiguous
        ("special32", special),
        ("bf", torch.randn(33, generator=g).to(torch.bfloat16)),
        ("special_bf", special.to(torch.bfloat16)),
        ("half", torch.randn(2, 3, generator=g).half()),
        ("i", torch.arange(-5, 5)),
        ("mask", torch.tensor([True, False, True])),
        ("empty", torch.zeros(0, 3)),
    ]
    for mb in (1, 64 / MB):
        got = [x for b in buckets(named, mb) for x in unflatten(b)]
        assert [n for n, _ in got] == [n for n, _ in named]
        for (_, t), (_, u) in zip(named, got):
            assert u.dtype == t.dtype and u.shape == t.shape
            assert torch.equal(_bits(u), _bits(t))
    # one contiguous buffer per dtype, in order of first appearance
    [b] = buckets(named, 1)
    assert list(b.buffers) == ["float32", "bfloat16", "float16", "int64", "bool"]
    assert all(buf.is_contiguous() and buf.dim() == 1 for buf in b.buffers.values())
    assert b.buffers["float32"].numel() == 24 + 6 + 0
    # a receiver's empty buckets have the same layout
    assert {d: (x.numel(), x.dtype) for d, x in empty_bucket(b.spec).buffers.items()} == {
        d: (x.numel(), x.dtype) for d, x in b.buffers.items()}


def test_bucket_input_rejected():
    with pytest.raises(ValueError, match="bucket_mb"):
        plan_buckets([("a", torch.zeros(1))], 0)
    with pytest.raises(ValueError, match="appears twice"):
        plan_buckets([("a", torch.zeros(1)), ("a", torch.zeros(2))], 1)
    with pytest.raises(ValueError, match="not a \\(name, tensor\\) pair"):
        plan_buckets([("a", [1.0])], 1)  # type: ignore[list-item]


def test_manifest_json_round_trip_and_errors():
    specs = plan_buckets([("a", torch.zeros(3)), ("b", torch.zeros(2, dtype=torch.bfloat16))], 1)
    m = Manifest(7, QATConfig(), tuple(specs))
    assert Manifest.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert Manifest.from_json(Manifest(1, None, ()).to_json()).qat is None
    assert Manifest(1, QATConfig(enabled=False), ()).to_json()["qat"] is None
    bad = m.to_json()
    del bad["buckets"][0]["tensors"][1]["shape"]
    with pytest.raises(ValueError, match=r"src: missing key buckets\[0\]\.tensors\[1\]\.'shape'"):
        Manifest.from_json(bad, "src")
    bad = m.to_json()
    bad["buckets"][0]["tensors"][0]["offset"] = 2  # 2 + 3 elements > the 3-element float32 buffer
    with pytest.raises(ValueError, match="'a'.*outside its float32 buffer"):
        Manifest.from_json(bad)
    bad = m.to_json()
    bad["qat"]["block_size"] = 0
    with pytest.raises(ValueError, match="'qat' is not a QATConfig"):
        Manifest.from_json(bad)


# --------------------------------------------------------------------------- receiver side


def _state(engine: EmbeddedEngine) -> tuple[int, str]:
    return engine.version, digest(engine.model)


def test_apply_weights_all_or_nothing():
    engine = _engine(0)
    before = _state(engine)
    w1 = named_weights(trainer_model(1))
    for bad, match in [
        (w1[:-1] + [("model.nope.weight", torch.zeros(3))], "model.nope.weight: not a parameter"),
        (w1[:-1] + [(w1[-1][0], torch.zeros(5))], f"{w1[-1][0]}: shape \\(5,\\)"),
        (w1[:-1] + [(w1[-1][0], torch.zeros(w1[-1][1].shape, dtype=torch.int32))], "dtype int32"),
    ]:
        with pytest.raises(ValueError, match=match):
            apply_weights(engine, bad, 1, qat=QATConfig())
        assert _state(engine) == before  # the tensors before the bad one were not copied either
    with pytest.raises(ValueError, match="must exceed the engine's current version 0"):
        apply_weights(engine, w1, 0, qat=QATConfig())
    with pytest.raises(ValueError, match="QAT scheme mismatch"):
        apply_weights(engine, w1, 1, qat=None)
    with pytest.raises(ValueError, match="QAT scheme mismatch"):
        apply_weights(engine, w1, 1, qat=QATConfig(weight_format="fp8_e4m3"))
    assert _state(engine) == before
    assert apply_weights(engine, w1, 3, qat=QATConfig()) == 3
    assert _state(engine) == (3, digest(trainer_model(1)))
    assert engine_qat(engine) == QATConfig()
    # the engine's forward uses the new weights (its derived-weights cache was dropped): same tokens and
    # log-probs as an engine built on the trainer's model
    assert greedy(engine)["logprobs"] == greedy(_engine(1))["logprobs"]


def test_in_process_sync_copies_or_shares():
    trainer = trainer_model(1)
    engines = [_engine(0), _engine(0)]
    stats = InProcessSync(engines, qat=QATConfig()).push(named_weights(trainer), 1)
    assert all(_state(e) == (1, digest(trainer)) for e in engines)
    nbytes = sum(t.numel() * t.element_size() for _, t in named_weights(trainer))
    assert (stats.bytes, stats.tensors, stats.version) == (2 * nbytes, len(named_weights(trainer)), 1)
    # co-located: the engine runs the trainer's own model, nothing is copied, the version advances
    shared = EmbeddedEngine(trainer, qat=QATConfig(), max_batch_size=2, max_model_len=64)
    stats = InProcessSync(shared, qat=QATConfig()).push(named_weights(trainer), 1)
    assert (stats.bytes, shared.version) == (0, 1)
    # one engine rejects: no engine changes
    other = _engine(0, qat=None)
    with pytest.raises(ValueError, match="QAT scheme mismatch"):
        InProcessSync([engines[0], other], qat=QATConfig()).push(named_weights(trainer_model(2)), 2)
    assert _state(engines[0]) == (1, digest(trainer)) and other.version == 0


# --------------------------------------------------------------------------- disk


def test_disk_round_trip(tmp_path):
    trainer = trainer_model(1)
    sync = DiskSync(tmp_path / "w", shard_mb=1, qat=QATConfig(), keep=2)
    stats = sync.push(named_weights(trainer), 1)
    folder = Path(stats.location or "")
    assert folder == tmp_path / "w" / "v00000001" and latest_on_disk(tmp_path / "w") == folder
    nbytes = sum(t.numel() * t.element_size() for _, t in named_weights(trainer))
    assert stats.bytes == nbytes and stats.buckets == len(list(folder.glob("shard-*.safetensors"))) > 1
    assert not [p for p in (tmp_path / "w").iterdir() if p.name.startswith(".tmp")]
    manifest, items = load_from_disk(folder)
    assert manifest.version == 1 and manifest.qat == QATConfig()
    for (n, t), (m, u) in zip(named_weights(trainer), items):
        assert n == m and torch.equal(_bits(t), _bits(u))
    engine = _engine(0)
    receive_from_disk(engine, folder)
    assert _state(engine) == (1, digest(trainer))
    # bf16 weights round trip bit for bit
    bf = [(n, t.to(torch.bfloat16)) for n, t in named_weights(trainer)]
    folder2 = Path(sync.push(bf, 2).location or "")
    assert all(torch.equal(_bits(t), _bits(u)) for (_, t), (_, u) in zip(bf, load_from_disk(folder2)[1]))
    # versions only increase; the newest `keep` are kept
    with pytest.raises(ValueError, match="already exists"):
        sync.push(bf, 2)
    sync.push(bf, 3)
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v00000002", "v00000003"]


def _corrupt_flip(folder: Path) -> str:
    shard = folder / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x40
    shard.write_bytes(bytes(data))
    return "shard-00001.safetensors: sha256 differs"


def _corrupt_truncate(folder: Path) -> str:
    shard = folder / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    return "shard-00000.safetensors: .* bytes, the manifest says"


def _corrupt_missing_shard(folder: Path) -> str:
    (folder / "shard-00002.safetensors").unlink()
    return "shard-00002.safetensors: missing"


def _corrupt_no_manifest(folder: Path) -> str:
    (folder / "manifest.json").unlink()
    return "manifest.json: missing"


def _corrupt_manifest_json(folder: Path) -> str:
    p = folder / "manifest.json"
    p.write_text(p.read_text()[:-20])
    return "manifest.json: not valid JSON"


def _corrupt_manifest_key(folder: Path) -> str:
    p = folder / "manifest.json"
    data = json.loads(p.read_text())
    del data["version"]
    p.write_text(json.dumps(data))
    return "manifest.json: missing key 'version'"


def _corrupt_renamed_key(folder: Path) -> str:
    # a shard that is intact (its sha256 recorded) but holds another tensor than the manifest says
    from safetensors.torch import load_file, save_file

    from k3post.distributed.weight_sync import _sha256

    shard = folder / "shard-00000.safetensors"
    tensors = load_file(str(shard))
    first = next(iter(tensors))
    tensors["model.renamed"] = tensors.pop(first)
    save_file(tensors, str(shard))
    p = folder / "manifest.json"
    data = json.loads(p.read_text())
    data["files"][0].update(bytes=shard.stat().st_size, sha256=_sha256(shard))
    p.write_text(json.dumps(data))
    return "shard-00000.safetensors: holds 'model.renamed'"


@pytest.mark.parametrize("corrupt", [_corrupt_flip, _corrupt_truncate, _corrupt_missing_shard, _corrupt_no_manifest,
                                     _corrupt_manifest_json, _corrupt_manifest_key, _corrupt_renamed_key])
def test_disk_corrupt_folder_rejected(tmp_path, corrupt):
    folder = Path(DiskSync(tmp_path, shard_mb=1, qat=QATConfig()).push(named_weights(trainer_model(1)), 1).location or "")
    match = corrupt(folder)
    engine = _engine(0)
    before = _state(engine)
    with pytest.raises(ValueError, match=match):
        receive_from_disk(engine, folder)
    assert _state(engine) == before


def test_disk_half_written_version_invisible(tmp_path):
    # a writer that died before the rename leaves only a .tmp folder: readers see the previous version
    sync = DiskSync(tmp_path, shard_mb=1, qat=QATConfig())
    done = Path(sync.push(named_weights(trainer_model(1)), 1).location or "")
    (tmp_path / ".tmp-v00000002-123-abcd").mkdir()
    (tmp_path / ".tmp-v00000002-123-abcd" / "shard-00000.safetensors").write_bytes(b"partial")
    assert latest_on_disk(tmp_path) == done


# --------------------------------------------------------------------------- torch.distributed (gloo), two engine processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _receive_in_thread(engine: EmbeddedEngine, init: str, timeout_s: float, rank: int = 1,
                       world: int = 2) -> tuple[threading.Thread, dict]:
    """A receiver rank in a thread of this process: takes syncs until the trainer closes the group
    (last stats in got["stats"]) or one fails (got["error"], got["broken"])."""
    got: dict = {}

    def run() -> None:
        receiver = DistributedReceiver(engine, init, rank, world, timeout_s=timeout_s)
        try:
            while (stats := receiver.receive()) is not None:
                got["stats"] = stats
        except WeightSyncError as e:
            got["error"], got["broken"] = str(e), receiver.broken

    thread = threading.Thread(target=run)
    thread.start()
    return thread, got


def test_distributed_sync_timeout_leaves_engine_unchanged():
    """A trainer that stalls after its first bucket: the receiver gives up after its timeout with the
    engine untouched, the trainer's push fails, and a sync over a new group repairs the engine."""
    engine = _engine(0)
    before = _state(engine)
    trainer = trainer_model(1)
    init = f"tcp://127.0.0.1:{_free_port()}"
    thread, got = _receive_in_thread(engine, init, timeout_s=2)
    sync = DistributedSync(init, 2, bucket_mb=1, qat=QATConfig(), timeout_s=2)
    send, sent = sync._send_bucket, []

    def stall_after_first(bucket):
        if sent:
            thread.join(timeout=60)  # stalled until the receiver gave up
        send(bucket)
        sent.append(bucket)

    sync._send_bucket = stall_after_first
    with pytest.raises(WeightSyncError, match="sync to version 1 interrupted"):
        sync.push(named_weights(trainer), 1)
    thread.join(timeout=60)
    assert "interrupted" in got["error"] and got["broken"]
    assert _state(engine) == before
    with pytest.raises(WeightSyncError, match="broke earlier"):
        sync.push(named_weights(trainer), 1)
    sync.close()
    init = f"tcp://127.0.0.1:{_free_port()}"
    thread, got = _receive_in_thread(engine, init, timeout_s=30)
    sync = DistributedSync(init, 2, bucket_mb=1, qat=QATConfig(), timeout_s=30)
    assert sync.push(named_weights(trainer), 1).version == 1
    sync.close()
    thread.join(timeout=60)
    assert got["stats"].version == 1 and _state(engine) == (1, digest(trainer))


def test_distributed_sync_one_engine_rejects_none_applies():
    """Two engines, one built without QAT: it rejects the manifest, so the other does not apply either
    (no engine moves to a version the other lacks); the trainer's error names the rejecting rank."""
    good, odd = _engine(0), _engine(0, qat=None)
    before = [_state(good), _state(odd)]
    init = f"tcp://127.0.0.1:{_free_port()}"
    threads = [_receive_in_thread(e, init, 30, rank=r, world=3) for r, e in ((1, good), (2, odd))]
    sync = DistributedSync(init, 3, bucket_mb=1, qat=QATConfig(), timeout_s=30)
    with pytest.raises(WeightSyncError, match=r"manifest rejected.*rank 2: QAT scheme mismatch") as err:
        sync.push(named_weights(trainer_model(1)), 1)
    assert "rank 1" not in str(err.value)
    sync.close()  # the group is still usable: the receivers hear the close
    for thread, got in threads:
        thread.join(timeout=60)
        assert "manifest rejected" in got["error"] and not got["broken"]
    assert [_state(good), _state(odd)] == before


def test_apply_weights_casts_float_dtypes():
    """fp32 master weights into a bf16 engine: cast on copy (round to nearest even, as ``Tensor.to``)."""
    engine = EmbeddedEngine(trainer_model(0).to(torch.bfloat16), qat=QATConfig(), max_batch_size=2, max_model_len=64)
    w1 = named_weights(trainer_model(1))
    apply_weights(engine, w1, 1, qat=QATConfig())
    got = dict(engine.model.named_parameters())
    assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in w1)


def test_distributed_sync_two_engines_gloo(tmp_path):
    """Trainer (this process, rank 0) → two engine processes (ranks 1, 2), QAT on, 1 MB buckets.
    Session 0: sync v1 (weights of seed 1), then a sync whose manifest has a wrong shape (rejected by
    both engines). Session 1: a trainer process that dies after the first bucket of v2. Session 2: a
    full sync of v2 (seed 2) repairs it. Each engine ends with exactly the trainer's weights."""
    inits = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(3)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    peer = str(Path(__file__).parent / "weight_sync_peer.py")
    outs = [tmp_path / f"engine{r}.json" for r in (1, 2)]
    receivers = [subprocess.Popen([sys.executable, peer, "receive", "--sessions", ",".join(inits), "--rank", str(r),
                                   "--world", "3", "--out", str(out), "--timeout", "60"], env=env)
                 for r, out in zip((1, 2), outs)]
    # started now so that its imports overlap the receivers'; it waits in the rendezvous of session 1
    crash = subprocess.Popen([sys.executable, peer, "crash-send", "--sessions", inits[1], "--world", "3", "--seed", "2",
                              "--version", "2", "--timeout", "60"], env=env)
    try:
        w1, w2 = named_weights(trainer_model(1)), named_weights(trainer_model(2))
        sync = DistributedSync(inits[0], 3, bucket_mb=1, qat=QATConfig(), timeout_s=60)
        t0 = time.perf_counter()
        stats = sync.push(w1, 1)
        nbytes = sum(t.numel() * t.element_size() for _, t in w1)
        assert (stats.version, stats.bytes, stats.tensors) == (1, nbytes, len(w1)) and stats.buckets >= 4
        wrong = [(n, t[: t.shape[0] // 2] if n == "model.norm.weight" else t) for n, t in w2]
        with pytest.raises(WeightSyncError, match=r"rank 1: .*model.norm.weight: shape \(64,\).* \| rank 2: "):
            sync.push(wrong, 2)
        sync.close()
        assert crash.wait(timeout=120) == CRASH_CODE
        sync = DistributedSync(inits[2], 3, bucket_mb=1, qat=QATConfig(), timeout_s=60)
        assert sync.push(w2, 2).version == 2
        sync.close()
        print(f"gloo sync: {stats.mb_per_s:.0f} MB/s for {nbytes / MB:.1f} MB (first sync, {time.perf_counter() - t0:.1f} s all)")
        assert [p.wait(timeout=120) for p in receivers] == [0, 0]
    finally:
        for p in [*receivers, crash]:
            if p.poll() is None:
                p.kill()
    d0, d1, d2 = (digest(trainer_model(s)) for s in (0, 1, 2))
    expected_greedy = greedy(EmbeddedEngine(trainer_model(2), qat=QATConfig(), max_batch_size=2, max_model_len=64))
    for out in outs:
        res = json.loads(out.read_text())
        ev = res["events"]
        assert [(e["session"], e["ok"], e["version"], e["digest"]) for e in ev] == [
            (-1, True, 0, d0),
            (0, True, 1, d1),  # v1 applied: exactly the trainer's weights
            (0, False, 1, d1),  # wrong shape: rejected before any bucket, still v1
            (1, False, 1, d1),  # sender died after the first bucket: still v1, nothing half-applied
            (2, True, 2, d2),  # the next full sync repairs it
        ]
        assert "model.norm.weight: shape (64,)" in ev[2]["error"]
        assert "interrupted" in ev[3]["error"]
        # the engine runs the new weights with the trainer's MX fake-quant: the same tokens and log-probs,
        # stamped with the new version, as an engine built on the trainer's model
        assert res["greedy"]["ids"] == expected_greedy["ids"]
        assert res["greedy"]["logprobs"] == expected_greedy["logprobs"]
        assert set(res["greedy"]["versions"]) == {2}


# --------------------------------------------------------------------------- CUDA IPC


def _ipc_engine_process(conn) -> None:  # runs in a spawned process: the co-located engine
    torch.set_num_threads(1)
    engine = EmbeddedEngine(trainer_model(0).cuda(), qat=QATConfig(), max_batch_size=2, max_model_len=64)
    while (msg := conn.recv()) is not None:
        conn.send(receive_ipc(engine, msg).version)
    conn.send((engine.version, digest(engine.model.to("cpu"))))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_sync_to_engine_process():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_engine_process, args=(child,))
    proc.start()

    def send(payload):
        parent.send(payload)
        return parent.recv()

    trainer = trainer_model(1).cuda()
    stats = CudaIPCSync(send, bucket_mb=1, qat=QATConfig()).push(named_weights(trainer), 1)
    assert stats.version == 1 and stats.buckets >= 4
    parent.send(None)
    assert parent.recv() == (1, digest(trainer.cpu()))
    proc.join(timeout=60)
