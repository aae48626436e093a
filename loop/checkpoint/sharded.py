"""A sharded checkpoint's files (train.strategy=fsdp: `.metadata`, `__<rank>_0.distcp`) read as
plain data, as every other checkpoint file is (store.py::load). torch.distributed.checkpoint (DCP)
unpickles `.metadata` with plain pickle, and the shards' non-tensor items (the optimizer's
param_groups) with torch.load(weights_only=False): a tampered file would run code there. So
`metadata()` reads `.metadata` allowing only the classes DCP writes in it, and loads each such
item with weights_only=True, before DCP reads any of them.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch

from loop.checkpoint.store import refused
from loop.errors import BadInput

DCP_CLASSES = "torch.distributed.checkpoint.metadata"  # Metadata and the dataclasses it holds
ALSO = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
        ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath")}  # Python 3.13 names them so


class _Refused(pickle.UnpicklingError):
    pass


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        # Checked before anything is imported: importing a module runs its code.
        if "." not in name and ((module, name) in ALSO or module == DCP_CLASSES):
            found = super().find_class(module, name)
            if (module, name) in ALSO or (isinstance(found, type) and found.__module__ == module):
                return found
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):  # vars: no lazy import
            return vars(torch)[name]
        raise _Refused(f"Unsupported global: {module}.{name}")


def metadata(path: Path):
    """The DCP metadata of checkpoint `path`, it and the shards' non-tensor items checked to be
    plain data (BadInput naming the file if not)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    f = path / ".metadata"
    try:
        with open(f, "rb") as fh:
            meta = _PlainUnpickler(fh).load()
    except _Refused as e:
        raise refused(f, e) from None
    except Exception as e:  # any bytes that are no pickle fail in their own way
        raise BadInput(f"checkpoint file {f}: not the metadata of a sharded checkpoint ({type(e).__name__}: "
                       f"{str(e)[:120]}).") from None
    if not isinstance(meta, Metadata) or not isinstance(getattr(meta, "storage_data", None), dict):
        raise BadInput(f"checkpoint file {f}: not the metadata of a sharded checkpoint (it holds "
                       f"{type(meta).__name__}).")
    for index, where in meta.storage_data.items():
        if not isinstance(meta.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue  # a tensor: DCP reads those with weights_only=True
        item = path / where.relative_path
        try:
            with open(item, "rb") as fh:
                fh.seek(where.offset)
                data = fh.read(where.length)
        except OSError as e:
            raise BadInput(f"checkpoint file {item}: cannot read it ({e.strerror}).") from None
        if getattr(where, "transform_descriptors", None):  # the loop writes none: another tool's file
            raise BadInput(f"checkpoint file {item}: {index.fqn} is stored transformed "
                           f"({where.transform_descriptors}); expected a checkpoint this loop wrote.")
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise refused(item, e) from None
        except Exception as e:
            raise BadInput(f"checkpoint file {item}: {index.fqn} is not readable ({str(e)[:120]}).") from None
    return meta
