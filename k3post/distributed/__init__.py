"""Systems pieces between the trainer and the rollout engines: weight sync backends (`weight_sync`), the Ray
cluster and its actors (`ray_cluster`), environment workers (`env_workers`).

The weight-sync names are re-exported here lazily (PEP 562): importing a submodule, as every Ray actor of the
package does when Ray unpickles its class, does not import torch through this file. An environment worker
runs no torch at all (`k3post.distributed.env_workers`)."""

from typing import Any

__all__ = [
    "MB",
    "Bucket",
    "BucketSpec",
    "CudaIPCSync",
    "DiskSync",
    "DistributedReceiver",
    "DistributedSync",
    "InProcessSync",
    "Manifest",
    "SyncStats",
    "TensorSpec",
    "WeightSync",
    "WeightSyncError",
    "apply_weights",
    "buckets",
    "check_weights",
    "empty_bucket",
    "engine_qat",
    "flatten",
    "latest_on_disk",
    "load_from_disk",
    "named_weights",
    "plan_buckets",
    "receive_from_disk",
    "receive_ipc",
    "unflatten",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from k3post.distributed import weight_sync

        return getattr(weight_sync, name)
    raise AttributeError(f"module 'k3post.distributed' has no attribute {name!r}")
