"""DCP's fsspec storage for checkpoints at URLs: the module modelpar takes it from, on every supported torch."""

from __future__ import annotations

import importlib.util
import warnings

from modelpar.checkpoint._remote import dcp_reader_storage, dcp_writer, fsspec_storage, to_location


def test_checkpoints_at_urls_use_torchs_public_fsspec_storage_where_torch_has_one():
    # torch 2.15 made it public and its private module (2.11-2.14's only one) an alias that warns it will be removed.
    public = "torch.distributed.checkpoint.fsspec_filesystem"
    expected = (
        public if importlib.util.find_spec(public) is not None else "torch.distributed.checkpoint._fsspec_filesystem"
    )
    location = to_location("memory://bucket/run/step-5")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        storage = fsspec_storage()
        writer = dcp_writer(location)
        fs, path = dcp_reader_storage(location)
    assert storage.__name__ == expected
    assert isinstance(writer, storage.FsspecWriter)
    assert type(fs).__name__.endswith("FileSystem") and str(path).endswith("bucket/run/step-5")
