"""HARTS planner: rollout ingestion, prefix forests, the two-level planner and the service."""
