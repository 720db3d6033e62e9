"""Issue 17, unlucky operator: ``weft up`` setting flags with values no service parser
refused but no service could use must fail before anything starts, naming the flag:
control characters, NaN / infinity and past-int64 integers for number flags (``x < 0``
checks let NaN through), and a device torch cannot name. Sensible values still pass."""
from __future__ import annotations

import pytest

from weft.launcher.setting_checks import check_settings


@pytest.mark.parametrize(("dest", "value", "flag"), [
    ("request_timeout_s", "nan", "--request-timeout-s"),
    ("priority_interval_s", "inf", "--priority-interval-s"),
    ("block_second_ms", "1e309", "--block-second-ms"),
    ("default_tool_ms", "-inf", "--default-tool-ms"),
    ("max_in_flight", "99999999999999999999999", "--max-in-flight"),
    ("max_queue", "99999999999999999999999", "--max-queue"),
    ("num_kv_blocks", "99999999999999999999999", "--num-kv-blocks"),
    ("served_model_name", "tiny\x00", "--served-model-name"),
    ("tenant_quotas", "a=1\n", "--tenant-quotas"),
    ("device", "", "--device"),
    ("device", "gpu0", "--device"),
])
def test_a_hostile_setting_fails_before_start_naming_its_flag(dest, value, flag):
    with pytest.raises(ValueError) as err:
        check_settings({dest: value})
    assert str(err.value).startswith(flag)


@pytest.mark.parametrize(("dest", "value"), [
    ("request_timeout_s", "30"), ("max_queue", "0"), ("num_kv_blocks", "none"), ("device", "cuda:1"),
    ("served_model_name", "modèle-ünï"), ("max_in_flight", str(2**31)),
])
def test_sensible_settings_still_pass(dest, value):
    check_settings({dest: value})


@pytest.mark.parametrize(("dest", "flag"), [("num_threads", "--num-threads"), ("default_tool_ms", "--default-tool-ms")])
def test_a_negative_count_or_pause_fails_before_start_naming_its_flag(dest, flag):
    with pytest.raises(ValueError) as err:
        check_settings({dest: "-1"})
    assert str(err.value).startswith(flag)
