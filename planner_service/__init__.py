"""HARTS planner: rollout ingestion, prefix forests, the two-level planner and the service (docs/design/).

    ingest/       rollout batches (JSON, protobuf) -> validated prefix `Forest` (`forest.py`)
    planner/      the two-level planner: a Forest and a PlanConfig -> harts.v1.Plan
    topology.py   the trainer topology declared once: wire <-> PlanConfig, HTTP, CLI derive from it
    ids.py        step ids (a submission's batch_id): what the service accepts
    core/         the service's domain: PlannerCore and its parts, no transport
    store/        the durable step stores behind one protocol and one fault state machine
    transport/    HTTP and gRPC adapters over the core, one error table for both
    server.py     one process, one core, both transports (`harts serve`)
    errors.py     the error types every layer raises; wire_errors.py names a bad protobuf field
"""
