"""The checkpoint writer's process-wide switches, in one process."""

import pytest


def test_crc32_is_skipped_while_saving_and_restored_after():
    """Shard files are SHA-256-checked at load, so saves skip torch.save's CRC32; the user's
    setting comes back when the last save using the switch leaves, also after an error."""
    from torch.serialization import get_crc32_options, set_crc32_options

    from higgs_megatron.checkpoint.save import crc32_skipped

    assert get_crc32_options()
    with crc32_skipped():
        with crc32_skipped():  # a sync save inside an async writer's window
            assert not get_crc32_options()
        assert not get_crc32_options()
    assert get_crc32_options()
    with pytest.raises(OSError), crc32_skipped():
        raise OSError("disk full")
    assert get_crc32_options()
    set_crc32_options(False)  # a user who switched it off keeps it off
    try:
        with crc32_skipped():
            pass
        assert not get_crc32_options()
    finally:
        set_crc32_options(True)
