"""An undefined request class sent straight to the scheduler is refused naming the field.

Before the reshape the scheduler failed such a request with INTERNAL (a ValueError from
the enum's ``Name``); after it, ``job_from_pb`` read it as "unspecified" and served it under
a class the caller never asked for. The router refuses it as INVALID_ARGUMENT naming
``session.request_class``; the scheduler's own door now does the same.
"""
from __future__ import annotations

import pytest

from services.scheduler.api import convert
from services.scheduler.errors import InvalidScheduleRequest
from weft.v1 import common_pb2, scheduler_pb2


def test_an_undefined_request_class_is_refused_naming_the_field():
    bad = scheduler_pb2.ScheduleRequest(request_id="r", prompt_token_ids=[1, 2], tenant="t",
                                        session=common_pb2.SessionInfo(request_class=99))
    with pytest.raises(InvalidScheduleRequest) as err:
        convert.job_from_pb(bad)
    assert err.value.field == "session.request_class"


def test_unspecified_and_every_known_class_still_pass():
    for value in common_pb2.RequestClass.values():
        ok = scheduler_pb2.ScheduleRequest(request_id="r", prompt_token_ids=[1, 2], tenant="t",
                                           session=common_pb2.SessionInfo(request_class=value))
        job = convert.job_from_pb(ok)
        assert (job.request_class is None) == (value == common_pb2.REQUEST_CLASS_UNSPECIFIED)
