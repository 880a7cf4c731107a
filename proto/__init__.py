"""The HARTS wire contract: protobuf messages (generated) plus array codecs and the plan validator.

`proto/` depends on numpy and protobuf only; both `planner_service` and `trainer` import it and
never each other.
"""
