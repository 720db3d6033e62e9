"""The scheduler's request path, domain types in and out (no protobuf):

    job.py          Job (one request), Chunk (one piece of its stream), the ExecutorPort
                    the api layer provides (executor calls), ExecutorCallError
    dispatcher.py   Dispatcher.generate: agent plan → rung → admission → placement →
                    agent placement → relay, in that reading order
    relay.py        Relay: one executor stream after another (unreachable → next ranked;
                    died or hung mid-stream → migration.py continues it elsewhere)
    agent_steps.py  AgentSteps: agent_plane.py's decisions on the path (sessions, priority,
                    pauses, demote / promote), a collaborator of the dispatcher
    degrade_steps.py DegradeSteps: the degradation ladder on the path (the served rung)
"""
