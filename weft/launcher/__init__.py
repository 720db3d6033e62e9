"""``weft up``'s launcher: runs the mesh as local processes, supervises them, and serves
``weft ps`` / ``weft scale`` / ``weft chaos`` through a state file and a control endpoint.

    mesh_spec       the one table of services (commands, ports, settings, health); compose renders it too
    options         UpOptions: what a caller asks of the launcher
    launcher        the mechanism: render the table, start, wait healthy, scale, stop
    running         an instance's state-file record and its live process
    supervision     answers unplanned deaths (mechanism) ...
    restart_policy  ... with this pure policy (backoff, crash loop)
    chaos           deliberate kill / pause / resume / restart (weft chaos)
    control         the token-protected loopback HTTP endpoint and its clients
    mesh_state      the state file (mesh.json) that weft ps / top / scale / chaos read
    startup_checks  what is checked before anything starts; a failure in one line

Helpers are handed the launcher as a Protocol (``SupervisedMesh``, ``ChaosTarget``,
``ControlTarget``) and import nothing of ``launcher.py``: imports point one way,
launcher -> {supervision, chaos, control} -> {mesh_spec, mesh_state, options, running}.
Importing this package imports nothing (the CLI reads ``mesh_state`` without grpc or torch).
"""
