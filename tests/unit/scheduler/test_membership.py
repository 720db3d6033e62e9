from services.scheduler.state.membership import ExecutorLoad, ExecutorRecord, ExecutorState, Membership


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def rec(name: str, state=ExecutorState.SERVING, address: str | None = None, model_id: str = "m") -> ExecutorRecord:
    return ExecutorRecord(name=name, address=address or f"{name}:1", model_id=model_id, block_size=16,
                          state=state, interval_s=1.0)


def test_executor_is_placeable_from_its_first_serving_heartbeat():
    m = Membership(missed_heartbeats=3, clock=FakeClock())
    assert m.heartbeat(rec("a", ExecutorState.JOINING)) is True
    assert m.placeable() == []
    assert m.heartbeat(rec("a")) is False
    assert [r.name for r in m.placeable()] == ["a"]


def test_executor_expires_after_missed_heartbeats_and_listeners_forget_it():
    clock = FakeClock()
    m = Membership(missed_heartbeats=3, clock=clock)
    removed = []
    m.on_removed(lambda r: removed.append(r.name))
    m.heartbeat(rec("a"))
    m.heartbeat(rec("b"))
    clock.now += 2.5
    m.heartbeat(rec("b"))
    assert m.expire() == []
    clock.now += 0.6  # a: 3.1 s silent > 3 × 1 s
    assert [r.name for r in m.expire()] == ["a"]
    assert removed == ["a"] and [r.name for r in m.placeable()] == ["b"]


def test_draining_executor_stays_known_but_gets_no_work():
    m = Membership(clock=FakeClock())
    m.heartbeat(rec("a"))
    m.heartbeat(rec("a", ExecutorState.DRAINING))
    assert m.get("a") is not None and m.placeable() == []


def test_same_name_at_new_address_replaces_the_old_process():
    m = Membership(clock=FakeClock())
    removed = []
    m.on_removed(lambda r: removed.append(r.address))
    m.heartbeat(rec("a", address="h1:1"))
    m.update_load("a", ExecutorLoad(num_running=3))
    assert m.heartbeat(rec("a", address="h2:1")) is True
    assert removed == ["h1:1"] and m.get("a").address == "h2:1" and m.get("a").load is None


def test_load_report_is_kept_across_heartbeats_and_ignored_for_unknown_executors():
    m = Membership(clock=FakeClock())
    m.update_load("ghost", ExecutorLoad(num_running=1))
    assert m.get("ghost") is None
    m.heartbeat(rec("a"))
    m.update_load("a", ExecutorLoad(num_running=2, num_free_blocks=5, num_blocks=10))
    m.heartbeat(rec("a"))
    assert m.get("a").load.num_running == 2


def test_refresh_all_restarts_the_expiry_clock():
    clock = FakeClock()
    m = Membership(missed_heartbeats=1, clock=clock)
    m.heartbeat(rec("a"))
    clock.now += 5
    m.refresh_all()
    assert m.expire() == []


def test_placeable_filters_by_model():
    m = Membership(clock=FakeClock())
    m.heartbeat(rec("a", model_id="x"))
    m.heartbeat(rec("b", model_id="y"))
    assert [r.name for r in m.placeable("y")] == ["b"]
    assert [r.name for r in m.placeable()] == ["a", "b"]
