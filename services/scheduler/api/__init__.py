"""The scheduler's protobuf edge: the only package that imports weft.v1 messages.

    servicer.py       the gRPC servicer: protobuf → dispatch → protobuf, nothing else
    convert.py        every protobuf ⇄ domain conversion (rungs, states, classes,
                      contracts, jobs, chunks, heartbeats, executor calls)
    events.py         the NATS listeners: MeshView (heartbeat, load, kv events → membership
                      and kv index) and the expiry of silent executors
    executor_port.py  ChannelPool: the executors over gRPC, as dispatch/job.ExecutorPort
"""
