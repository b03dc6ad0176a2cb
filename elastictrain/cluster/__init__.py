"""The job's processes as a cluster: where this process sits (``env``), the store every worker
shares (``job_store``), the restart-safe handshake and process groups (``handshake``,
``groups``), the leaf collectives everything else uses (``collectives``), which TCP connections
are an epoch's (``connections``) and heartbeats that find a frozen peer or store (``liveness``).

Nothing here knows of checkpoints, training or membership epochs; imported by all of them. Its
``__init__`` imports nothing, so importing one module costs only that module.
"""
