"""Reading saved state as tensors and plain data only: loading a file never runs code from it.

`torch.save` writes a pickle, and unpickling calls whatever functions the file names: a crafted trainer.pt
would run a shell command the moment a resume loaded it. So every file a resume, `infer`, an adapter or a
pipeline stage reads is safetensors, JSON, or goes through here:

  load_tensors     torch.load(weights_only=True): tensors, numbers, strings, lists, tuples, dicts
  check_dcp        a torch.distributed.checkpoint folder (FSDP), before dcp.load reads it
  check_deepspeed  a DeepSpeed checkpoint folder (ZeRO), before DeepSpeed's load_checkpoint reads it

A file holding anything else is refused with one line naming it (a ValueError: the CLI prints it as
`prog: error: ...` and exits 2)."""

from __future__ import annotations

import io
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch


def refusal(name: str | Path, what: str, error: Exception) -> ValueError:
    """The one-line error for a file (or folder) whose pickle named something beyond tensors and plain data."""
    # torch's message is a page long; the global it refused (e.g. posix.system) is the part worth a line
    named = re.search(r"GLOBAL (\S+)", str(error))
    found = f" ({named.group(1)})" if named else ""
    return ValueError(f"{name}: this {what} holds something other than tensors and plain data{found}; "
                      f"not loaded, as loading it could run code from it")


def load_tensors(path: str | Path, what: str = "checkpoint file", safe_globals: tuple = (), mmap: bool = False) -> Any:
    """The file's contents, read with torch.load(weights_only=True) onto the CPU; a ValueError naming it when it
    holds anything else. `safe_globals`: classes a third-party writer stores that are data only."""
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise refusal(str(path), what, e) from None


# --- torch.distributed.checkpoint (FSDP)
# DCP's FileSystemReader reads `.metadata` with plain pickle.load, and its default planner reads every
# non-tensor entry (the optimizer's lr, betas, ...) with torch.load(weights_only=False); neither can be told
# otherwise (torch 2.13). What a .metadata legitimately names, found by saving FSDP2 LoRA and full fine-tuning
# checkpoints: DCP's own record classes, the shapes, dtypes and layout of the tensors, and the folder it was
# written to. Names, not imports: an allowed module is imported only once the file asks for it.
_DCP_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
                 "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name, "torch.strided"
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath"),  # where Python 3.13 defines them
}


class _DcpMetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that builds only the classes above (and torch dtypes): anything else is refused
    before its module is even imported."""

    def find_class(self, module: str, name: str) -> Any:
        # torch.__dict__, not getattr: torch's module __getattr__ imports submodules on first use
        is_dtype = module == "torch" and isinstance(torch.__dict__.get(name), torch.dtype)
        if (module, name) in _DCP_METADATA_CLASSES or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not one a checkpoint's metadata holds")


def check_dcp(folder: str | Path) -> None:
    """Refuse a DCP checkpoint folder whose metadata or non-tensor entries hold anything but plain data, before
    dcp.load unpickles them (DCP reads the tensors themselves with weights_only=True).

    Checked here, on every rank, rather than inside dcp.load: an error raised in there comes back as DCP's
    CheckpointException (a BaseException carrying each rank's traceback), not one line."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata  # deferred: only FSDP needs DCP

    folder = Path(folder)
    with open(folder / ".metadata", "rb") as fh:
        try:
            metadata = _DcpMetadataUnpickler(fh).load()
        except pickle.UnpicklingError as e:
            raise refusal(str(folder / ".metadata"), "checkpoint metadata", e) from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{folder / '.metadata'}: holds a {type(metadata).__name__}, not a checkpoint's metadata; "
                         f"not loaded")
    for index, where in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            with open(folder / where.relative_path, "rb") as fh:
                fh.seek(where.offset)
                entry = io.BytesIO(fh.read(where.length))
            try:
                torch.load(entry, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:
                raise refusal(f"{folder / where.relative_path} (entry {index.fqn})", "checkpoint file", e) from None


# --- DeepSpeed (ZeRO)
def _deepspeed_data_classes() -> tuple:
    """Classes besides tensors DeepSpeed 0.19's ZeRO-2/3 optimizer files store, found by saving them (fp32 on CPU:
    LoRA, full, optimizer offload): the static loss scaler (its scale), the ZeRO stage (an int enum) and a
    fragment's address (numel, start). Data only: unpickling one sets its attributes and runs no DeepSpeed code."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler  # deferred: only a ZeRO resume imports DeepSpeed
    from deepspeed.runtime.zero.config import ZeroStageEnum  # deferred: as above
    from deepspeed.utils.tensor_fragment import fragment_address  # deferred: as above

    return LossScaler, ZeroStageEnum, fragment_address


def check_deepspeed(folder: str | Path) -> None:
    """Refuse a DeepSpeed checkpoint folder with a .pt file holding anything but tensors, plain data and the
    classes above, before DeepSpeed reads them: its checkpoint engine calls torch.load(weights_only=False) and
    has no setting for it. Every rank reads every file (ZeRO-1/2 reads all ranks' optimizer partitions)."""
    for path in sorted(Path(folder).rglob("*.pt")):
        # mapped, not read in: only the pickle is checked here, DeepSpeed reads the tensors next
        load_tensors(path, "DeepSpeed checkpoint file", _deepspeed_data_classes(), mmap=zipfile.is_zipfile(path))
